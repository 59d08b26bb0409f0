"""A lean one-token forward pass for GPT-2 models, on plain key/value tensors.

PPLM runs the model several times per token from the same past with small additions
(deltas) on its most recent keys and values. Through a transformers forward each run
pays for the library's general machinery (argument handling, mask construction, a new
cache object, a concatenation of the whole past for every layer's update, and again to
add the deltas): on a small model that costs more than the arithmetic. This module runs
the same computation straight from the model's own weights:

- the past is read, never copied: the attention scores are ``q @ past_keys^T`` plus
  ``q @ delta_keys^T`` on the window, and the output adds ``p_window @ delta_values``,
  which is the attention over ``past + deltas`` without building that tensor;
- the fed token's own key and value are handed back, for the caller to append where it
  keeps its past;
- the weights are detached: autograd records only what depends on the deltas (or on the
  soft input embeddings).

Only ``GPT2LMHeadModel`` without cross-attention is handled (see :func:`supports`);
other architectures go through their transformers forward with fresh caches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from chatcore.pplm.kv import Past


def supports(model: Any) -> bool:
    """Whether :class:`GPT2Runner` computes exactly what this model's forward does."""
    config = getattr(model, "config", None)
    return (type(model).__name__ == "GPT2LMHeadModel" and config is not None
            and getattr(config, "model_type", None) == "gpt2"
            and not getattr(config, "add_cross_attention", False)
            and getattr(config, "activation_function", None) in ACTIVATIONS
            and hasattr(model, "transformer") and hasattr(model, "lm_head"))


# transformers' names for the GELU variants GPT-2 checkpoints use, as torch functions.
ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


@dataclass
class LowRankDeltas:
    """Key and value deltas over the most recent W positions of every layer, as sums of
    outer products: per layer, row and head, ``delta_keys = key_a @ key_b`` (W, r) @ (r, D),
    and the same for values.

    With one query per row, the gradient of anything w.r.t. a layer's key deltas is an
    outer product (the score gradients over the window times the query), and so is the
    one w.r.t. its value deltas (the window's attention probabilities times the output
    gradient). Every PPLM step adds one such product, so after r iterations the deltas
    have rank r: kept that way, a pass reads the window through (r, W) and (r, D)
    factors instead of (W, D) tensors, and the dense deltas are never built unless
    they are baked into a past.

    key_a, value_a: (layers, B, H, W, r); key_b, value_b: (layers, B, H, r, D).
    """

    key_a: torch.Tensor
    key_b: torch.Tensor
    value_a: torch.Tensor
    value_b: torch.Tensor

    @property
    def window(self) -> int:
        return int(self.key_a.size(3))

    def plus(self, key_a: torch.Tensor, key_b: torch.Tensor, value_a: torch.Tensor,
             value_b: torch.Tensor) -> "LowRankDeltas":
        """These deltas plus one more outer product per layer, row and head:
        key_a, value_a (layers, B, H, W); key_b, value_b (layers, B, H, D)."""
        return LowRankDeltas(torch.cat([self.key_a, key_a.unsqueeze(-1)], dim=-1),
                             torch.cat([self.key_b, key_b.unsqueeze(-2)], dim=-2),
                             torch.cat([self.value_a, value_a.unsqueeze(-1)], dim=-1),
                             torch.cat([self.value_b, value_b.unsqueeze(-2)], dim=-2))

    @classmethod
    def outer(cls, key_a: torch.Tensor, key_b: torch.Tensor, value_a: torch.Tensor,
              value_b: torch.Tensor) -> "LowRankDeltas":
        """Rank-one deltas (shapes as in :meth:`plus`)."""
        return cls(key_a.unsqueeze(-1), key_b.unsqueeze(-2), value_a.unsqueeze(-1), value_b.unsqueeze(-2))

    def dense(self) -> torch.Tensor:
        """(2 * layers, B, H, W, D): keys and values of each layer in turn."""
        return torch.stack([self.key_a @ self.key_b, self.value_a @ self.value_b], dim=1).flatten(0, 1)

    def expand_rows(self, rows: torch.Tensor, batch: int) -> "LowRankDeltas":
        """The deltas of ``rows`` placed in a batch of ``batch`` rows (zeros elsewhere)."""

        def place(tensor: torch.Tensor) -> torch.Tensor:
            full = tensor.new_zeros((tensor.size(0), batch, *tensor.shape[2:]))
            return full.index_copy_(1, rows, tensor)

        return LowRankDeltas(place(self.key_a), place(self.key_b), place(self.value_a), place(self.value_b))


