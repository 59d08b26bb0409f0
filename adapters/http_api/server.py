"""Running the app on uvicorn: in the foreground (``chatcore serve``) or on a thread (tests, benchmarks)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class RunningServer:
    """A uvicorn server on a thread; ``url`` is its base (``http://127.0.0.1:PORT/v1``)."""

    server: Any
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def start_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> RunningServer:
    """Start ``app`` on a thread and wait until it listens; port 0 takes a free port."""
    import uvicorn

    from chatcore.errors import ChatcoreError

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="chatcore-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise ChatcoreError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return RunningServer(server, thread, host, int(bound))
