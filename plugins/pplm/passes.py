"""What PPLM's optimisation loop needs from a way of running the model: the runner interface.

One decoding step (:class:`chatcore.plugins.pplm.perturb.Perturbation`) and its gradient
iterations (:class:`chatcore.plugins.pplm.loop.Optimiser`) are written once, over a
:class:`PassRunner`; two runners implement it:

- :class:`chatcore.plugins.pplm.model_passes.ModelPasses`: every pass through the inner step
  (transformers' forward, and any steerer inside PPLM) on a fresh cache, with dense deltas;
- :class:`chatcore.plugins.pplm.lean_passes.LeanPasses`: the passes through
  :class:`chatcore.plugins.pplm.runner.Runner`, from the past as tensors, with low-rank deltas.

A runner's deltas (``DeltasT``) are opaque to the loop: it starts them with
:meth:`PassRunner.zero_deltas` (None stands for zeros), asks for the gradients of the
loss w.r.t. :meth:`PassRunner.leaves`, and lets the runner's :class:`Gradient` take the
step the loop scales.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

    from chatcore.api import Step, StepOutput, StepState

    from .kv import GrowingPast, Past
    from .loop import Setup

DeltasT = TypeVar("DeltasT")
OutputT = TypeVar("OutputT", bound="PassOutput")


class PassOutput(Protocol):
    """What the loop reads of a pass: (b, V) next-token logits and, if asked, the hidden
    states (embeddings first, each (b, 1, C))."""

    @property
    def logits(self) -> torch.Tensor: ...

    @property
    def hidden_states(self) -> tuple[torch.Tensor, ...] | None: ...


class Gradient(Protocol[DeltasT]):
    """The gradient of one iteration's loss w.r.t. the deltas, times the window's weights."""

    def squared_norms(self) -> torch.Tensor:
        """(layers, b) squared norms per perturbed layer and row, keys and values together."""
        ...

    def step(self, deltas: DeltasT | None, scales: torch.Tensor) -> DeltasT:
        """``deltas - scales * gradient``, with ``scales`` (layers, b) per layer and row."""
        ...


class PassRunner(Protocol[DeltasT, OutputT]):
    """The passes of one decoding step, and the deltas they run with.

    ``state`` arguments are the fed token's state (all rows, or the rows still writing),
    ``base`` the past the perturbation starts from (per layer (keys, values)).
    """

    def merges(self, state: StepState) -> bool:
        """Whether the plain pass can double as the first iteration's forward."""
        ...

    def plain(self, state: StepState, past_length: int, merge: bool) -> tuple[StepOutput | None, Past]:
        """The plain pass (None if ``merge``: the first iteration runs it) and the plain past
        before the fed token."""
        ...

    def plain_from(self, first: OutputT) -> StepOutput:
        """The plain pass's output from the first iteration's pass (zero deltas)."""
        ...

    def zero_deltas(self, setup: Setup) -> DeltasT | None:
        """The deltas the iterations start from: zeros (None: zeros not built)."""
        ...

    def leaves(self, setup: Setup, deltas: DeltasT | None) -> tuple[torch.Tensor, ...]:
        """The tensors whose gradients make the deltas' gradient (built under grad mode)."""
        ...

    def run(
        self, state: StepState, base: Past, deltas: DeltasT | None, leaves: tuple[torch.Tensor, ...], hidden: bool
    ) -> OutputT:
        """One pass of the fed token from ``base`` + ``deltas`` (``leaves`` empty: no
        gradient wanted); ``hidden``: with hidden states."""
        ...

    def gradient(
        self, output: OutputT, grads: tuple[torch.Tensor, ...], weights: torch.Tensor | None
    ) -> Gradient[DeltasT]:
        """The deltas' gradient from the leaves' ``grads``, times the (W,) window ``weights``."""
        ...

    def spread(self, deltas: DeltasT, rows: torch.Tensor, batch: int) -> DeltasT:
        """The deltas of ``rows`` in a batch of ``batch`` rows, zeros for the others."""
        ...

    def carry(
        self,
        perturbed: Past | GrowingPast | None,
        base: Past,
        deltas: DeltasT | None,
        rows: torch.Tensor | None,
        output: OutputT,
        capacity: int,
    ) -> Past | GrowingPast:
        """The perturbed past of the next step: ``base`` with the final deltas (of ``rows``,
        or all) baked in and the perturbed pass's ``output`` fed token appended.
        ``capacity``: how many positions the reply's past may reach."""
        ...

    def horizon_start(self, past: Past) -> Any:
        """What the first soft-token pass runs from: ``past`` (the plain past and the fed token)."""
        ...

    def soft_pass(
        self, start: Any, soft: torch.Tensor, mask: torch.Tensor, position: torch.Tensor, layer: int, more: bool
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """A pass of soft input embeddings ``soft`` (b, 1, C) from ``start``: hidden state of
        ``layer`` (b, C), logits (b, V), and (if ``more`` are to come) the next pass's start."""
        ...


def plain_pass(inner: Step, state: StepState, needs_hidden: bool, summary: dict[str, Any]) -> StepOutput:
    """The inner step on ``state`` as the decoder runs it (hidden states if ``needs_hidden``)."""
    import torch

    with torch.no_grad():
        summary["inner_calls"] += 1
        return inner(state.replace(output_hidden_states=state.output_hidden_states or needs_hidden))


def key_mask_of(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """(B, T) bool keys to attend to, or None when every key counts (no left padding)."""
    mask = attention_mask.bool()
    return None if bool(mask.all()) else mask
