"""Running the app on uvicorn: in the foreground (``chatcore serve``) or on a thread (tests, benchmarks).

:class:`GracefulServer` is uvicorn's server with chatcore's shutdown (see :mod:`.shutdown`):
the first signal stops accepting and gives running replies ``grace`` seconds, a second one
cuts them at once; either way each stream ends with an error event and ``[DONE]``, and the
process exits 0 rather than by the signal.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    import socket
    from types import FrameType

    from chatcore.adapters.http_api.shutdown import LiveReplies

logger = logging.getLogger("chatcore.serve")
DEFAULT_SHUTDOWN_GRACE = 30.0  # seconds
# After the grace, the cut replies end within a step; uvicorn cancels whatever is left this much later.
BACKSTOP_S = 5.0


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, live: "LiveReplies", grace: float = DEFAULT_SHUTDOWN_GRACE) -> None:
        config.timeout_graceful_shutdown = int(grace + BACKSTOP_S)
        super().__init__(config)
        self.live = live
        self.grace = grace
        self.signals = 0
        self.stopping = threading.Event()  # set once the first signal has been handled
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: "list[socket.socket] | None" = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: "FrameType | None") -> None:
        """A signal (or a caller on any thread): the first drains, the second cuts at once.
        The signal is not re-raised after the shutdown, so the process exits 0."""
        self.signals += 1
        loop = self.loop
        if loop is None or loop.is_closed():
            self.should_exit = True
            return
        loop.call_soon_threadsafe(self._stop, self.signals == 1)

    def _stop(self, first: bool) -> None:
        live = self.live
        if first:
            live.drain()
            running = len(live.replies)
            logger.warning(
                "stopping: %d %s running %s %g s to finish (a second signal cuts them now)",
                running,
                "reply" if running == 1 else "replies",
                "gets" if running == 1 else "get",
                self.grace,
            )
            self.should_exit = True
            assert self.loop is not None
            self.loop.call_later(self.grace, self._cut)
            self.stopping.set()
        else:
            self._cut()

    def _cut(self) -> None:
        cut = self.live.cut()
        if cut:
            logger.warning("shutdown: %d replies cut", cut)


def make_server(app: Any, grace: float = DEFAULT_SHUTDOWN_GRACE, **options: Any) -> GracefulServer:
    """uvicorn for an app of :func:`.app.build_app` (whose running replies it cuts when it stops)."""
    return GracefulServer(uvicorn.Config(app, log_level="warning", lifespan="off", **options), app.state.live, grace)


@dataclass
class RunningServer:
    """A uvicorn server on a thread; ``url`` is its base (``http://127.0.0.1:PORT/v1``)."""

    server: GracefulServer
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def start_in_thread(
    app: Any, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0, grace: float = DEFAULT_SHUTDOWN_GRACE
) -> RunningServer:
    """Start ``app`` on a thread and wait until it listens; port 0 takes a free port."""
    from chatcore.errors import ChatcoreError

    server = make_server(app, grace, host=host, port=port)
    thread = threading.Thread(target=server.run, name="chatcore-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise ChatcoreError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return RunningServer(server, thread, host, int(bound))
