"""A reply being decoded (:class:`Job`), where its tokens go (:class:`Sink`) and who is blamed
when a plugin fails (:class:`Faults`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from chatcore.errors import ChatcoreError
from chatcore.serving.logprobs import TokenLogprob
from chatcore.step import Step

if TYPE_CHECKING:
    import torch

    from chatcore.decoding import Decoder, GenerationSession


class Sink(Protocol):
    """Where a reply's tokens and its end go (a :class:`chatcore.serving.requests.Handle`)."""

    @property
    def cancelled(self) -> bool: ...

    def _push(self, token_id: int, logprob: TokenLogprob | None = None) -> None: ...

    def _end(self, reason: Any, error: ChatcoreError | None = None) -> None: ...


class Faults(Protocol):
    """Turns a plugin's failure into its one-line error (the engine: it knows the plugins)."""

    def guard(self, plugin_object: Any, what: str, call: Callable[[], Any]) -> Any: ...

    def blame(self, error: Exception, decoder: "Decoder") -> ChatcoreError: ...


class PlainFaults:
    """Faults without a plugin registry: calls pass through; a failure while generating
    becomes a ChatcoreError that keeps the original as its cause."""

    def guard(self, plugin_object: Any, what: str, call: Callable[[], Any]) -> Any:
        return call()

    def blame(self, error: Exception, decoder: "Decoder") -> ChatcoreError:
        return ChatcoreError(f"decoding failed: {type(error).__name__}: {error}")


@dataclass(eq=False)
class Job:
    """One reply being decoded: its rows (all with the same prompt), their tokens and state."""

    sink: Sink
    session: "GenerationSession"
    decoder: "Decoder"
    provenance: dict[str, Any] = field(repr=False)
    rows: int
    processors: Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"] = field(repr=False)
    sequences: "torch.Tensor" = field(repr=False)  # (rows, prompt + budget): prompt, then chosen tokens
    attention: "torch.Tensor" = field(repr=False)  # (rows, prompt + budget): 0 after a row's stop token
    finished: "torch.Tensor" = field(repr=False)  # (rows,) bool: the row has chosen a stop token
    stops: "torch.Tensor" = field(repr=False)  # the stop ids below ``width`` (decoding.within)
    banned: "torch.Tensor" = field(repr=False)  # likewise, the banned ids
    width: int  # the score rows' length ``stops`` and ``banned`` were filtered for
    shared: bool  # its rows run in the shared batch (else eagerly, with a cache of its own)
    # An eager job whose steps may run on the runner's worker thread beside the batch's pass
    # (every steerer declares ``runs_beside``).
    beside: bool = False
    # What shapes a reply's scores, when the runner may process them stacked with other replies'
    # (see Runner._choose_plain): one row, row-wise processors, nothing noted per step; None else.
    lane: tuple[Any, ...] | None = None
    stop_set: frozenset[int] = frozenset()  # the session's stop ids, read once
    step: Step = field(init=False, repr=False)
    length: int = 0  # columns of ``sequences`` filled
    prompt_length: int = 0
    generated: int = 0  # steps taken: tokens chosen per row
    cached: int = 0  # tokens of each row in the shared cache (a shared job, once its prompt has run)
    prefilled: int = 0  # prompt tokens in ``cache`` before the prompt step (prefix cache, chunks)
    chosen: list[int] = field(default_factory=list, repr=False)  # a one-row reply's tokens so far, on the host
    waited: bool = False  # its prompt waited a step for another's keys (Runner._prefill_together)
    cache: Any = field(default=None, repr=False)  # an eager job's cache; a shared job's until it joins
    shared_logits: "torch.Tensor | None" = field(default=None, repr=False)  # its rows of the shared pass
    totals: "torch.Tensor | None" = field(default=None, repr=False)  # (rows,) forward log-probability sums
    counts: "torch.Tensor | None" = field(default=None, repr=False)  # (rows,) tokens in those sums
    observer: Callable[["torch.Tensor"], None] | None = field(default=None, repr=False)
    # Per step, each row's log-probabilities, when the reply asked for them (session.logprobs).
    logprobs: list[list[TokenLogprob]] | None = field(default=None, repr=False)

    @property
    def host_tokens(self) -> bool:
        """Whether its chosen tokens are kept on the host only (``chosen``), not written into
        ``sequences`` on the device: a reply in the shared batch with a lane (one row,
        processors that read no sequences) and no steerer, which nothing reads them from
        there (one write a reply a step saved: on a GPU, one launch each). An eager reply
        feeds its model from ``sequences``."""
        return self.shared and self.lane is not None and not self.session.steerers
