"""A lean one-token forward pass, on plain key/value tensors, for GPT-2 and Llama-family models.

PPLM runs the model several times per token from the same past with small additions
(deltas) on its most recent keys and values. Through a transformers forward each run
pays for the library's general machinery (argument handling, mask construction, a new
cache object, a concatenation of the whole past for every layer's update, and again to
add the deltas): on a small model that costs more than the arithmetic. This module runs
the same computation from the model's own parts, found through :mod:`chatcore.anatomy`:

- the past is read, never copied: the attention scores are ``q @ past_keys^T`` plus
  ``q @ delta_keys^T`` on the window, and the output adds ``p_window @ delta_values``,
  which is the attention over ``past + deltas`` without building that tensor;
- grouped-query attention is read as G queries per key/value head: the queries of a
  row are (H_kv, G, D), so the past is never repeated per query head;
- rotary models rotate the fed token's query and key with the ``(cos, sin)`` of its
  position (the cached keys are stored rotated, as the deltas are added to them);
- the fed token's own key and value are handed back, for the caller to append where it
  keeps its past;
- autograd records only what depends on the deltas (or on the soft input embeddings):
  the gradients asked for are w.r.t. probes, never the weights.

Measured on SmolLM2-135M-Instruct (``bench/pplm_speed.py --model smollm2 --threads 1``,
docs/pplm.md "Speed"), PPLM with this runner costs a fraction of the transformers-forward
path's time per token. Which models it takes: see :func:`supports`; the others run PPLM
through their transformers forward with fresh caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from chatcore.api import FULL_ATTENTION, anatomy_of, fast_path_mode

from .attention import SingleQueryAttention
from .deltas import LowRankDeltas
from .layers import ACTIVATIONS, GPT2Layer, Layer, Projections, RotaryLayer

if TYPE_CHECKING:
    from .kv import Past

__all__ = ["LowRankDeltas", "RunOutput", "Runner", "Start", "supports", "unsupported_reason"]

# Rotary families whose blocks are "x + attn(norm(x)); x + mlp(norm(x))" with no other
# terms (no soft-capped attention, no extra norms, no residual multipliers).
ROTARY_FAMILIES = ("llama", "qwen2", "mistral", "gemma", "phi3")


def unsupported_reason(model: Any) -> str | None:
    """Why :class:`Runner` cannot compute exactly what this model's forward does, or None."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type == "gpt2":
        if type(model).__name__ != "GPT2LMHeadModel" or getattr(config, "add_cross_attention", False):
            return "a GPT-2 model other than GPT2LMHeadModel without cross-attention"
        activation = getattr(config, "activation_function", None)
        if activation not in ACTIVATIONS:
            return f"GPT-2 activation {activation!r}"
        return None
    if model_type not in ROTARY_FAMILIES:
        return f"model type {model_type!r} (the runner knows gpt2, {', '.join(ROTARY_FAMILIES)})"
    from chatcore.api import UnsupportedModelError

    try:
        anatomy = anatomy_of(model)
    except UnsupportedModelError as error:
        return str(error)
    window = getattr(config, "sliding_window", None)
    if any(kind != FULL_ATTENTION for kind in anatomy.layer_kinds) and (window or 0) < anatomy.max_positions:
        return f"sliding-window attention ({window} of {anatomy.max_positions} positions)"
    for index in range(anatomy.n_layer):
        block, parts = anatomy.block(index), anatomy.attention(index)
        if not all(hasattr(block, name) for name in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return f"{type(block).__name__} is not a pre-norm attention + MLP block"
        if hasattr(block, "pre_feedforward_layernorm") or getattr(config, "attn_logit_softcapping", None):
            return f"{type(block).__name__} has extra norms or soft-capped attention"
        if parts.fused_qkv is None and None in (parts.query, parts.key, parts.value):
            return f"cannot find the query, key and value projections of {type(parts.module).__name__}"
    return None


def supports(model: Any) -> bool:
    """Whether :class:`Runner` computes exactly what this model's forward does."""
    return unsupported_reason(model) is None


@dataclass
class RunOutput:
    """logits: (B, V) float32 next-token scores; new: per layer the fed token's (keys,
    values), each (B, H_kv, 1, D); hidden_states: as transformers gives them (embeddings,
    each block's output, the last one after the final norm), each (B, 1, C), if asked.

    With probes: queries (layers', B, H_kv, G, D), the scaled (and rotated) queries, and
    window_probs (layers', B, H_kv, G, W), the attention probabilities over the window, of
    the perturbed layers (both detached): with the probes' gradients they make the
    gradients w.r.t. the deltas. start: what the pass computed below ``from_layer``, for
    later passes of the same tokens."""

    logits: torch.Tensor
    new: "Past"
    hidden_states: tuple[torch.Tensor, ...] | None = None
    queries: torch.Tensor | None = None
    window_probs: torch.Tensor | None = None
    start: "Start | None" = None


@dataclass
class Start:
    """What no delta changes in a pass of given tokens: everything below ``layer`` (the
    lowest perturbed one). x: (B, C) that layer's input; projections: its (q, k, v);
    rotary: the (cos, sin) of the fed positions, (B, 1, 1, R) each, or None; new: the fed
    token's keys and values of the layers below; states: the hidden states of the
    embeddings and the layers below (as in ``RunOutput.hidden_states``, (B, C))."""

    layer: int
    x: torch.Tensor
    projections: Projections
    rotary: tuple[torch.Tensor, torch.Tensor] | None
    new: "Past"
    states: list[torch.Tensor]


class Runner:
    """One-token forward passes of a GPT-2 or Llama-family model from a past given as tensors.

    The weights are read from the model's modules when the runner is built (detached
    views of the same storage, or small copies of the fused projections), so the runner
    is cheap to build once per response.
    """

    def __init__(self, model: Any) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            from chatcore.api import UnsupportedModelError

            raise UnsupportedModelError(f"PPLM's runner cannot run {type(model).__name__}: {reason}")
        self.model = model
        self.anatomy = anatomy = anatomy_of(model)
        self.kv_heads = anatomy.n_kv_head
        self.group = anatomy.n_head // anatomy.n_kv_head  # query heads per key/value head
        self.head_dim = anatomy.head_dim
        family = GPT2Layer if model.config.model_type == "gpt2" else RotaryLayer
        self.layers: list[Layer] = [family(anatomy, index) for index in range(anatomy.n_layer)]
        if fast_path_mode() == "compile":  # on a GPU: fewer, fused kernels (chatcore.plugins.pplm.compiled)
            from .compiled import compiled_layers

            self.layers = compiled_layers(self.layers)

    def usable(self) -> bool:
        """False while the model trains (dropout is on): then its own forward must run."""
        return not self.model.training

    def forward(
        self,
        past: "Past",
        position_ids: torch.Tensor,
        *,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        deltas: LowRankDeltas | None = None,
        probes: tuple[torch.Tensor, torch.Tensor] | None = None,
        hidden_states: bool = False,
        start: "Start | None" = None,
        from_layer: int = 0,
    ) -> RunOutput:
        """Run one new position per row after ``past``.

        past:          per layer (keys, values), each (B, H_kv, L, D); not modified, not copied.
        position_ids:  (B, 1) the new position's index.
        input_ids:     (B, 1) the fed tokens, or ``inputs_embeds`` (B, 1, C), taken as the
                       model's forward takes them.
        key_mask:      (B, L + 1) bool, False for keys to ignore (left padding), or None.
        from_layer:    the lowest layer that ``deltas`` and ``probes`` reach: they hold the
                       layers from this one up (layers - from_layer of them).
        deltas:        added to the keys and values of the most recent W positions of ``past``.
        probes:        zeros (layers', B, H_kv, G, W) added to the attention scores over that
                       window and (layers', B, H_kv, G, D) added to the attention output:
                       their gradients are the score and output gradients, from which the
                       deltas' gradients follow (see :class:`LowRankDeltas`).
        start:         ``RunOutput.start`` of an earlier pass of the same tokens with the same
                       ``from_layer``: everything below that layer (and its projections),
                       which no delta can change.
        """
        if start is None:
            start = self._start(past, position_ids, input_ids, inputs_embeds, key_mask, from_layer)
        assert start.layer == from_layer, (start.layer, from_layer)
        x, projections = start.x, start.projections
        batch = x.size(0)
        states: list[torch.Tensor] = list(start.states) if hidden_states else []
        mask = None if key_mask is None else key_mask.view(batch, 1, 1, -1)
        factors: list[tuple[torch.Tensor, ...]] | None = None
        if deltas is not None:
            dtype = projections[0].dtype
            factors = list(
                zip(
                    *(
                        t.to(dtype).unbind(0)
                        for t in (deltas.key_a, deltas.key_b.transpose(-1, -2), deltas.value_a, deltas.value_b)
                    )
                )
            )
        score_probes = output_probes = None
        if probes is not None:
            score_probes, output_probes = probes[0].unbind(0), probes[1].unbind(0)
        queries: list[torch.Tensor] = []
        window_probs: list[torch.Tensor] = []
        new: "Past" = list(start.new)
        for index in range(from_layer, len(self.layers)):
            offset = index - from_layer
            key_a = key_b_t = value_a = value_b = None
            if factors is not None:
                key_a, key_b_t, value_a, value_b = factors[offset]
            score_probe = None if score_probes is None else score_probes[offset]
            output_probe = None if output_probes is None else output_probes[offset]
            if index > from_layer:
                projections = self.layers[index].project(x, start.rotary)
            x, k, v, probs, q = self._block(
                index, x, projections, past[index], mask, (key_a, key_b_t, value_a, value_b), score_probe, output_probe
            )
            if output_probe is not None:
                assert score_probe is not None
                length = past[index][0].size(2)
                queries.append(q.detach())
                window_probs.append(probs[..., length - score_probe.size(-1) : length])
            new.append((k, v))
            if hidden_states and index < len(self.layers) - 1:
                states.append(x)
        x = self.anatomy.final(x)
        if hidden_states:
            states.append(x)
        logits = self.anatomy.logits(x).float()
        return RunOutput(
            logits=logits,
            new=new,
            hidden_states=tuple(h.unsqueeze(1) for h in states) if hidden_states else None,
            queries=torch.stack(queries) if queries else None,
            window_probs=torch.stack(window_probs) if window_probs else None,
            start=start,
        )

    def _start(
        self,
        past: "Past",
        position_ids: torch.Tensor,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        key_mask: torch.Tensor | None,
        layer: int,
    ) -> Start:
        """The input, and the layers below ``layer`` (which no delta reaches)."""
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"from_layer must be in [0, {len(self.layers)}), got {layer}")
        embedded = self.anatomy.embed(position_ids, input_ids=input_ids, inputs_embeds=inputs_embeds)  # (B, 1, C)
        rotary = None
        if self.anatomy.rotary is not None:
            cos, sin = self.anatomy.rotary(embedded, position_ids)  # (B, 1, R) each
            rotary = (cos.unsqueeze(1), sin.unsqueeze(1))
        x = embedded.flatten(0, 1)  # (B, C)
        mask = None if key_mask is None else key_mask.view(x.size(0), 1, 1, -1)
        states, new = [x], []
        projections = self.layers[0].project(x, rotary)
        for index in range(layer):
            x, k, v, _, _ = self._block(index, x, projections, past[index], mask, (None, None, None, None), None, None)
            new.append((k, v))
            states.append(x)
            projections = self.layers[index + 1].project(x, rotary)
        return Start(layer=layer, x=x, projections=projections, rotary=rotary, new=new, states=states)

    def _block(
        self,
        index: int,
        x: torch.Tensor,
        projections: Projections,
        layer_past: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        factors: tuple[torch.Tensor | None, ...],
        score_probe: torch.Tensor | None,
        output_probe: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        """One transformer block from its input ``x`` and projections: the block's output, the
        fed token's key and value, the attention probabilities and the (scaled) query."""
        q, k, v = projections
        keys, values = layer_past
        out, probs = SingleQueryAttention.apply(q, k, v, score_probe, keys, values, *factors, mask)
        if output_probe is not None:
            out = out + output_probe
        return self.layers[index].finish(x, out), k, v, probs, q
