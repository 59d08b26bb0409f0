"""A reply: lazy, streamed as text deltas, with its provenance.

Nothing is generated until the response is iterated (or ``text()`` is called).
Iterating yields text deltas as the decoder produces tokens; iterating again replays
them. When the reply ends (completely, or interrupted with :meth:`interrupt`), the
``on_done`` callbacks run once, in order; the conversation uses one to record the
reply and fire the ``on_response`` hook.

An interrupted reply (Ctrl-C, a timeout, a shutdown, an error part-way) keeps its text
cut back to its last whole word (:func:`chatcore.cutting.whole_words`): ``text()`` and
the conversation never end in half a word.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from chatcore.cutting import whole_words
from chatcore.streaming import IncrementalDetokenizer


def timings_of(provenance: dict[str, Any]) -> dict[str, Any]:
    """The reply's ``timings`` in its provenance (created on first use): seconds to the first
    token, in the queue, in all, and the token rate. Every part of chatcore that times a
    reply writes there through this."""
    timings: dict[str, Any] = provenance.setdefault("timings", {})
    return timings


class Response:
    """``cut_short()``, asked when the token source has ended, says whether it was stopped
    from outside (its request cancelled): the reply then ends interrupted."""

    def __init__(
        self,
        token_source: Callable[[], Iterator[int]],
        tokenizer: Any,
        provenance: dict[str, Any],
        finalize: Callable[["Response"], None] | None = None,
        cut_short: Callable[[], bool] | None = None,
        started: float | None = None,
    ) -> None:
        self._token_source = token_source
        self._cut_short = cut_short
        self._tokenizer = tokenizer
        self._finalize = finalize
        self._chunks: list[str] = []
        self._iterator: Iterator[int] | None = None
        self._callbacks: list[Callable[["Response"], None]] = []
        self.token_ids: list[int] = []
        self.provenance: dict[str, Any] = provenance
        self.done = False
        self.interrupted = False
        self.error: BaseException | None = None
        # When the reply was asked for (a scheduler's submission), so that its total time
        # counts what its first token's does; else when it is first read.
        self._started: float | None = started

    @classmethod
    def ended(
        cls, tokenizer: Any, token_ids: list[int], text: str, provenance: dict[str, Any], interrupted: bool = False
    ) -> "Response":
        """A reply that was decoded and sent elsewhere (an HTTP completion), as ``on_response``
        sees one: ``text`` is what the client got."""
        response = cls(lambda: iter(()), tokenizer, provenance)
        response.token_ids = list(token_ids)
        response._chunks = [text] if text else []
        response.done, response.interrupted = True, interrupted
        return response

    def on_done(self, callback: Callable[["Response"], None]) -> None:
        """Run ``callback(response)`` when the reply ends (at once if it already has)."""
        if self.done:
            callback(self)
        else:
            self._callbacks.append(callback)

    def __iter__(self) -> Iterator[str]:
        yield from list(self._chunks)
        if self.done:
            return
        if self._iterator is None:
            if self._started is None:
                self._started = time.perf_counter()
            timings_of(self.provenance)
            self._iterator = self._token_source()
            self._detokenizer = IncrementalDetokenizer(self._tokenizer)
        try:
            for token in self._iterator:
                self.token_ids.append(token)
                delta = self._detokenizer.push(token)
                if delta:
                    self._chunks.append(delta)
                    yield delta
        except BaseException as error:
            # Ctrl-C (KeyboardInterrupt) or a consumer that stopped iterating
            # (GeneratorExit): keep the partial reply, marked interrupted. Any other
            # error is kept in ``self.error`` too.
            if not isinstance(error, (KeyboardInterrupt, GeneratorExit)):
                self.error = error
                # Cut by an error, not by the reader: the log and /history tell the two apart.
                self.provenance["error"] = f"{type(error).__name__}: {error}"
            self._finish(interrupted=True)
            raise
        tail = self._flush()
        cut = self._cut_short is not None and self._cut_short()
        self._finish(interrupted=cut)
        if tail and not cut:
            yield tail

    def _flush(self) -> str:
        if self._iterator is None or self._flushed:
            return ""
        self._flushed = True
        tail = self._detokenizer.flush()
        if tail:
            self._chunks.append(tail)
        return tail

    _flushed = False

    def _finish(self, interrupted: bool) -> None:
        if self.done:
            return
        if self._iterator is not None:
            close = getattr(self._iterator, "close", None)
            if close is not None:
                close()
        self._flush()
        if interrupted:
            kept = whole_words("".join(self._chunks))
            self._chunks = [kept] if kept else []
        self.done = True
        self.interrupted = interrupted
        elapsed = time.perf_counter() - self._started if self._started is not None else 0.0
        timings = timings_of(self.provenance)
        timings["total_s"] = round(elapsed, 4)
        timings["new_tokens"] = len(self.token_ids)
        timings["tokens_per_s"] = round(len(self.token_ids) / elapsed, 2) if elapsed > 0 else None
        self.provenance["interrupted"] = interrupted
        if self._finalize is not None:
            self._finalize(self)
        for callback in self._callbacks:
            callback(self)
        self._callbacks.clear()

    def interrupt(self) -> None:
        """Stop generating; the reply so far is kept, cut back to its last whole word, and
        marked interrupted."""
        if self._iterator is None and not self.done and self._started is None:
            self._started = time.perf_counter()
        self._finish(interrupted=True)

    @property
    def cut_by_budget(self) -> bool:
        """Whether the reply ended because it used its whole token budget (``max_new_tokens``)
        rather than where the model ended it: its ``finish_reason`` is ``"length"``."""
        return self.done and not self.interrupted and self.provenance.get("finish_reason") == "length"

    def text(self) -> str:
        """The whole reply (generating it if needed)."""
        for _ in self:
            pass
        return "".join(self._chunks)

    def __str__(self) -> str:
        return self.text()

    def to_dict(self) -> dict[str, Any]:
        text = self.text()
        return {"text": text, "token_ids": list(self.token_ids), **self.provenance, "cut_by_budget": self.cut_by_budget}