@dataclass
class RunOutput:
    """logits: (B, V) float32 next-token scores; new: per layer the fed token's (keys,
    values), each (B, H, 1, D); hidden_states: as transformers gives them (embeddings,
    each block's output, the last one after the final norm), each (B, 1, C), if asked.

    With probes: queries (layers', B, H, D), the scaled queries, and window_probs
    (layers', B, H, W), the attention probabilities over the window, of the perturbed
    layers (both detached): with the probes' gradients they make the gradients w.r.t.
    the deltas. start: what the pass computed below ``from_layer``, for later passes of
    the same tokens."""

    logits: torch.Tensor
    new: "Past"
    hidden_states: tuple[torch.Tensor, ...] | None = None
    queries: torch.Tensor | None = None
    window_probs: torch.Tensor | None = None
    start: "Start | None" = None


@dataclass
class Start:
    """What no delta changes in a pass of given tokens: everything below ``layer`` (the
    lowest perturbed one). x: (B, C) that layer's input; qkv: (B, 3C) its projections;
    new: the fed token's keys and values of the layers below; states: the hidden states
    of the embeddings and the layers below (as in ``RunOutput.hidden_states``, (B, C))."""

    layer: int
    x: torch.Tensor
    qkv: torch.Tensor
    new: "Past"
    states: list[torch.Tensor]


@dataclass
class _Layer:
    ln_1: tuple[torch.Tensor, torch.Tensor]
    qkv: tuple[torch.Tensor, torch.Tensor]  # Conv1D: weight (C, 3C), bias (3C,); queries scaled
    attn_out: tuple[torch.Tensor, torch.Tensor]
    ln_2: tuple[torch.Tensor, torch.Tensor]
    fc: tuple[torch.Tensor, torch.Tensor]
    proj: tuple[torch.Tensor, torch.Tensor]


