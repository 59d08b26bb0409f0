"""PPLM's passes through the lean runner (GPT-2 and Llama-family models, PPLM innermost).

The passes run through :class:`chatcore.plugins.pplm.runner.Runner` from the past as tensors,
and the deltas are kept as low-rank factors (:class:`chatcore.plugins.pplm.deltas.LowRankDeltas`):
with one query per row and head the gradient w.r.t. a layer's deltas is a sum of outer
products (one per query head of a key/value head), recovered from the gradients of two
small probes, so neither the deltas nor their gradients are built at full size. When the
perturbation starts from the plain past (no carried perturbation, every row writing) the
plain pass is the first iteration's forward. With ``layer_share`` below 1 every pass
after the first of a fed token starts at the lowest perturbed layer (the layers below see
no delta, so their output is the first pass's), and the backward passes stop there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from chatcore.api import StepOutput

from .deltas import LowRankDeltas
from .kv import GrowingPast, past_of
from .passes import key_mask_of, plain_pass

if TYPE_CHECKING:
    from chatcore.api import Step, StepState

    from .config import PerturbConfig
    from .kv import Past
    from .loop import Setup
    from .runner import Runner, RunOutput, Start


def _squared_norm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Squared Frobenius norm of a^T @ b per leading index, from (G, G) products."""
    return ((a @ a.transpose(-1, -2)) * (b @ b.transpose(-1, -2))).sum((-1, -2))


@dataclass
class LowRankGradient:
    """The deltas' gradient as factors, per layer, row and key/value head: the key deltas'
    is score_grad^T @ queries, (W, G) @ (G, D), a sum over the G query heads reading that
    key/value head, and the value deltas' is window_probs^T @ output_grad. The squared
    norm of a product A^T B is sum((A A^T) * (B B^T)) (G x G matrices), so the norm needs
    no (W, D) tensor, and a step adds G outer products.
    Shapes: (layers, b, H_kv, G, W) and (layers, b, H_kv, G, D)."""

    score_grad: torch.Tensor
    queries: torch.Tensor
    window_probs: torch.Tensor
    output_grad: torch.Tensor

    def squared_norms(self) -> torch.Tensor:
        keys = _squared_norm(self.score_grad, self.queries)
        values = _squared_norm(self.window_probs, self.output_grad)
        return (keys + values).sum(-1)  # (layers, b)

    def step(self, deltas: LowRankDeltas | None, scales: torch.Tensor) -> LowRankDeltas:
        descent = (-scales)[:, :, None, None, None]
        step = (
            (self.score_grad * descent).transpose(-1, -2),
            self.queries,
            (self.window_probs * descent).transpose(-1, -2),
            self.output_grad,
        )
        return LowRankDeltas(*step) if deltas is None else deltas.plus(*step)


