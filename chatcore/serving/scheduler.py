"""The scheduler: admits, queues and cancels replies; one thread runs the runner.

    scheduler = Scheduler(engine, max_batch=8, max_waiting=32)
    handle = scheduler.submit([Message("user", "hi!")], ReplyOptions(seed=1))
    for token_id in handle.tokens(): ...
    response = scheduler.respond(conversation)          # a Response, like engine.respond

The model is not thread-safe, so callers on any thread (HTTP handlers, a bot, Python)
only submit requests and read their handles. The scheduler never runs the model: its
thread admits waiting requests (up to ``max_batch`` replies in flight), drops cancelled
ones, and between admissions calls :meth:`Runner.step <chatcore.serving.runner.Runner.step>`,
which advances every reply by one token (:mod:`chatcore.serving.runner`: the shared
batch, the prefix cache, chunked prefill and the replies with step steerers beside it).

A request whose decoder or steerer needs a setup not made yet (a reverse model to load,
a block to read, a vector to compute: :meth:`Engine.setups_missing
<chatcore.engine.Engine.setups_missing>`) has it made on a thread of its own and then
joins the queue's head, so that the replies in flight never wait for it.

Past ``max_batch`` replies in flight and ``max_waiting`` waiting, ``submit`` raises
:class:`ServerBusy`. A reply whose plugin fails ends with that error alone; the model
failing in the shared pass ends every reply in it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chatcore.errors import ChatcoreError, OptionError
from chatcore.serving.prefix_cache import PrefixCache
from chatcore.serving.requests import Event, Handle, ServerBusy
from chatcore.serving.runner import DEFAULT_PREFILL_CHUNK, Runner

if TYPE_CHECKING:
    from chatcore.conversation import Conversation
    from chatcore.engine import Engine, ReplyOptions
    from chatcore.prompting import Message, PromptFormat
    from chatcore.response import Response

DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_WAITING = 64
DEFAULT_PREFIX_CACHE_BYTES = 256 * 2**20


@dataclass
class Request:
    """A submitted reply: what to reply to, how, and the caller's handle."""

    messages: "list[Message]"
    options: "ReplyOptions"
    handle: Handle
    prompt_format: "PromptFormat | None" = None
    set_up: bool = False  # its setups were made off the scheduler's thread (once is enough)


class Scheduler:
    """Decodes every submitted reply on one thread, batching those that can share a step."""

    def __init__(
        self,
        engine: "Engine",
        max_batch: int = DEFAULT_MAX_BATCH,
        max_waiting: int = DEFAULT_MAX_WAITING,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        if not isinstance(max_batch, int) or max_batch < 1:
            raise OptionError(f"`max_batch` must be a positive integer, got {max_batch!r}")
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise OptionError(f"`max_waiting` must be a non-negative integer, got {max_waiting!r}")
        if not isinstance(prefix_cache_bytes, int) or prefix_cache_bytes < 0:
            raise OptionError(f"`prefix_cache_bytes` must be a non-negative integer, got {prefix_cache_bytes!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise OptionError(f"`prefill_chunk` must be a positive integer, got {prefill_chunk!r}")
        self.engine = engine
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.runner = Runner(engine.loaded, engine, self.prefix_cache, prefill_chunk)
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.waiting: collections.deque[Request] = collections.deque()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._can_merge: bool | None = None
        # Replies submitted and not yet ended or cancelled: what the queue's bound counts.
        self._accepted: set[Handle] = set()
        self._setups: ThreadPoolExecutor | None = None  # makes decoders' and steerers' setups
        self._in_setup: list[Request] = []  # requests whose setups are being made

    # -- the callers' side -------------------------------------------------------------
    def submit(
        self,
        source: "Conversation | Sequence[Message]",
        options: "ReplyOptions | Mapping[str, Any] | None" = None,
        listener: Callable[[Event], None] | None = None,
        prompt_format: "PromptFormat | None" = None,
    ) -> Handle:
        """Queue a reply to a conversation or to messages (system first if any); ``options``
        as :meth:`Engine.options_for <chatcore.engine.Engine.options_for>` takes them (bad
        ones raise here); raises ServerBusy when the queue is full. Starts the scheduler's thread if needed."""
        from chatcore.conversation import Conversation
        from chatcore.engine import ReplyOptions

        if isinstance(source, Conversation):
            # Rendered from its messages as they are now: the caller's thread may add turns meanwhile.
            prompt_format = self.engine.format_for(source)
            source = source.messages()
        if not isinstance(options, ReplyOptions):  # None, or a mapping as the engine takes it
            options = self.engine.options_for(options)
        handle = Handle(listener)
        request = Request(list(source), options, handle, prompt_format)
        with self._lock:
            if self._stopping:
                raise ChatcoreError("the scheduler has stopped")
            if len(self._accepted) >= self.max_batch + self.max_waiting:
                replies = "reply" if self.max_batch == 1 else "replies"
                raise ServerBusy(
                    f"the server is busy: {self.max_batch} {replies} in progress and "
                    f"{len(self._accepted) - self.max_batch} waiting; try again shortly"
                )
            self.waiting.append(request)
            self._accepted.add(handle)
            handle._on_cancel = self._wake
            handle._on_release = self._accepted.discard
            self._lock.notify()
        self.start()
        return handle

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Requests submitted inside are admitted at the same step, room permitting: one batch."""
        with self._lock:  # the scheduler's thread admits under it
            yield

    def respond(self, conversation: "Conversation", options: "ReplyOptions | None" = None) -> "Response":
        """A reply to ``conversation`` decoded here, as a Response recorded in the
        conversation when it ends (the scheduler's counterpart of ``engine.respond``)."""
        handle = self.submit(conversation, options)
        return handle.response(
            self.engine.tokenizer, finalize=lambda response: self.engine.record(conversation, response)
        )

    @property
    def full(self) -> bool:
        """True when ``submit`` would raise ServerBusy now."""
        with self._lock:
            return self._stopping or len(self._accepted) >= self.max_batch + self.max_waiting

    def setting_up(self) -> int:
        """Requests whose decoder's or steerer's setup is being made beside the batch (a reverse
        model or a head loading); each joins the queue's head once its setup is made."""
        with self._lock:
            return len(self._in_setup)

    def in_flight(self) -> int:
        """Replies being decoded; a cancelled one no longer counts, so its slot is free at once."""
        return sum(not job.sink.cancelled for job in self.runner.jobs)

    @property
    def steps(self) -> int:
        """Forward passes of the shared batch so far (for tests and benchmarks)."""
        return self.runner.steps

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="chatcore-scheduler", daemon=True)
                self._thread.start()

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the thread after cancelling every reply."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        if self._setups is not None:  # a setup under way ends its request as cancelled
            self._setups.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "Scheduler":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _wake(self, handle: Handle) -> None:
        with self._lock:
            for request in list(self.waiting):
                if request.handle is handle:  # not started yet: gone from the queue at once
                    self.waiting.remove(request)
                    handle._end("cancelled")
            if any(request.handle is handle for request in self._in_setup):
                handle._end("cancelled")  # at once: its setup's end is not awaited
            self._lock.notify()

    # -- setups off the thread -------------------------------------------------------------
    def _set_up_beside(self, request: Request) -> None:
        """Make ``request``'s setups on the setup thread; it rejoins the queue's head after."""
        request.set_up = True
        with self._lock:
            if self._setups is None:
                self._setups = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatcore-setup")
            setups = self._setups
            self._in_setup.append(request)
        try:
            setups.submit(self._set_up, request)
        except RuntimeError:  # shut down: the scheduler is stopping
            request.handle._end("cancelled")

    def _set_up(self, request: Request) -> None:
        handle = request.handle
        try:
            if not handle.cancelled:
                self.engine.check_options(request.options)  # makes the setups, which the engine keeps
        except ChatcoreError as error:
            handle._end("error", error)
        except Exception as error:  # never let one request take the thread down
            handle._end("error", ChatcoreError(f"the reply failed to start: {type(error).__name__}: {error}"))
        with self._lock:
            self._in_setup.remove(request)
            if handle.finished.is_set():
                return
            if self._stopping or handle.cancelled:
                handle._end("cancelled")
                return
            self.waiting.appendleft(request)
            self._lock.notify()

    # -- the thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self.runner.drop_cancelled()
            with self._lock:
                while not self._stopping and not self.waiting and not self.runner.jobs:
                    self._lock.wait()
                if self._stopping:
                    break
                admitted: list[Request] = []
                while self.waiting and self.in_flight() + len(admitted) < self.max_batch:
                    admitted.append(self.waiting.popleft())
            try:
                for request in admitted:
                    self._admit(request)
                self.runner.step()
            except Exception as error:  # a bug here must not leave callers waiting forever
                self.runner.cancel_all("error", ChatcoreError(f"the scheduler failed: {type(error).__name__}: {error}"))
        self.runner.cancel_all()
        for request in self.waiting:
            request.handle._end("cancelled")

    def _admit(self, request: Request) -> None:
        handle = request.handle
        if handle.cancelled:
            handle._end("cancelled")
            return
        try:
            if not request.set_up and self.engine.setups_missing(request.options):
                self._set_up_beside(request)
                return
            reply = self.engine.prepare_reply(request.messages, request.options, request.prompt_format)
            handle.provenance.update(reply.provenance)
            reply.provenance = handle.provenance
            handle.admitted = time.perf_counter()
            self.runner.add(handle, self.engine.start_session(reply), reply.decoder, reply.provenance)
        except ChatcoreError as error:
            handle._end("error", error)
        except Exception as error:  # never let one request take the thread down
            handle._end("error", ChatcoreError(f"the reply failed to start: {type(error).__name__}: {error}"))