def _pair(module: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return module.weight.detach(), module.bias.detach()


class _SingleQueryAttention(torch.autograd.Function):
    """Attention of one query per row over the past (with low-rank deltas and a probe on its
    most recent W positions) and the row's own new key, with the backward written out.

    Through autograd the same computation records some twenty small nodes per layer; on a
    small model their bookkeeping costs as much as the arithmetic. Inputs: q, k, v
    (B, H, 1, D), the query scaled; score_probe (B, H, 1, W) or None; keys, values
    (B, H, L, D); the deltas' factors (key_a (B, H, W, r), key_b_t (B, H, D, r), value_a
    (B, H, W, r), value_b (B, H, r, D)) or None; mask (B, 1, 1, L + 1) bool or None.
    Returns the output (B, H, 1, D) and the attention probabilities (B, H, 1, L + 1).
    The deltas' factors and the mask are constants (no gradient).
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_probe: torch.Tensor | None,
                keys: torch.Tensor, values: torch.Tensor, key_a: torch.Tensor | None, key_b_t: torch.Tensor | None,
                value_a: torch.Tensor | None, value_b: torch.Tensor | None,
                mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        length = keys.size(2)
        scores = q @ keys.transpose(-1, -2)  # (B, H, 1, L)
        window = 0
        if key_a is not None or score_probe is not None:
            window = key_a.size(2) if key_a is not None else score_probe.size(-1)  # type: ignore[union-attr]
            recent = scores[..., length - window :]
            if key_a is not None:
                recent += (q @ key_b_t) @ key_a.transpose(-1, -2)
            if score_probe is not None:
                recent += score_probe
        scores = torch.cat([scores, (q * k).sum(-1, keepdim=True)], dim=-1)  # (B, H, 1, L + 1)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = probs[..., :length] @ values + probs[..., length:] * v
        if value_a is not None:
            out += (probs[..., length - value_a.size(2) : length] @ value_a) @ value_b
        ctx.save_for_backward(q, k, v, probs, keys, values, key_a, key_b_t, value_a, value_b)
        ctx.window = window
        ctx.mark_non_differentiable(probs)
        return out, probs

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _: Any) -> tuple[torch.Tensor | None, ...]:
        q, k, v, probs, keys, values, key_a, key_b_t, value_a, value_b = ctx.saved_tensors
        length, window = keys.size(2), ctx.window
        grad_probs = torch.cat([grad_out @ values.transpose(-1, -2), (grad_out * v).sum(-1, keepdim=True)], dim=-1)
        if value_a is not None:
            grad_probs[..., length - value_a.size(2) : length] += \
                (grad_out @ value_b.transpose(-1, -2)) @ value_a.transpose(-1, -2)
        grad_scores = probs * (grad_probs - (probs * grad_probs).sum(-1, keepdim=True))  # softmax backward
        past_grad, new_grad = grad_scores[..., :length], grad_scores[..., length:]
        grad_q = grad_k = grad_v = grad_probe = None
        if ctx.needs_input_grad[0]:
            grad_q = past_grad @ keys + new_grad * k
            if key_a is not None:
                grad_q += (past_grad[..., length - window :] @ key_a) @ key_b_t.transpose(-1, -2)
        if ctx.needs_input_grad[1]:
            grad_k = new_grad * q
        if ctx.needs_input_grad[2]:
            grad_v = probs[..., length:] * grad_out
        if ctx.needs_input_grad[3]:
            grad_probe = past_grad[..., length - window :]
        grad_keys = grad_values = None  # a past that depends on what is optimised (the soft horizon's)
        if ctx.needs_input_grad[4]:
            grad_keys = past_grad.transpose(-1, -2) @ q
        if ctx.needs_input_grad[5]:
            grad_values = probs[..., :length].transpose(-1, -2) @ grad_out
        return grad_q, grad_k, grad_v, grad_probe, grad_keys, grad_values, None, None, None, None, None


class GPT2Runner:
    """One-token forward passes of a GPT-2 model from a past given as tensors.

    The weights are read from the model's modules when the runner is built (detached
    views of the same storage), so the runner is cheap to build once per response.
    """

    def __init__(self, model: Any) -> None:
        if not supports(model):
            raise TypeError(f"GPT2Runner needs a GPT-2 model, got {type(model).__name__}")
        config = model.config
        transformer = model.transformer
        self.model = model
        self.heads = int(config.n_head)
        self.hidden = int(config.n_embd)
        self.head_dim = self.hidden // self.heads
        self.eps = float(config.layer_norm_epsilon)
        self.activation = ACTIVATIONS[config.activation_function]
        self.wte = transformer.wte.weight.detach()
        self.wpe = transformer.wpe.weight.detach()
        self.ln_f = _pair(transformer.ln_f)
        self.lm_head = model.lm_head.weight.detach()
        self.layers = []
        for index, block in enumerate(transformer.h):
            scale = 1.0
            if getattr(config, "scale_attn_weights", True):
                scale = 1.0 / math.sqrt(self.head_dim)
            if getattr(config, "scale_attn_by_inverse_layer_idx", False):
                scale /= float(index + 1)
            weight, bias = _pair(block.attn.c_attn)
            if scale != 1.0:  # the attention's scale, folded into the query projection
                weight, bias = weight.clone(), bias.clone()
                weight[:, : self.hidden] *= scale
                bias[: self.hidden] *= scale
            self.layers.append(_Layer(ln_1=_pair(block.ln_1), qkv=(weight, bias),
                                      attn_out=_pair(block.attn.c_proj), ln_2=_pair(block.ln_2),
                                      fc=_pair(block.mlp.c_fc), proj=_pair(block.mlp.c_proj)))

    def usable(self) -> bool:
        """False while the model trains (dropout is on): then its own forward must run."""
        return not self.model.training

    def forward(self, past: "Past", position_ids: torch.Tensor, *, input_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
                deltas: LowRankDeltas | None = None,
                probes: tuple[torch.Tensor, torch.Tensor] | None = None,
                hidden_states: bool = False, start: "Start | None" = None, from_layer: int = 0) -> RunOutput:
        """Run one new position per row after ``past``.

        past:          per layer (keys, values), each (B, H, L, D); not modified, not copied.
        position_ids:  (B, 1) the new position's index.
        input_ids:     (B, 1) the fed tokens, or ``inputs_embeds`` (B, 1, C).
        key_mask:      (B, L + 1) bool, False for keys to ignore (left padding), or None.
        from_layer:    the lowest layer that ``deltas`` and ``probes`` reach: they hold the
                       layers from this one up (layers - from_layer of them).
        deltas:        added to the keys and values of the most recent W positions of ``past``.
        probes:        zeros (layers', B, H, 1, W) added to the attention scores over that
                       window and (layers', B, H, 1, D) added to the attention output: their
                       gradients are the score and output gradients, from which the
                       deltas' gradients follow (see :class:`LowRankDeltas`).
        start:         ``RunOutput.start`` of an earlier pass of the same tokens with the same
                       ``from_layer``: everything below that layer (and its projections),
                       which no delta can change.
        """
        if start is None:
            start = self._start(past, position_ids, input_ids, inputs_embeds, key_mask, from_layer)
        assert start.layer == from_layer, (start.layer, from_layer)
        x, qkv = start.x, start.qkv
        batch = x.size(0)
        states: list[torch.Tensor] = list(start.states) if hidden_states else []
        mask = None if key_mask is None else key_mask.view(batch, 1, 1, -1)
        factors: list[tuple[torch.Tensor, ...]] | None = None
        if deltas is not None:
            dtype = qkv.dtype
            factors = list(zip(*(t.to(dtype).unbind(0) for t in (deltas.key_a, deltas.key_b.transpose(-1, -2),
                                                                  deltas.value_a, deltas.value_b))))
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
                qkv = self._projections(index, x)
            x, k, v, probs, q = self._block(index, x, qkv, past[index], mask, (key_a, key_b_t, value_a, value_b),
                                            score_probe, output_probe)
            if output_probe is not None:
                assert score_probe is not None
                length = past[index][0].size(2)
                queries.append(q.detach())
                window_probs.append(probs[..., length - score_probe.size(-1) : length])
            new.append((k, v))
            if hidden_states and index < len(self.layers) - 1:
                states.append(x)
        x = F.layer_norm(x, (self.hidden,), self.ln_f[0], self.ln_f[1], self.eps)
        if hidden_states:
            states.append(x)
        logits = F.linear(x, self.lm_head).float()
        return RunOutput(logits=logits, new=new,
                         hidden_states=tuple(h.unsqueeze(1) for h in states) if hidden_states else None,
                         queries=torch.stack(queries).squeeze(3) if queries else None,
                         window_probs=torch.stack(window_probs).squeeze(3) if window_probs else None,
                         start=start)

    def _start(self, past: "Past", position_ids: torch.Tensor, input_ids: torch.Tensor | None,
               inputs_embeds: torch.Tensor | None, key_mask: torch.Tensor | None, layer: int) -> Start:
        """The input, and the layers below ``layer`` (which no delta reaches)."""
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"from_layer must be in [0, {len(self.layers)}), got {layer}")
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = F.embedding(input_ids, self.wte)
        x = (inputs_embeds + F.embedding(position_ids, self.wpe).to(inputs_embeds.dtype)).flatten(0, 1)  # (B, C)
        mask = None if key_mask is None else key_mask.view(x.size(0), 1, 1, -1)
        states, new = [x], []
        qkv = self._projections(0, x)
        for index in range(layer):
            x, k, v, _, _ = self._block(index, x, qkv, past[index], mask, (None, None, None, None), None, None)
            new.append((k, v))
            states.append(x)
            qkv = self._projections(index + 1, x)
        return Start(layer=layer, x=x, qkv=qkv, new=new, states=states)

    def _projections(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """(B, 3C) the layer's query (scaled), key and value projections of its input."""
        layer = self.layers[index]
        h = F.layer_norm(x, (self.hidden,), layer.ln_1[0], layer.ln_1[1], self.eps)
        return torch.addmm(layer.qkv[1], h, layer.qkv[0])

    def _block(self, index: int, x: torch.Tensor, qkv: torch.Tensor, layer_past: tuple[torch.Tensor, torch.Tensor],
               mask: torch.Tensor | None, factors: tuple[torch.Tensor | None, ...], score_probe: torch.Tensor | None,
               output_probe: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """One transformer block from its input ``x`` and projections ``qkv``: the block's output,
        the fed token's key and value, the attention probabilities and the (scaled) query."""
        layer = self.layers[index]
        batch = x.size(0)
        q, k, v = qkv.view(batch, 3, self.heads, 1, self.head_dim).unbind(1)  # each (B, H, 1, D)
        keys, values = layer_past
        out, probs = _SingleQueryAttention.apply(q, k, v, score_probe, keys, values, *factors, mask)
        if output_probe is not None:
            out = out + output_probe
        x = x + torch.addmm(layer.attn_out[1], out.reshape(batch, -1), layer.attn_out[0])
        h = F.layer_norm(x, (self.hidden,), layer.ln_2[0], layer.ln_2[1], self.eps)
        h = self.activation(torch.addmm(layer.fc[1], h, layer.fc[0]))
        return x + torch.addmm(layer.proj[1], h, layer.proj[0]), k, v, probs, q
