"""What a caller holds while the scheduler decodes its reply: a :class:`Handle`.

The scheduler's thread pushes events into the handle (each new token id, then the
end); the caller reads them from any thread: blocking (:meth:`Handle.tokens`, or the
lazy :class:`~chatcore.response.Response` of :meth:`Handle.response`), or through a
``listener`` called on the scheduler's thread (an asyncio server forwards events to its
loop with ``call_soon_threadsafe``). Cancelling a handle frees its slot at the next step.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from chatcore.errors import ChatcoreError
from chatcore.response import timings_of

if TYPE_CHECKING:
    from chatcore.response import Response
    from chatcore.serving.logprobs import TokenLogprob

FinishReason = Literal["stop", "length", "cancelled", "error"]


class ServerBusy(ChatcoreError):
    """Every batch slot and every place in the waiting queue is taken: try again later."""


@dataclass(frozen=True)
class Token:
    """A new token of the reply, with its log-probabilities when the reply asked for them."""

    token_id: int
    logprob: "TokenLogprob | None" = None


@dataclass(frozen=True)
class End:
    """The reply ended: ``reason`` says why; ``error`` is set when it failed."""

    reason: FinishReason
    error: ChatcoreError | None = None


Event = Token | End


class Handle:
    """One submitted reply.

    provenance:     the reply's provenance (model, decoder, seed, prompt_tokens ...), filled
                    in when the scheduler admits it; the Response adds its timings.
    token_ids:      the reply's tokens so far (stop tokens excluded).
    logprobs:       their log-probabilities, when the reply's options asked for them.
    finish_reason:  "stop" (a stop token), "length" (the token budget), "cancelled" or
                    "error"; None while it runs.
    error:          the one-line error of a failed reply.
    """

    def __init__(self, listener: Callable[[Event], None] | None = None) -> None:
        self.provenance: dict[str, Any] = {}
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: FinishReason | None = None
        self.error: ChatcoreError | None = None
        self.submitted = time.perf_counter()
        self.admitted: float | None = None
        self.first_token: float | None = None
        self.finished = threading.Event()
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._listener = listener
        self._cancelled = threading.Event()
        self._on_cancel: Callable[["Handle"], None] | None = None
        self._on_release: Callable[["Handle"], None] | None = None

    # -- the caller's side -----------------------------------------------------------
    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop the reply: its slot is freed before the next decoding step. Idempotent."""
        if self.finished.is_set() or self._cancelled.is_set():
            return
        self._cancelled.set()
        self._release()
        if self._on_cancel is not None:
            self._on_cancel(self)

    def tokens(self) -> Iterator[int]:
        """The reply's token ids as they come (blocking); raises the reply's error if it failed.

        Closing the iterator early (a consumer that stops reading) cancels the reply.
        """
        ended = False
        try:
            while True:
                event = self._events.get()
                if isinstance(event, Token):
                    yield event.token_id
                    continue
                ended = True
                if event.error is not None:
                    raise event.error
                return
        finally:
            if not ended:
                self.cancel()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the reply has ended; False if ``timeout`` passed first."""
        return self.finished.wait(timeout)

    def response(self, tokenizer: Any, finalize: Callable[["Response"], None] | None = None) -> "Response":
        """The reply as a lazy :class:`~chatcore.response.Response` (text deltas, provenance,
        ``interrupt()`` cancels); ``finalize`` runs when it ends (a conversation records it)."""
        from chatcore.response import Response

        response = Response(
            self.tokens, tokenizer, self.provenance, finalize=finalize, cut_short=self._was_cut, started=self.submitted
        )
        response.on_done(lambda _: self.cancel())  # interrupted before it was read: stop decoding it
        return response

    def cut(self, tokenizer: Any, finalize: Callable[["Response"], None] | None = None) -> "Response":
        """Stop the reply now and take what it has written so far, without waiting for the
        scheduler's next step (a plugin step may take long): a Response marked interrupted,
        its text cut back to its last whole word. A reply that had ended by itself before
        is returned whole, as :meth:`response` gives it."""
        from chatcore.response import Response

        self.cancel()
        if not self.cancelled:  # it had ended by itself
            return self.response(tokenizer, finalize)
        written = list(self.token_ids)  # the scheduler's thread may still push one more
        provenance = dict(self.provenance)
        provenance["timings"] = dict(provenance.get("timings") or {})
        provenance["timings"].update(self._waiting_timings(time.perf_counter()))
        provenance["finish_reason"] = "cancelled"
        return Response(lambda: iter(written), tokenizer, provenance, finalize=finalize, cut_short=lambda: True)

    def _was_cut(self) -> bool:
        """Whether the reply was stopped from outside: cancelled by its caller (even if its
        last step ended it as usual meanwhile) or by the scheduler closing."""
        return self.cancelled or self.finish_reason == "cancelled"

    # -- the scheduler's side --------------------------------------------------------
    def _push(self, token_id: int, logprob: "TokenLogprob | None" = None) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        self._emit(Token(token_id, logprob))

    def _end(self, reason: FinishReason, error: ChatcoreError | None = None) -> None:
        if self.finished.is_set():
            return
        self.finish_reason = reason
        self.error = error
        timings_of(self.provenance).update(self._waiting_timings(time.perf_counter()))
        self.provenance["finish_reason"] = reason
        self._emit(End(reason, error))
        self.finished.set()
        self._release()

    def _waiting_timings(self, now: float) -> dict[str, float]:
        """Seconds in the queue and to the first token (when it came)."""
        timings = {"queued_s": round((self.admitted or now) - self.submitted, 4)}
        if self.first_token is not None:
            timings["first_token_s"] = round(self.first_token - self.submitted, 4)
        return timings

    def _release(self) -> None:
        """Give the reply's place back to the scheduler (once: at its end or when cancelled)."""
        release, self._on_release = self._on_release, None
        if release is not None:
            release(self)

    def _emit(self, event: Event) -> None:
        self._events.put(event)
        if self._listener is not None:
            try:
                self._listener(event)
            except Exception:  # the listener is gone (a closed event loop): nobody reads this reply
                self._listener = None
                self.cancel()
