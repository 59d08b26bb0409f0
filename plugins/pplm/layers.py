"""The transformer blocks of :class:`chatcore.plugins.pplm.runner.Runner`, one new position per row.

A block is split in two around its attention: ``project`` (the block input's query, key
and value) and ``finish`` (the output projection, the residual additions and the MLP),
so that the runner computes the attention over the past (and its deltas) in between.
The weights are the model's own (detached), or small copies where the query, key and
value projections are fused into one matrix with the attention's scale folded in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch import nn

    from chatcore.api import Anatomy

# transformers' names for the GELU variants GPT-2 checkpoints use, as torch functions.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}

Projections = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Rotary = tuple[torch.Tensor, torch.Tensor]


class Layer(Protocol):
    """One block, split around its attention."""

    def project(self, x: torch.Tensor, rotary: Rotary | None) -> Projections:
        """(B, C) block input -> the fed position's query (scaled), key and value."""
        ...

    def finish(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The block's output from its input and the attention output."""
        ...


def _weight(module: nn.Module) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__} has no weight tensor")
    return weight.detach()


def _bias(module: nn.Module) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return bias.detach() if isinstance(bias, torch.Tensor) else None


def _pair(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A GPT-2 module's (weight, bias), both present."""
    bias = _bias(module)
    if bias is None:
        raise TypeError(f"{type(module).__name__} has no bias tensor")
    return _weight(module), bias


class GPT2Layer:
    """A GPT-2 block: LayerNorms, fused Conv1D projections (weights (in, out)), a GELU MLP."""

    def __init__(self, anatomy: Anatomy, index: int) -> None:
        config, block = anatomy.config, anatomy.block(index)
        self.heads, self.head_dim, self.hidden = anatomy.n_head, anatomy.head_dim, anatomy.width
        self.eps = float(config.layer_norm_epsilon)
        self.activation = ACTIVATIONS[config.activation_function]
        scale = 1.0
        if getattr(config, "scale_attn_weights", True):
            scale = self.head_dim**-0.5
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(index + 1)
        weight, bias = _pair(block.get_submodule("attn.c_attn"))
        if scale != 1.0:  # the attention's scale, folded into the query projection
            weight, bias = weight.clone(), bias.clone()
            weight[:, : self.hidden] *= scale
            bias[: self.hidden] *= scale
        self.ln_1, self.qkv = _pair(block.get_submodule("ln_1")), (weight, bias)
        self.attn_out = _pair(block.get_submodule("attn.c_proj"))
        self.ln_2 = _pair(block.get_submodule("ln_2"))
        self.fc, self.proj = _pair(block.get_submodule("mlp.c_fc")), _pair(block.get_submodule("mlp.c_proj"))

    def project(self, x: torch.Tensor, rotary: Rotary | None) -> Projections:
        """(B, C) block input -> q (B, H, 1, D) scaled, k and v (B, H, 1, D) (no rotary)."""
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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (..., D) by (cos, sin) (..., R), R <= D: the first R features
    rotate (halves swapped, as transformers' ``rotate_half``), the rest pass."""
    rotary = cos.size(-1)
    turned, passed = x[..., :rotary], x[..., rotary:]
    first, second = turned.chunk(2, dim=-1)
    turned = turned * cos + torch.cat([-second, first], dim=-1) * sin
    return turned if passed.size(-1) == 0 else torch.cat([turned, passed], dim=-1)


class RotaryLayer:
    """A Llama-family block: ``x + o_proj(attn(norm(x)))``, then ``x + mlp(norm(x))``.

    The norms and the MLP are the block's own modules (RMSNorm variants, gated MLPs:
    whatever the family uses); the query, key and value projections are one matrix
    product (the three weights side by side, the attention's scale folded into the
    query's rows, unless a per-head query norm comes first)."""

    def __init__(self, anatomy: Anatomy, index: int) -> None:
        block, parts = anatomy.block(index), anatomy.attention(index)
        self.kv_heads, self.group, self.head_dim = (
            anatomy.n_kv_head,
            anatomy.n_head // anatomy.n_kv_head,
            anatomy.head_dim,
        )
        self.input_norm = block.get_submodule("input_layernorm")
        self.post_norm = block.get_submodule("post_attention_layernorm")
        self.mlp = block.get_submodule("mlp")
        self.q_norm: nn.Module | None = getattr(parts.module, "q_norm", None)
        self.k_norm: nn.Module | None = getattr(parts.module, "k_norm", None)
        self.scale = float(getattr(parts.module, "scaling", self.head_dim**-0.5))
        queries = anatomy.n_head * self.head_dim
        keys = self.kv_heads * self.head_dim
        bias: torch.Tensor | None
        if parts.fused_qkv is not None:
            weight = _weight(parts.fused_qkv).clone()
            fused_bias = _bias(parts.fused_qkv)
            bias = None if fused_bias is None else fused_bias.clone()
        else:
            assert parts.query is not None and parts.key is not None and parts.value is not None
            projections = (parts.query, parts.key, parts.value)
            weight = torch.cat([_weight(p) for p in projections])
            query_bias, key_bias, value_bias = (_bias(p) for p in projections)
            bias = None
            if query_bias is not None:
                assert key_bias is not None and value_bias is not None
                bias = torch.cat([query_bias, key_bias, value_bias])
        assert weight.size(0) == queries + 2 * keys, (weight.shape, queries, keys)
        self.folded = self.q_norm is None
        if self.folded:
            weight[:queries] *= self.scale
            if bias is not None:
                bias[:queries] *= self.scale
        self.qkv = (weight, bias)
        self.sizes = (queries, keys, keys)
        self.attn_out = (_weight(parts.output), _bias(parts.output))

    def project(self, x: torch.Tensor, rotary: Rotary | None) -> Projections:
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
        assert rotary is not None, "a rotary block needs the (cos, sin) of its positions"
        cos, sin = rotary
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if not self.folded:
            q = q * self.scale
        return q, k, v

    def finish(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The block's output from its input and the attention output (B, H_kv, G, D)."""
        x = x + F.linear(attention.reshape(x.size(0), -1), *self.attn_out)
        return x + self.mlp(self.post_norm(x))
