"""PPLM's gradient iterations for one decoding step, over any runner of the passes.

For the rows still writing: deltas (zeros to start) on the most recent ``window_length``
positions of the perturbed past; ``num_iterations`` times: run the fed token from past +
deltas, take loss = attribute loss + kl_scale * KL(p~ || p) per row, differentiate, and
step ``delta -= step * w * g / n ** gamma``, with ``step`` from
:meth:`PerturbConfig.step_size`, ``w`` the window's (decay) weights and ``n`` the largest
norm of ``w * g`` so far in the reply, per row and layer (keys and values together).
How the passes run and what the deltas are (dense, low-rank) is the runner's
(:class:`chatcore.plugins.pplm.passes.PassRunner`); the rest is here, written once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from .attribute import AttributeInputs
from .kv import past_length, past_of, select_rows

if TYPE_CHECKING:
    from chatcore.api import StepOutput, StepState

    from .attribute import AttributeModel
    from .config import PerturbConfig
    from .hidden import HiddenContext, ReplyHidden
    from .kv import Past
    from .passes import PassOutput, PassRunner

# Probabilities below this count as this in the KL term (as the paper's code does), so a
# token one distribution rules out does not make the loss infinite.
MIN_LOG_PROB = math.log(1e-15)
NORM_EPSILON = 1e-15

DeltasT = TypeVar("DeltasT")
OutputT = TypeVar("OutputT", bound="PassOutput")


def window_weights(window: int, decay: bool, device: Any = "cpu") -> torch.Tensor:
    """(W,) weights of the window's positions, oldest first: ones, or with ``decay`` a
    ramp 1/W, 2/W, ..., 1 that leaves the newest position the largest updates."""
    if not decay:
        return torch.ones(window, device=device)
    return torch.arange(1, window + 1, device=device, dtype=torch.float32) / window


def kl_divergence(log_probs: torch.Tensor, reference_log_probs: torch.Tensor) -> torch.Tensor:
    """(B,) KL(p || q) from log-probabilities (B, V); 0 when the two are equal."""
    log_p = log_probs.clamp(min=MIN_LOG_PROB)
    log_q = reference_log_probs.clamp(min=MIN_LOG_PROB)
    return (log_probs.exp() * (log_p - log_q)).sum(-1)


def fuse(
    logits: torch.Tensor, plain_log_probs: torch.Tensor, perturbed_log_probs: torch.Tensor, gm_scale: float
) -> torch.Tensor:
    """Scores whose softmax is p~^gm * p^(1-gm) (normalised): the plain ``logits`` shifted by
    gm * (log p~ - log p). Tokens the plain pass rules out (-inf) stay ruled out."""
    if gm_scale == 0.0:
        return logits
    shift = gm_scale * (perturbed_log_probs - plain_log_probs)
    shift = torch.where(torch.isfinite(plain_log_probs), shift, torch.zeros_like(shift))
    return logits + shift


def _select_state(state: StepState, rows: torch.Tensor) -> StepState:
    """The state of ``rows`` alone, with their row ids (see StepState.rows)."""
    indices = rows.tolist()
    ids = tuple(state.rows[i] for i in indices) if state.rows else tuple(indices)
    return state.replace(
        input_ids=state.input_ids[rows],
        sequences=state.sequences[rows],
        attention_mask=state.attention_mask[rows],
        position_ids=state.position_ids[rows],
        rows=ids,
    )


@dataclass
class Setup:
    """What the iterations of one step share (for the rows still writing: ``rows``, or all)."""

    rows: torch.Tensor | None
    state: StepState
    base: Past
    window: int
    first_layer: int  # the lowest perturbed layer (the deltas hold the layers from it up)
    weights: torch.Tensor | None  # (W,) decay weights, or None
    targets: Any
    reference: torch.Tensor | None  # (b, V) plain log-probabilities (None: the first pass is the plain one)
    hidden_context: HiddenContext | None
    record: dict[str, Any] | None
    past_norms: torch.Tensor | None  # (layers, b) a position's key/value norm per perturbed layer, or None


class Optimiser:
    """The gradient iterations of one reply: the loop, the loss, the gradient normalisation
    (and the largest gradient norms so far, per row and layer, that it divides by)."""

    def __init__(
        self,
        config: PerturbConfig,
        attribute: AttributeModel,
        eos_token_id: int,
        hidden: ReplyHidden,
        summary: dict[str, Any],
    ) -> None:
        self.config = config
        self.attribute = attribute
        self.eos_token_id = eos_token_id
        self.hidden = hidden
        self.summary = summary
        self.batch_size = 0
        self.reset()

    def reset(self) -> None:
        self.grad_norm_max: torch.Tensor | None = None  # (B, layers) largest gradient norm so far

    def active_rows(self, fed: StepState) -> torch.Tensor:
        """(B,) bool: rows still writing their reply (a fed EOS after the prompt ends one)."""
        if fed.step == 0:
            return torch.ones(fed.input_ids.size(0), dtype=torch.bool, device=fed.input_ids.device)
        return fed.input_ids[:, -1] != self.eos_token_id

    def optimise(
        self,
        runner: PassRunner[DeltasT, OutputT],
        fed: StepState,
        base: Past,
        plain: StepOutput | None,
        trace: list[dict[str, Any]] | None,
    ) -> tuple[DeltasT | None, torch.Tensor | None, OutputT | None]:
        """The final deltas of the rows still writing (None if none is), from ``base``, those
        rows (None: all), and the first iteration's pass when ``plain`` is None (then that
        pass, from zero deltas, is the plain pass: every row must be writing)."""
        setup = self.setup(fed, base, plain, trace)
        if setup is None:
            return None, None, None
        deltas = runner.zero_deltas(setup)
        first: OutputT | None = None
        for _ in range(self.config.num_iterations):
            with torch.enable_grad():
                leaves = runner.leaves(setup, deltas)
                hidden = self.attribute.needs_hidden or (setup.reference is None and setup.state.output_hidden_states)
                output = runner.run(setup.state, setup.base, deltas, leaves, hidden)
                log_probs = torch.log_softmax(output.logits.float(), dim=-1)  # (b, V)
                if setup.reference is None:  # this pass is the plain one
                    first, setup.reference = output, log_probs.detach()
                grads = torch.autograd.grad(self._loss(setup, log_probs, output, runner), leaves)
            with torch.no_grad():
                gradient = runner.gradient(output, grads, setup.weights)
                scales, norms = self._scales(gradient.squared_norms(), setup.rows, setup.past_norms)
                deltas = gradient.step(deltas, scales)  # deltas -= scales * w * g
            if setup.record is not None:
                setup.record["grad_norm"].append(norms.tolist())
        self.summary["optimised_steps"] += 1
        return deltas, setup.rows, first

    def setup(
        self, fed: StepState, base: Past, plain: StepOutput | None, trace: list[dict[str, Any]] | None
    ) -> Setup | None:
        """What the iterations of this step share, for the rows still writing (None if none is)."""
        config = self.config
        self.batch_size = fed.input_ids.size(0)
        active = self.active_rows(fed)
        if not bool(active.any()):
            return None
        rows = None if bool(active.all()) else active.nonzero().squeeze(1)
        assert plain is not None or rows is None, "the plain pass doubles as the first iteration only for all rows"
        sub_state, sub_base = fed, base
        if rows is not None:
            sub_state = _select_state(fed, rows)
            sub_base = select_rows(base, rows)
        length = past_length(sub_base)
        window = length if config.window_length == 0 else min(config.window_length, length)
        first_layer = config.first_perturbed_layer(len(base))
        reference = None
        if plain is not None:
            reference = torch.log_softmax(plain.logits.float(), dim=-1)
            reference = reference if rows is None else reference[rows]
        record = None
        if trace is not None:
            record = {
                "step": fed.step,
                "past_length": length,
                "window": window,
                "attribute": [],
                "kl": [],
                "grad_norm": [],
            }
            trace.append(record)
        hidden_context = None
        if self.attribute.needs_hidden:
            assert plain is not None, "the plain pass is the first iteration only without a discriminator"
            hidden_context = self.hidden.context(past_of(plain.cache), rows)
        return Setup(
            rows=rows,
            state=sub_state,
            base=sub_base,
            window=window,
            first_layer=first_layer,
            weights=window_weights(window, True, fed.input_ids.device) if config.decay else None,
            targets=self.attribute.step_targets(sub_state.sequences, fed.prompt_length),
            reference=reference,
            hidden_context=hidden_context,
            record=record,
            past_norms=None if config.stepsize is not None else _past_norms(sub_base, window, first_layer),
        )

    def _loss(
        self, setup: Setup, log_probs: torch.Tensor, output: PassOutput, runner: PassRunner[Any, Any]
    ) -> torch.Tensor:
        """Attribute loss + kl_scale * KL, summed over rows (they are independent)."""
        mean_hidden = None
        if setup.hidden_context is not None:
            mean_hidden = self.hidden.mean(output, log_probs, setup.state, setup.hidden_context, runner)
        attribute_loss = self.attribute.loss(AttributeInputs(log_probs, mean_hidden, setup.targets))  # (b,)
        assert setup.reference is not None
        kl = kl_divergence(log_probs, setup.reference)  # (b,)
        if setup.record is not None:
            setup.record["attribute"].append(attribute_loss.detach().tolist())
            setup.record["kl"].append(kl.detach().tolist())
        return (attribute_loss + self.config.kl_scale * kl).sum()

    def _scales(
        self, squares: torch.Tensor, rows: torch.Tensor | None, past_norms: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """From the (layers, b) squared norms of w * g: the (layers, b) scales of the gradient
        step, and the (b,) mean of n, the largest norm of w * g seen so far in this reply (per
        row and layer, keys and values together), as the paper's code does for bags of words:
        once the loss saturates its gradient is tiny, and dividing by that would make huge steps.

        With ``stepsize`` set the scale is stepsize / n ** gamma (the paper's); unset, it is
        relative_step * (a position's key/value norm in the layer's past) / n, so that a step
        is that share of the past it perturbs while the gradient is at its largest.
        """
        norms = self._running_norm_max(squares.sqrt().t() + NORM_EPSILON, rows)  # (b, layers)
        if past_norms is None:
            scales = (self.config.step_size(norms.size(1)) / norms.pow(self.config.gamma)).t()
        else:
            scales = self.config.relative_step(norms.size(1)) * past_norms / norms.t()
        return scales, norms.mean(1)

    def _running_norm_max(self, norms: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """(b, layers) norms -> the largest seen so far in the reply, per row and layer."""
        if self.grad_norm_max is None:
            self.grad_norm_max = torch.zeros((self.batch_size, norms.size(1)), device=norms.device)
        if rows is None:
            norms = torch.maximum(norms, self.grad_norm_max)
            self.grad_norm_max = norms
        else:
            norms = torch.maximum(norms, self.grad_norm_max[rows])
            self.grad_norm_max[rows] = norms
        return norms


def _past_norms(base: Past, window: int, first_layer: int) -> torch.Tensor:
    """(layers, b): the root-mean-square norm of one position's keys and values (together)
    over the window, in each perturbed layer's past."""
    squares = [
        keys[:, :, -window:].float().square().sum((1, 2, 3)) + values[:, :, -window:].float().square().sum((1, 2, 3))
        for keys, values in base[first_layer:]
    ]
    return (torch.stack(squares) / max(1, window)).sqrt()