class LeanPasses:
    """:class:`chatcore.plugins.pplm.passes.PassRunner` through the lean runner, for one decoding
    step (``state``: the step's state, whose decoder cache the plain pass advances)."""

    def __init__(
        self,
        runner: Runner,
        inner: Step,
        state: StepState,
        config: PerturbConfig,
        needs_hidden: bool,
        summary: dict[str, Any],
    ) -> None:
        self.runner = runner
        self.inner = inner
        self.state = state
        self.needs_hidden = needs_hidden
        self.summary = summary
        self.first_layer = config.first_perturbed_layer(len(runner.layers))
        self.starts: dict[int, Start] = {}  # per fed-token tensor: what no delta changes

    def merges(self, state: StepState) -> bool:
        return state.input_ids.size(1) == 1  # the prompt's pass is the model's own

    def plain(self, state: StepState, past_length: int, merge: bool) -> tuple[StepOutput | None, Past]:
        if state.input_ids.size(1) > 1:  # the whole prompt, through the model as the decoder would run it
            plain = plain_pass(self.inner, state, self.needs_hidden, self.summary)
            return plain, past_of(plain.cache, past_length)
        plain_past = past_of(state.cache)
        if merge:
            return None, plain_past
        with torch.no_grad():
            wants_hidden = state.output_hidden_states or self.needs_hidden
            return self.plain_from(self.run(state, plain_past, None, (), wants_hidden)), plain_past

    def plain_from(self, first: RunOutput) -> StepOutput:
        """The decoder's cache advanced by the fed token, and the pass's logits."""
        for index, (keys, values) in enumerate(first.new):
            self.state.cache.update(keys.detach(), values.detach(), index)
        hidden = None
        if first.hidden_states is not None:
            hidden = tuple(h.detach() for h in first.hidden_states)
        return StepOutput(logits=first.logits.detach(), cache=self.state.cache, hidden_states=hidden)

    def zero_deltas(self, setup: Setup) -> LowRankDeltas | None:
        return None

    def leaves(self, setup: Setup, deltas: LowRankDeltas | None) -> tuple[torch.Tensor, ...]:
        """Zero probes on the attention scores over the window and on the attention output."""
        keys = setup.base[0][0]
        layers, batch, heads, head_dim = len(setup.base) - self.first_layer, keys.size(0), keys.size(1), keys.size(3)
        group = self.runner.group
        return (
            keys.new_zeros((layers, batch, heads, group, setup.window), requires_grad=True),
            keys.new_zeros((layers, batch, heads, group, head_dim), requires_grad=True),
        )

    def run(
        self,
        state: StepState,
        base: Past,
        deltas: LowRankDeltas | None,
        leaves: tuple[torch.Tensor, ...],
        hidden: bool,
    ) -> RunOutput:
        self.summary["runner_passes"] += 1
        key = id(state.input_ids)
        output = self.runner.forward(
            base,
            state.position_ids,
            input_ids=state.input_ids,
            key_mask=key_mask_of(state.attention_mask),
            deltas=deltas,
            probes=(leaves[0], leaves[1]) if leaves else None,
            hidden_states=hidden,
            start=self.starts.get(key),
            from_layer=self.first_layer,
        )
        assert output.start is not None
        self.starts[key] = output.start
        return output

    def gradient(
        self, output: RunOutput, grads: tuple[torch.Tensor, ...], weights: torch.Tensor | None
    ) -> LowRankGradient:
        score_grad, output_grad = grads
        assert output.queries is not None and output.window_probs is not None
        score_grad, window_probs = score_grad.float(), output.window_probs.float()
        if weights is not None:
            score_grad, window_probs = score_grad * weights, window_probs * weights
        return LowRankGradient(score_grad, output.queries.float(), window_probs, output_grad.float())

    def spread(self, deltas: LowRankDeltas, rows: torch.Tensor, batch: int) -> LowRankDeltas:
        return deltas.expand_rows(rows, batch)

    def carry(
        self,
        perturbed: Past | GrowingPast | None,
        base: Past,
        deltas: LowRankDeltas | None,
        rows: torch.Tensor | None,
        output: RunOutput,
        capacity: int,
    ) -> GrowingPast:
        """In one growing buffer: the deltas are added to its window in place, the fed
        token's keys and values written after it."""
        grown = perturbed if isinstance(perturbed, GrowingPast) else GrowingPast(base, capacity)
        if deltas is not None and rows is None:
            grown.add_recent_products(deltas.key_a, deltas.key_b, deltas.value_a, deltas.value_b, self.first_layer)
        elif deltas is not None:
            grown.add_recent(deltas.dense(), rows, self.first_layer)
        grown.append(output.new)
        return grown

    def horizon_start(self, past: Past) -> Any:
        return past

    def soft_pass(
        self, start: Any, soft: torch.Tensor, mask: torch.Tensor, position: torch.Tensor, layer: int, more: bool
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        past: Past = start
        self.summary["runner_passes"] += 1
        future = self.runner.forward(past, position, inputs_embeds=soft, key_mask=key_mask_of(mask), hidden_states=True)
        assert future.hidden_states is not None
        if more:
            past = [
                (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2)) for (k, v), (nk, nv) in zip(past, future.new)
            ]
        return future.hidden_states[layer][:, -1], future.logits, past
