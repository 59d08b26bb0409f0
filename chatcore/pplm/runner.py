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
import torch.nn.functional as F

from chatcore.anatomy import FULL_ATTENTION, anatomy_of

if TYPE_CHECKING:
    from chatcore.anatomy import Anatomy
    from chatcore.pplm.kv import Past

# Rotary families whose blocks are "x + attn(norm(x)); x + mlp(norm(x))" with no other
# terms (no soft-capped attention, no extra norms, no residual multipliers).
ROTARY_FAMILIES = ("llama", "qwen2", "mistral", "gemma", "phi3")

# transformers' names for the GELU variants GPT-2 checkpoints use, as torch functions.
ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


def unsupported_reason(model: Any) -> str | None:
    """Why :class:`Runner` cannot compute exactly what this model's forward does, or None."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type == "gpt2":
        if type(model).__name__ != "GPT2LMHeadModel" or getattr(config, "add_cross_attention", False):
            return "a GPT-2 model other than GPT2LMHeadModel without cross-attention"
        if getattr(config, "activation_function", None) not in ACTIVATIONS:
            return f"GPT-2 activation {config.activation_function!r}"
        return None
    if model_type not in ROTARY_FAMILIES:
        return f"model type {model_type!r} (the runner knows gpt2, {', '.join(ROTARY_FAMILIES)})"
    from chatcore.anatomy import UnsupportedModelError

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
class LowRankDeltas:
    """Key and value deltas over the most recent W positions of every layer, as sums of
    outer products: per layer, row and key/value head, ``delta_keys = key_a @ key_b``
    (W, r) @ (r, D), and the same for values.

    With one query per row and query head, the gradient of anything w.r.t. a layer's key
    deltas is, per key/value head, a sum of G outer products (the score gradients over the
    window times the query, for each of the G query heads that read this key/value head),
    and so is the one w.r.t. its value deltas (the window's attention probabilities times
    the output gradient). Every PPLM step adds these G products, so after n iterations
    the deltas have rank n * G: kept that way, a pass reads the window through (r, W)
    and (r, D) factors instead of (W, D) tensors, and the dense deltas are never built
    unless they are baked into a past.

    key_a, value_a: (layers, B, H_kv, W, r); key_b, value_b: (layers, B, H_kv, r, D).
    """

    key_a: torch.Tensor
    key_b: torch.Tensor
    value_a: torch.Tensor
    value_b: torch.Tensor

    @property
    def window(self) -> int:
        return int(self.key_a.size(3))

    def plus(
        self, key_a: torch.Tensor, key_b: torch.Tensor, value_a: torch.Tensor, value_b: torch.Tensor
    ) -> "LowRankDeltas":
        """These deltas plus g more outer products per layer, row and head: key_a, value_a
        (layers, B, H_kv, W, g); key_b, value_b (layers, B, H_kv, g, D)."""
        return LowRankDeltas(
            torch.cat([self.key_a, key_a], dim=-1),
            torch.cat([self.key_b, key_b], dim=-2),
            torch.cat([self.value_a, value_a], dim=-1),
            torch.cat([self.value_b, value_b], dim=-2),
        )

    def dense(self) -> torch.Tensor:
        """(2 * layers, B, H_kv, W, D): keys and values of each layer in turn."""
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
    projections: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    rotary: tuple[torch.Tensor, torch.Tensor] | None
    new: "Past"
    states: list[torch.Tensor]


def _pair(module: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return module.weight.detach(), module.bias.detach()


class _GPT2Layer:
    """A GPT-2 block: LayerNorms, fused Conv1D projections (weights (in, out)), a GELU MLP."""

    def __init__(self, anatomy: "Anatomy", index: int) -> None:
        config, block = anatomy.config, anatomy.block(index)
        self.heads, self.head_dim, self.hidden = anatomy.n_head, anatomy.head_dim, anatomy.width
        self.eps = float(config.layer_norm_epsilon)
        self.activation = ACTIVATIONS[config.activation_function]
        scale = 1.0
        if getattr(config, "scale_attn_weights", True):
            scale = self.head_dim**-0.5
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(index + 1)
        weight, bias = _pair(block.attn.c_attn)
        if scale != 1.0:  # the attention's scale, folded into the query projection
            weight, bias = weight.clone(), bias.clone()
            weight[:, : self.hidden] *= scale
            bias[: self.hidden] *= scale
        self.ln_1, self.qkv, self.attn_out = _pair(block.ln_1), (weight, bias), _pair(block.attn.c_proj)
        self.ln_2, self.fc, self.proj = _pair(block.ln_2), _pair(block.mlp.c_fc), _pair(block.mlp.c_proj)

    def project(self, x: torch.Tensor, rotary: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, C) block input -> q (B, H, 1, D) scaled, k and v (B, H, 1, D)."""
        h = F.layer_norm(x, (self.hidden,), self.ln_1[0], self.ln_1[1], self.eps)
        qkv = torch.addmm(self.qkv[1], h, self.qkv[0])
        q, k, v = qkv.view(x.size(0), 3, self.heads, 1, self.head_dim).unbind(1)
        return q, k, v

    def finish(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The block's output from its input and the attention output (B, H, 1, D)."""
        x = x + torch.addmm(self.attn_out[1], attention.reshape(x.size(0), -1), self.attn_out[0])
        h = F.layer_norm(x, (self.hidden,), self.ln_2[0], self.ln_2[1], self.eps)
        h = self.activation(torch.addmm(self.fc[1], h, self.fc[0]))
        return x + torch.addmm(self.proj[1], h, self.proj[0])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (..., D) by (cos, sin) (..., R), R <= D: the first R features
    rotate (halves swapped, as transformers' ``rotate_half``), the rest pass."""
    rotary = cos.size(-1)
    turned, passed = x[..., :rotary], x[..., rotary:]
    first, second = turned.chunk(2, dim=-1)
    turned = turned * cos + torch.cat([-second, first], dim=-1) * sin
    return turned if passed.size(-1) == 0 else torch.cat([turned, passed], dim=-1)


class _RotaryLayer:
    """A Llama-family block: ``x + o_proj(attn(norm(x)))``, then ``x + mlp(norm(x))``.

    The norms and the MLP are the block's own modules (RMSNorm variants, gated MLPs:
    whatever the family uses); the query, key and value projections are one matrix
    product (the three weights side by side, the attention's scale folded into the
    query's rows, unless a per-head query norm comes first)."""

    def __init__(self, anatomy: "Anatomy", index: int) -> None:
        block, parts = anatomy.block(index), anatomy.attention(index)
        self.kv_heads, self.group, self.head_dim = (
            anatomy.n_kv_head,
            anatomy.n_head // anatomy.n_kv_head,
            anatomy.head_dim,
        )
        self.input_norm, self.post_norm, self.mlp = block.input_layernorm, block.post_attention_layernorm, block.mlp
        self.q_norm, self.k_norm = getattr(parts.module, "q_norm", None), getattr(parts.module, "k_norm", None)
        self.scale = float(getattr(parts.module, "scaling", self.head_dim**-0.5))
        queries = anatomy.n_head * self.head_dim
        keys = self.kv_heads * self.head_dim
        if parts.fused_qkv is not None:
            weight = parts.fused_qkv.weight.detach().clone()
            bias = None if parts.fused_qkv.bias is None else parts.fused_qkv.bias.detach().clone()
        else:
            projections = (parts.query, parts.key, parts.value)
            weight = torch.cat([p.weight.detach() for p in projections])
            bias = None
            if parts.query.bias is not None:
                bias = torch.cat([p.bias.detach() for p in projections])
        assert weight.size(0) == queries + 2 * keys, (weight.shape, queries, keys)
        self.folded = self.q_norm is None
        if self.folded:
            weight[:queries] *= self.scale
            if bias is not None:
                bias[:queries] *= self.scale
        self.qkv = (weight, bias)
        self.sizes = (queries, keys, keys)
        output = parts.output
        self.attn_out = (output.weight.detach(), None if output.bias is None else output.bias.detach())

    def project(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, C) block input -> q (B, H_kv, G, D) scaled and rotated, k (rotated) and v (B, H_kv, 1, D)."""
        batch = x.size(0)
        q, k, v = F.linear(self.input_norm(x), *self.qkv).split(self.sizes, dim=-1)
        q = q.view(batch, self.kv_heads, self.group, self.head_dim)  # query head h reads key/value head h // G
        k = k.view(batch, self.kv_heads, 1, self.head_dim)
        v = v.view(batch, self.kv_heads, 1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        cos, sin = rotary
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if not self.folded:
            q = q * self.scale
        return q, k, v

    def finish(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The block's output from its input and the attention output (B, H_kv, G, D)."""
        x = x + F.linear(attention.reshape(x.size(0), -1), *self.attn_out)
        return x + self.mlp(self.post_norm(x))


class _SingleQueryAttention(torch.autograd.Function):
    """Attention of one query per row and query head over the past (with low-rank deltas
    and a probe on its most recent W positions) and the row's own new key, with the
    backward written out.

    Through autograd the same computation records some twenty small nodes per layer; on a
    small model their bookkeeping costs as much as the arithmetic. Inputs: q (B, H_kv, G, D),
    the G query heads that read each key/value head, scaled; k, v (B, H_kv, 1, D);
    score_probe (B, H_kv, G, W) or None; keys, values (B, H_kv, L, D); the deltas' factors
    (key_a (B, H_kv, W, r), key_b_t (B, H_kv, D, r), value_a (B, H_kv, W, r), value_b
    (B, H_kv, r, D)) or None; mask (B, 1, 1, L + 1) bool or None. Returns the output
    (B, H_kv, G, D) and the attention probabilities (B, H_kv, G, L + 1). The deltas'
    factors and the mask are constants (no gradient).
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        score_probe: torch.Tensor | None,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_a: torch.Tensor | None,
        key_b_t: torch.Tensor | None,
        value_a: torch.Tensor | None,
        value_b: torch.Tensor | None,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        length = keys.size(2)
        scores = q @ keys.transpose(-1, -2)  # (B, H_kv, G, L)
        window = 0
        if key_a is not None or score_probe is not None:
            window = key_a.size(2) if key_a is not None else score_probe.size(-1)  # type: ignore[union-attr]
            recent = scores[..., length - window :]
            if key_a is not None:
                recent += (q @ key_b_t) @ key_a.transpose(-1, -2)
            if score_probe is not None:
                recent += score_probe
        scores = torch.cat([scores, (q * k).sum(-1, keepdim=True)], dim=-1)  # (B, H_kv, G, L + 1)
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
            grad_probs[..., length - value_a.size(2) : length] += (
                grad_out @ value_b.transpose(-1, -2)
            ) @ value_a.transpose(-1, -2)
        grad_scores = probs * (grad_probs - (probs * grad_probs).sum(-1, keepdim=True))  # softmax backward
        past_grad, new_grad = grad_scores[..., :length], grad_scores[..., length:]
        grad_q = grad_k = grad_v = grad_probe = None
        if ctx.needs_input_grad[0]:
            grad_q = past_grad @ keys + new_grad * k
            if key_a is not None:
                grad_q += (past_grad[..., length - window :] @ key_a) @ key_b_t.transpose(-1, -2)
        if ctx.needs_input_grad[1]:  # the G query heads of a key/value head all read its new key
            grad_k = (new_grad * q).sum(2, keepdim=True)
        if ctx.needs_input_grad[2]:
            grad_v = (probs[..., length:] * grad_out).sum(2, keepdim=True)
        if ctx.needs_input_grad[3]:
            grad_probe = past_grad[..., length - window :]
        grad_keys = grad_values = None  # a past that depends on what is optimised (the soft horizon's)
        if ctx.needs_input_grad[4]:
            grad_keys = past_grad.transpose(-1, -2) @ q
        if ctx.needs_input_grad[5]:
            grad_values = probs[..., :length].transpose(-1, -2) @ grad_out
        return grad_q, grad_k, grad_v, grad_probe, grad_keys, grad_values, None, None, None, None, None


class Runner:
    """One-token forward passes of a GPT-2 or Llama-family model from a past given as tensors.

    The weights are read from the model's modules when the runner is built (detached
    views of the same storage, or small copies of the fused projections), so the runner
    is cheap to build once per response.
    """

    def __init__(self, model: Any) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            from chatcore.anatomy import UnsupportedModelError

            raise UnsupportedModelError(f"PPLM's runner cannot run {type(model).__name__}: {reason}")
        self.model = model
        self.anatomy = anatomy = anatomy_of(model)
        self.kv_heads = anatomy.n_kv_head
        self.group = anatomy.n_head // anatomy.n_kv_head  # query heads per key/value head
        self.head_dim = anatomy.head_dim
        family = _GPT2Layer if model.config.model_type == "gpt2" else _RotaryLayer
        self.layers: list[Any] = [family(anatomy, index) for index in range(anatomy.n_layer)]

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
        projections: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
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
        out, probs = _SingleQueryAttention.apply(q, k, v, score_probe, keys, values, *factors, mask)
        if output_probe is not None:
            out = out + output_probe
        return self.layers[index].finish(x, out), k, v, probs, q
