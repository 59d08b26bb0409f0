"""PPLM's passes through the inner step: any model, and steerers inside PPLM take part.

Every pass is the inner step (the model's transformers forward, wrapped by whatever
steerers sit inside PPLM) on a fresh ``DynamicCache`` built from the past plus dense
deltas (a forward appends to the cache it is given, so a cache is never reused), and
``torch.autograd.grad`` gives the gradients w.r.t. the dense deltas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from chatcore.api import StepOutput, cache_keyword, output_cache

from .deltas import apply_deltas
from .kv import fresh_cache, past_of
from .passes import plain_pass

if TYPE_CHECKING:
    from chatcore.api import Step, StepState

    from .config import PerturbConfig
    from .kv import GrowingPast, Past
    from .loop import Setup


@dataclass
class DenseGradient:
    """(2 * layers, b, H, W, D) gradient w.r.t. dense deltas, keys and values of each layer in turn."""

    grad: torch.Tensor

    def squared_norms(self) -> torch.Tensor:
        layers = self.grad.size(0) // 2
        return self.grad.square().sum((2, 3, 4)).view(layers, 2, -1).sum(1)  # (layers, b)

    def step(self, deltas: torch.Tensor | None, scales: torch.Tensor) -> torch.Tensor:
        assert deltas is not None, "dense deltas start as zeros"
        scales = scales.repeat_interleave(2, dim=0)  # (2 * layers, b)
        return deltas.sub_(self.grad * scales.view(*scales.shape, 1, 1, 1))


class ModelPasses:
    """:class:`chatcore.plugins.pplm.passes.PassRunner` through the inner step, with dense deltas:
    one (2 * perturbed layers, b, H, W, D) float32 leaf for all layers' key and value deltas
    (one gradient tensor, one update)."""

    def __init__(
        self, inner: Step, model: Any, config: PerturbConfig, needs_hidden: bool, summary: dict[str, Any]
    ) -> None:
        self.inner = inner
        self.model = model
        self.model_config = getattr(model, "config", None)
        self.config = config
        self.needs_hidden = needs_hidden
        self.summary = summary

    def merges(self, state: StepState) -> bool:
        return False  # the plain pass advances the decoder's cache; an iteration's pass does not

    def plain(self, state: StepState, past_length: int, merge: bool) -> tuple[StepOutput | None, Past]:
        plain = plain_pass(self.inner, state, self.needs_hidden, self.summary)
        return plain, past_of(plain.cache, past_length)

    def plain_from(self, first: StepOutput) -> StepOutput:
        raise AssertionError("ModelPasses runs its own plain pass (merges() is False)")

    def zero_deltas(self, setup: Setup) -> torch.Tensor:
        keys = setup.base[0][0]
        layers = len(setup.base) - setup.first_layer
        return torch.zeros(
            (2 * layers, keys.size(0), keys.size(1), setup.window, keys.size(3)),
            dtype=torch.float32,
            device=keys.device,
            requires_grad=True,
        )

    def leaves(self, setup: Setup, deltas: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        assert deltas is not None
        return (deltas,)

    def run(
        self,
        state: StepState,
        base: Past,
        deltas: torch.Tensor | None,
        leaves: tuple[torch.Tensor, ...],
        hidden: bool,
    ) -> StepOutput:
        first_layer = self.config.first_perturbed_layer(len(base))
        perturbed = apply_deltas(base, None if deltas is None else list(deltas.unbind(0)), first_layer)
        cache = fresh_cache(perturbed, self.model_config)
        self.summary["inner_calls"] += 1
        # A look-ahead pass: the reply continues from the plain pass, not from this one.
        return self.inner(state.replace(cache=cache, output_hidden_states=hidden, probe=True))

    def gradient(
        self, output: StepOutput, grads: tuple[torch.Tensor, ...], weights: torch.Tensor | None
    ) -> DenseGradient:
        (grad,) = grads
        return DenseGradient(grad if weights is None else grad * weights.view(1, 1, 1, -1, 1))

    def spread(self, deltas: torch.Tensor, rows: torch.Tensor, batch: int) -> torch.Tensor:
        final = deltas.detach()
        full = final.new_zeros((final.size(0), batch, *final.shape[2:]))
        return full.index_copy_(1, rows, final)

    def carry(
        self,
        perturbed: Past | GrowingPast | None,
        base: Past,
        deltas: torch.Tensor | None,
        rows: torch.Tensor | None,
        output: StepOutput,
        capacity: int,
    ) -> Past:
        return past_of(output.cache)  # the fresh cache of the perturbed pass: base + deltas + the fed token

    def horizon_start(self, past: Past) -> Any:
        return fresh_cache(past, self.model_config)

    def soft_pass(
        self, start: Any, soft: torch.Tensor, mask: torch.Tensor, position: torch.Tensor, layer: int, more: bool
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        out = self.model(
            inputs_embeds=soft,
            **{cache_keyword(self.model): start},
            attention_mask=mask,
            position_ids=position,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=1,
        )
        return out.hidden_states[layer][:, -1], out.logits[:, -1], output_cache(out)
