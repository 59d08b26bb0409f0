"""The bot's worker: one thread owns the conversation log, and runs short jobs.

The Discord gateway lives on an asyncio event loop that must answer heartbeats, so
nothing slow runs on it. The worker thread builds its resource (the engine, its serving
scheduler and the conversations, whose log connection then belongs to that same thread)
and runs jobs one at a time: resuming a conversation from the log, adding a user's turn
and recording a finished reply (the log writes both), and the slash commands' reads and
changes. Replies themselves never pass through it: the event loop submits them to the
scheduler, which decodes them, batched with other channels' replies, on its own thread.
``submit`` is called on the event loop and gives back an asyncio future; the worker hands
each result back to the loop with ``loop.call_soon_threadsafe``.

Two lanes: long jobs wait in a queue of ``queue_size`` (beyond it ``submit`` raises
:class:`WorkerBusy`), and short control jobs (the bot's turns and slash commands) go
ahead of them, up to :data:`MAX_CONTROL_JOBS` waiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from chatcore.errors import ChatcoreError

R = TypeVar("R")  # the resource the worker owns
T = TypeVar("T")  # a job's result

MAX_CONTROL_JOBS = 64

logger = logging.getLogger("chatcore.discord")


class WorkerBusy(ChatcoreError):
    """The reply queue is full."""


class WorkerClosed(ChatcoreError):
    """The worker is shutting down (or has stopped) and takes no more jobs."""


class JobControl:
    """What a running job checks between tokens: stop now, and why."""

    def __init__(self, future: "asyncio.Future[Any]", timeout_s: float | None) -> None:
        self._future = future
        self._deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        self._interrupt = threading.Event()

    def interrupt(self) -> None:
        self._interrupt.set()

    @property
    def stop_reason(self) -> str | None:
        """None while the job should go on; else "shutdown", "timeout" or "cancelled"."""
        if self._interrupt.is_set():
            return "shutdown"
        # Reading another thread's future state is a plain attribute read: safe enough
        # for a flag polled once per token.
        if self._future.cancelled():
            return "cancelled"
        if self._deadline is not None and time.monotonic() > self._deadline:
            return "timeout"
        return None

    def should_stop(self) -> bool:
        return self.stop_reason is not None


@dataclass
class _Item:
    job: Callable[[Any, JobControl], Any]
    future: "asyncio.Future[Any]"
    loop: asyncio.AbstractEventLoop
    timeout_s: float | None
    control: JobControl | None = field(default=None)


class InferenceWorker(Generic[R]):
    """One thread, one resource, one job at a time.

    worker = InferenceWorker(lambda: open_runtime(settings), queue_size=8, close=close_runtime)
    worker.start()
    await worker.ready()
    reply = await worker.submit(lambda runtime, control: runtime.reply(...))
    """

    def __init__(
        self,
        open_resource: Callable[[], R],
        *,
        queue_size: int,
        close_resource: Callable[[R], None] | None = None,
        name: str = "chatcore-inference",
    ) -> None:
        if not isinstance(queue_size, int) or queue_size < 1:
            raise ValueError(f"`queue_size` must be a positive integer, got {queue_size!r}")
        self._open_resource = open_resource
        self._close_resource = close_resource
        self.queue_size = queue_size
        self._replies: deque[_Item] = deque()
        self._controls: deque[_Item] = deque()
        self._condition = threading.Condition()
        self._closing = False
        self._current: _Item | None = None
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.completed = 0

    # -- lifecycle (event loop side) -------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    async def ready(self) -> None:
        """Wait until the resource is open; raises what opening it raised."""
        await asyncio.wrap_future(self._ready)

    @property
    def accepting(self) -> bool:
        return not self._closing and self._thread.is_alive() and self._ready.done() and self._ready.exception() is None

    @property
    def waiting(self) -> int:
        """Replies queued behind the one running."""
        return len(self._replies)

    @property
    def running(self) -> bool:
        return self._current is not None

    def submit(
        self,
        job: Callable[[R, JobControl], T],
        *,
        timeout_s: float | None = None,
        control: bool = False,
    ) -> "asyncio.Future[T]":
        """Queue ``job(resource, control)``; call from the event loop.

        Raises WorkerBusy when ``queue_size`` replies are already waiting and
        WorkerClosed after :meth:`stop` began. Cancelling the returned future drops a
        queued job and asks a running one to stop.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        item = _Item(job, future, loop, timeout_s)
        with self._condition:
            if self._closing or not self._thread.is_alive():
                raise WorkerClosed("the bot is shutting down")
            lane = self._controls if control else self._replies
            limit = MAX_CONTROL_JOBS if control else self.queue_size
            if len(lane) >= limit:
                raise WorkerBusy(f"{len(lane)} requests are already waiting")
            lane.append(item)
            self._condition.notify()
        return future

    async def stop(self, grace_s: float) -> None:
        """Take no more jobs, drop the queued ones, let the running one finish for up to
        ``grace_s`` seconds (then interrupt it), close the resource and end the thread."""
        with self._condition:
            self._closing = True
            dropped = list(self._replies) + list(self._controls)
            self._replies.clear()
            self._controls.clear()
            current = self._current
            self._condition.notify_all()
        for item in dropped:
            if not item.future.done():
                item.future.set_exception(WorkerClosed("the bot is shutting down"))
        if not self._thread.is_alive():
            return
        if current is not None:
            await asyncio.to_thread(self._thread.join, grace_s)
            if self._thread.is_alive() and current.control is not None:
                logger.info("interrupting the reply in flight")
                current.control.interrupt()
        await asyncio.to_thread(self._thread.join)

    # -- the worker thread --------------------------------------------------------
    def _run(self) -> None:
        try:
            resource = self._open_resource()
        except BaseException as error:  # noqa: BLE001 - reported to whoever awaits ready()
            self._closing = True
            self._ready.set_exception(error)
            return
        self._ready.set_result(None)
        try:
            while True:
                with self._condition:
                    while not (self._controls or self._replies or self._closing):
                        self._condition.wait()
                    if self._controls:
                        item = self._controls.popleft()
                    elif self._replies:
                        item = self._replies.popleft()
                    else:
                        break  # closing, and nothing left
                    if item.future.cancelled():
                        continue
                    item.control = JobControl(item.future, item.timeout_s)
                    self._current = item
                try:
                    result = item.job(resource, item.control)
                except Exception as error:  # delivered to the awaiting handler
                    self._deliver(item, None, error)
                else:
                    self._deliver(item, result, None)
                finally:
                    self._current = None
                    self.completed += 1
        finally:
            if self._close_resource is not None:
                try:
                    self._close_resource(resource)
                except Exception:
                    logger.exception("closing the inference worker's resource failed")

    @staticmethod
    def _deliver(item: _Item, result: Any, error: BaseException | None) -> None:
        def settle() -> None:
            if item.future.done():  # cancelled by the handler meanwhile
                return
            if error is not None:
                item.future.set_exception(error)
            else:
                item.future.set_result(result)

        try:
            item.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass
