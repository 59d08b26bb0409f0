"""The scheduler: one thread owns the engine and decodes every submitted reply.

    scheduler = Scheduler(engine, max_batch=8, max_waiting=32)
    handle = scheduler.submit([Message("user", "hi!")], ReplyOptions(seed=1))
    for token_id in handle.tokens(): ...
    response = scheduler.respond(conversation)          # a Response, like engine.respond

The model is not thread-safe, so callers on any thread (HTTP handlers, a bot, Python)
only submit requests and read their handles. Between two decoding steps the thread
admits waiting requests up to ``max_batch`` replies in flight, drops cancelled ones,
and then advances every reply by one token:

- replies that can share a batch (token decoders, steerers that declare
  ``shares_batch``) join one :class:`~chatcore.serving.batch.DecodingBatch`
  (continuous batching: they join and leave between steps);
- the others (MMI, PPLM, CoCon ...) each run their own decoding loop
  (:meth:`Engine.reply_tokens`), one token per turn, beside the batch.

A batched reply's prompt starts from the longest prefix the prefix cache holds
(:mod:`chatcore.serving.prefix_cache`); when it ends, what it fed the model is stored
there for the conversation's next turn.

Past ``max_batch`` replies in flight and ``max_waiting`` waiting, ``submit`` raises
:class:`ServerBusy`. A reply whose plugin fails ends with that error alone; the model
failing ends every reply in the batch.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chatcore.errors import ChatcoreError, OptionError
from chatcore.models import output_cache
from chatcore.serving.batch import BatchRow, DecodingBatch, batchable, blame, mergeable_cache
from chatcore.serving.prefix_cache import Layers, PrefixCache, cache_from_layers
from chatcore.serving.requests import Event, Handle, ServerBusy

if TYPE_CHECKING:
    from chatcore.conversation import Conversation
    from chatcore.decoding import GenerationSession
    from chatcore.engine import Engine, PreparedReply, ReplyOptions
    from chatcore.prompting import Message, PromptFormat
    from chatcore.response import Response

DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_WAITING = 64
DEFAULT_PREFIX_CACHE_BYTES = 256 * 2**20
DEFAULT_PREFILL_CHUNK = 256


@dataclass
class Request:
    """A submitted reply: what to reply to, how, and the caller's handle."""

    messages: "list[Message]"
    options: "ReplyOptions"
    handle: Handle
    prompt_format: "PromptFormat | None" = None


@dataclass
class Prefill:
    """A batched reply whose long prompt is run a chunk per turn before it joins the batch."""

    handle: Handle
    reply: "PreparedReply"
    session: "GenerationSession"
    done: int  # prompt tokens in ``cache``
    cache: Any = field(repr=False)


@dataclass
class SoloRow:
    """A reply decoded by its own loop (it cannot share the batch)."""

    handle: Handle
    reply: "PreparedReply"
    tokens: Iterator[int] = field(repr=False)


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
        # A longer new prompt is run this many tokens per turn, so the batch never waits long for it.
        self.prefill_chunk = prefill_chunk
        self.prefilling: list[Prefill] = []
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.batch = DecodingBatch(engine)
        self.solo: list[SoloRow] = []
        self.waiting: collections.deque[Request] = collections.deque()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._can_merge: bool | None = None
        # Replies submitted and not yet ended or cancelled: what the queue's bound counts.
        self._accepted: set[Handle] = set()
        self.steps = 0  # batched forward passes so far (for tests and benchmarks)

    # -- the callers' side -------------------------------------------------------------
    def submit(
        self,
        source: "Conversation | Sequence[Message]",
        options: "ReplyOptions | None" = None,
        listener: Callable[[Event], None] | None = None,
        prompt_format: "PromptFormat | None" = None,
    ) -> Handle:
        """Queue a reply to a conversation or to messages (system first if any); raises
        ServerBusy when the queue is full. Starts the scheduler's thread if needed."""
        from chatcore.conversation import Conversation
        from chatcore.engine import ReplyOptions

        if isinstance(source, Conversation):
            # Rendered from its messages as they are now: the caller's thread may add turns meanwhile.
            prompt_format = self.engine.format_for(source)
            source = source.messages()
        handle = Handle(listener)
        request = Request(list(source), options or ReplyOptions(), handle, prompt_format)
        with self._lock:
            if self._stopping:
                raise ChatcoreError("the scheduler has stopped")
            if len(self._accepted) >= self.max_batch + self.max_waiting:
                raise ServerBusy(
                    f"the server is busy: {self.max_batch} replies in progress and "
                    f"{len(self._accepted) - self.max_batch} waiting; try again shortly"
                )
            self.waiting.append(request)
            self._accepted.add(handle)
            handle._on_cancel = self._wake
            handle._on_release = self._accepted.discard
            self._lock.notify()
        self.start()
        return handle

    def respond(self, conversation: "Conversation", options: "ReplyOptions | None" = None) -> "Response":
        """A reply to ``conversation`` decoded here, as a Response recorded in the
        conversation when it ends (the scheduler's counterpart of ``engine.respond``)."""
        handle = self.submit(conversation, options)
        return handle.response(self.engine.tokenizer, finalize=conversation._record)

    @property
    def full(self) -> bool:
        """True when ``submit`` would raise ServerBusy now."""
        with self._lock:
            return self._stopping or len(self._accepted) >= self.max_batch + self.max_waiting

    def in_flight(self) -> int:
        """Replies being decoded; a cancelled one no longer counts, so its slot is free at once."""
        return sum(not row.handle.cancelled for row in self._rows())

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
            self._lock.notify()

    # -- the thread --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._drop_cancelled()
            with self._lock:
                while not self._stopping and not self.waiting and not self._rows():
                    self._lock.wait()
                if self._stopping:
                    break
                admitted: list[Request] = []
                while self.waiting and self.in_flight() + len(admitted) < self.max_batch:
                    admitted.append(self.waiting.popleft())
            try:
                for request in admitted:
                    self._admit(request)
                for prefill in list(self.prefilling):
                    self._step_prefill(prefill)
                if len(self.batch):
                    self._step_batch()
                for row in list(self.solo):
                    self._step_solo(row)
            except Exception as error:  # a bug here must not leave callers waiting forever
                self._fail_all(ChatcoreError(f"the scheduler failed: {type(error).__name__}: {error}"))
        for row in self._rows():
            row.handle._end("cancelled")
        for request in self.waiting:
            request.handle._end("cancelled")

    def _rows(self) -> list[Any]:
        """Every reply the thread holds: batched, prefilling and decoded alone."""
        return [*self.batch.rows, *self.prefilling, *self.solo]

    def _fail_all(self, error: ChatcoreError) -> None:
        rows: list[BatchRow | Prefill] = [*self.batch.rows, *self.prefilling]
        self.batch, self.prefilling = DecodingBatch(self.engine), []
        for row in rows:
            row.handle._end("error", error)
        for solo in list(self.solo):
            self._close_solo(solo, "error", error)

    def _admit(self, request: Request) -> None:
        handle = request.handle
        if handle.cancelled:
            handle._end("cancelled")
            return
        try:
            reply = self.engine.prepare_reply(request.messages, request.options, request.prompt_format)
            handle.provenance.update(reply.provenance)
            reply.provenance = handle.provenance
            handle.admitted = time.perf_counter()
            if batchable(reply) and self._merging():
                session = self.engine.start_session(reply)
                reused, layers = self.prefix_cache.lookup(reply.plan.token_ids)
                handle.provenance["prefix_cached_tokens"] = reused
                if len(reply.plan.token_ids) - reused > self.prefill_chunk:
                    cache = cache_from_layers(layers, self.engine.loaded.model.config) if layers else None
                    self.prefilling.append(Prefill(handle, reply, session, reused, cache))
                else:
                    self._start_row(handle, reply, session, (reused, layers))
            else:
                self.solo.append(SoloRow(handle, reply, self.engine.reply_tokens(reply)))
        except ChatcoreError as error:
            handle._end("error", error)
        except Exception as error:  # never let one request take the thread down
            handle._end("error", ChatcoreError(f"the reply failed to start: {type(error).__name__}: {error}"))

    def _start_row(
        self, handle: Handle, reply: "PreparedReply", session: "GenerationSession", prefix: "tuple[int, Layers | None]"
    ) -> None:
        """Run the rest of the prompt through the row's steerers, choose its first token, join the batch."""
        try:
            row, cache = self.batch.start_row(handle, reply, session, prefix)
        except Exception as error:
            raise blame(self.engine, reply, error) from error
        self._advance(row, cache)

    def _step_prefill(self, prefill: Prefill) -> None:
        """One more chunk of a long prompt; the last one starts the row."""
        prompt = prefill.reply.plan.token_ids
        try:
            if len(prompt) - prefill.done > self.prefill_chunk:
                try:
                    prefill.cache = self.batch.run_chunk(prompt, prefill.done, prefill.cache, self.prefill_chunk)
                except Exception as error:
                    raise ChatcoreError(
                        f"the model failed while reading the prompt: {type(error).__name__}: {error}"
                    ) from error
                prefill.done += self.prefill_chunk
                return
            self.prefilling.remove(prefill)
            layers = [(layer.keys, layer.values) for layer in prefill.cache.layers]
            self._start_row(prefill.handle, prefill.reply, prefill.session, (prefill.done, layers))
        except ChatcoreError as error:
            if prefill in self.prefilling:
                self.prefilling.remove(prefill)
            prefill.handle._end("error", error)

    def _merging(self) -> bool:
        """Whether the model's caches can be stacked (checked once, on a one-token pass)."""
        if self._can_merge is None:
            import torch

            ids = torch.tensor([[self.engine.eos_token_id]], device=self.engine.loaded.device)
            with torch.inference_mode():
                output = self.engine.loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
            self._can_merge = mergeable_cache(output_cache(output))
        return self._can_merge

    def _advance(self, row: BatchRow, cache: Any = None) -> bool:
        """Hand the row's newest token to its caller; end the row at a stop token or its budget.

        ``cache``: the row's own cache when it has just been started (it joins the batch
        unless it already ended). Returns whether the row goes on.
        """
        token = row.tokens[-1]
        if token in row.session.stop_ids:
            reason = "stop"
        else:
            row.handle._push(token)
            row.generated += 1
            reason = "length" if row.generated >= row.session.max_new_tokens else ""
        if reason:
            # What the row fed the model is the start of its conversation's next prompt.
            if cache is None:
                layers = self.batch.layers_of(row)
            else:
                layers = [(layer.keys, layer.values) for layer in cache.layers]
            self.prefix_cache.store(row.tokens[: row.cached], layers)
            row.tokens.pop()
            row.handle._end(reason)  # type: ignore[arg-type]
            return False
        if cache is not None:
            self.batch.join(row, cache)
        return True

    def _drop_cancelled(self) -> None:
        gone = [row for row in self.batch.rows if row.handle.cancelled]
        self.batch.drop(gone)
        for row in gone:
            row.handle._end("cancelled")
        for prefill in [p for p in self.prefilling if p.handle.cancelled]:
            self.prefilling.remove(prefill)
            prefill.handle._end("cancelled")
        for solo in [row for row in self.solo if row.handle.cancelled]:
            self._close_solo(solo, "cancelled")

    def _step_batch(self) -> None:
        try:
            logits = self.batch.forward()
            self.steps += 1
        except Exception as error:
            failure = ChatcoreError(f"the model failed while generating: {type(error).__name__}: {error}")
            rows = list(self.batch.rows)
            self.batch.drop(rows)
            for row in rows:
                row.handle._end("error", failure)
            return
        ended = []
        for index, row in enumerate(self.batch.rows):
            try:
                token = self.batch.choose(row, self.batch.steer(row, logits[index : index + 1]))
            except Exception as error:
                ended.append(row)
                row.handle._end("error", blame(self.engine, row.reply, error))
                continue
            row.tokens.append(token)
            if not self._advance(row):
                ended.append(row)
        self.batch.drop(ended)

    def _step_solo(self, row: SoloRow) -> None:
        import torch

        try:
            # Each loop is a generator that yields inside its own inference_mode block; entering
            # the mode around every resume keeps interleaved loops from restoring each other's state.
            with torch.inference_mode():
                token = next(row.tokens)
        except StopIteration:
            reason = "length" if len(row.handle.token_ids) >= row.reply.max_new_tokens else "stop"
            self._close_solo(row, reason)
            return
        except ChatcoreError as error:
            self._close_solo(row, "error", error)
            return
        row.handle._push(token)

    def _close_solo(self, row: SoloRow, reason: Any, error: ChatcoreError | None = None) -> None:
        import torch

        self.solo.remove(row)
        close = getattr(row.tokens, "close", None)
        if close is not None:
            with torch.inference_mode():  # as in _step_solo: the loop leaves its own block
                close()
        row.handle._end(reason, error)
