"""Database calls with a deadline: a hung server costs the caller a bounded wait, never the whole outage.

A server that stops answering (stopped with SIGSTOP, a frozen virtual machine, a
network that drops packets) leaves a driver call blocked in ``recv`` with nothing to
wake it: a server-side ``statement_timeout`` cannot fire in a stopped process, and the
kernel keeps acknowledging TCP keepalives for it. So the log's writes run on one worker
thread of their own and the caller waits at most a deadline; a call that outlives it
goes on in the background (its write carries a key, so finishing later stores nothing
twice), and while it does every later call is refused at once, so calls never run side
by side and their order holds.

The same worker, without a deadline (:meth:`submit`), is the log's turn queue: a hook
hands it a turn and gets a future that resolves once the turn is held (committed or
journaled), so an event loop can await it instead of blocking.

The worker is a daemon thread: a call still blocked at exit never holds the process up.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from chatcore.log.errors import LogUnavailableError

T = TypeVar("T")

_STOP = None


class DeadlineWorker:
    """Runs calls one at a time on a daemon thread; :meth:`run` waits for each at most ``timeout_s``."""

    def __init__(self, name: str = "conversation-log-writer") -> None:
        self.name = name
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._current: Future[Any] | None = None

    @property
    def busy(self) -> bool:
        """A call that outlived its deadline is still running."""
        return self._current is not None and not self._current.done()

    def run(self, call: Callable[[], T], timeout_s: float) -> T:
        """``call()``'s result or exception; :class:`LogUnavailableError` when it does not end within
        ``timeout_s`` (it goes on in the background) or an earlier call is still running."""
        if self.busy:
            raise LogUnavailableError("the database has not answered an earlier write yet")
        future = self.submit(call)
        self._current = future
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            raise LogUnavailableError(f"the database did not answer within {timeout_s:g} s") from None

    def submit(self, call: Callable[[], T]) -> "Future[T]":
        """Queue ``call`` behind the calls before it and return its future at once (no deadline:
        the caller decides how long to wait, e.g. with ``asyncio.wrap_future`` on an event loop)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        future: Future[T] = Future()
        self._calls.put((call, future))
        return future

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait for a call that outlived its deadline to end; False if it is still running after ``timeout_s``."""
        current = self._current
        if current is None:
            return True
        try:
            current.exception(timeout=timeout_s)
        except FutureTimeout:
            return False
        return True

    def _serve(self) -> None:
        while True:
            item = self._calls.get()
            if item is _STOP:
                return
            call, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as error:  # handed to the waiting caller, who decides
                future.set_exception(error)

    def close(self) -> None:
        """Let the thread end once its current call (if any) returns; never waits for it."""
        if self._thread is not None:
            self._calls.put(_STOP)
            self._thread = None
