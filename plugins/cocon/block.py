"""The CoCon block (Chan et al., ICLR 2021): content-conditioned attention at one layer.

A frozen language model is cut in two at ``split_layer``: LM-alpha (its blocks
``[0, split)``) turns tokens into hidden states ``h``; the CoCon block rewrites ``h`` so
that it carries a content text; LM-beta (blocks ``[split, n)``) and the head turn the
result into next-token scores. The block is one transformer layer whose attention
keys and values are the content's projected keys/values *prepended* to the
sequence's own::

    h ─ LN ─ attention(query = h,  keys/values = [content ; sequence]) ─(+h)─ LN ─ MLP ─(+)─> h'
                                      │              │
                     always visible, + tau      causal (and padding-masked)

``tau`` is added to the pre-softmax logits at the content positions (one value per
content input): positive follows the content more, negative less, 0 is the block as
trained. With no content the block attends over the sequence alone; training it
so (the null-content loss) keeps LM-alpha -> block -> LM-beta close to the plain model.

Two learned vectors, as in the paper: ``start`` stands in for the history when a
sequence has none (its output predicts the first token), and ``mask`` replaces
hidden states that training hides from the block (a dropout on inputs).

Shapes: B batch rows, T new sequence positions, P cached sequence positions, S content
positions, C = n_embd, H = n_head, D = C // H.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import torch
from pydantic import Field, PositiveFloat, PositiveInt, model_validator
from torch import nn
from torch.nn import functional as F

from chatcore.api import Settings


class CoconConfig(Settings):
    """The block's shape and the layer it sits at."""

    n_embd: PositiveInt
    """Must match the base model's width."""
    n_head: PositiveInt
    """Must match the base model's heads."""
    split_layer: PositiveInt
    """LM-alpha is blocks [0, split_layer), LM-beta [split_layer, n_layer)."""
    n_inner: PositiveInt | None = None
    """The MLP's hidden width (default 4 * n_embd)."""
    layer_norm_epsilon: PositiveFloat = 1e-5
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.1
    init_std: PositiveFloat = 0.02

    @model_validator(mode="after")
    def _heads_divide_width(self) -> CoconConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"`n_embd` ({self.n_embd}) must be divisible by `n_head` ({self.n_head})")
        return self

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "CoconConfig":
        known = {k: v for k, v in values.items() if k in cls.model_fields}
        return cls(**known)


class CoconBlock(nn.Module):
    def __init__(self, config: CoconConfig) -> None:
        super().__init__()
        self.config = config
        C, H = config.n_embd, config.n_head
        inner = config.n_inner or 4 * C
        self.n_head = H
        self.head_dim = C // H
        # Content hidden states come straight from the residual stream at the split; a
        # layer norm of their own keeps their scale from swamping the sequence's keys.
        self.ln_content = nn.LayerNorm(C, eps=config.layer_norm_epsilon)
        self.ln_1 = nn.LayerNorm(C, eps=config.layer_norm_epsilon)
        self.sequence_qkv = nn.Linear(C, 3 * C)
        self.content_kv = nn.Linear(C, 2 * C)
        self.attn_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C, eps=config.layer_norm_epsilon)
        self.mlp_in = nn.Linear(C, inner)
        self.mlp_out = nn.Linear(inner, C)
        self.start = nn.Parameter(torch.zeros(C))
        self.mask = nn.Parameter(torch.zeros(C))
        self.dropout = nn.Dropout(config.dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_std
        for module in (self.sequence_qkv, self.content_kv, self.mlp_in):
            nn.init.normal_(module.weight, std=std)
            nn.init.zeros_(module.bias)
        # The two residual branches start small, so an untrained block is close to
        # the identity and LM-beta starts from the hidden states it was trained on.
        for module in (self.attn_proj, self.mlp_out):
            nn.init.normal_(module.weight, std=std / math.sqrt(2))
            nn.init.zeros_(module.bias)

    # -- pieces ---------------------------------------------------------------------------
    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        return x.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)

    def start_vector(self, batch: int) -> torch.Tensor:
        """The learned stand-in for a missing history: (B, 1, C)."""
        return self.start.view(1, 1, -1).expand(batch, 1, -1)

    def hide(self, hidden: torch.Tensor, hidden_positions: torch.Tensor | None) -> torch.Tensor:
        """Replace the hidden states at ``hidden_positions`` (B, L) bool by the mask vector."""
        if hidden_positions is None:
            return hidden
        return torch.where(hidden_positions.unsqueeze(-1), self.mask.to(hidden.dtype), hidden)

    def content_keys_values(
        self, content_hidden: torch.Tensor, hidden_positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Project the content's LM-alpha hidden states (B, S, C) to keys and values (B, H, S, D).

        Computed once per content; every step reuses them.
        """
        content_hidden = self.hide(content_hidden, hidden_positions)
        keys, values = self.content_kv(self.ln_content(content_hidden)).split(self.config.n_embd, dim=-1)
        return self._heads(keys), self._heads(values)

    # -- forward ------------------------------------------------------------------------
    def forward(
        self,
        hidden: torch.Tensor,
        key_valid: torch.Tensor,
        past_keys: torch.Tensor | None = None,
        past_values: torch.Tensor | None = None,
        content_length: int = 0,
        content_bias: torch.Tensor | None = None,
        queries_from: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rewrite the hidden states of new sequence positions.

        hidden:          (B, T, C)    LM-alpha's output at the T new positions.
        key_valid:       (B, P + T)   bool, False at padding; sequence positions only.
        past_keys/values:(B, H, S + P, D) the content's keys/values followed by the
                         cached sequence ones (P = 0 at the first call: the content's alone).
        content_length:  S, how many leading entries of the past are content.
        content_bias:    (B or 1, Tq or 1, S) added to the logits at content positions
                         (tau, or a large negative number to hide one); None for 0.
        queries_from:    only positions [queries_from, T) get an output (Tq = T - queries_from);
                         the others just add their keys/values (history that is not steered).

        Returns (output (B, Tq, C), keys, values (B, H, S + P + T, D)) for the next call.
        """
        B, T, C = hidden.shape
        assert 0 <= queries_from <= T, f"queries_from {queries_from} outside [0, {T}]"
        S = content_length
        normed = self.ln_1(hidden)
        query, key, value = self.sequence_qkv(normed).split(C, dim=-1)
        key, value = self._heads(key), self._heads(value)  # (B, H, T, D)
        if past_keys is not None:
            assert past_values is not None
            key = torch.cat([past_keys, key], dim=2)
            value = torch.cat([past_values, value], dim=2)
        total = key.size(2)  # S + P + T
        P = total - S - T
        assert key_valid.shape == (B, P + T), f"key_valid {tuple(key_valid.shape)} != {(B, P + T)}"
        Tq = T - queries_from
        if Tq == 0:
            return hidden.new_zeros(B, 0, C), key, value
        query = self._heads(query[:, queries_from:])  # (B, H, Tq, D)
        bias = self.attention_bias(key_valid, S, P, T, queries_from, content_bias, query.dtype)
        attended = F.scaled_dot_product_attention(
            query, key, value, attn_mask=bias, dropout_p=self.config.dropout if self.training else 0.0
        )  # (B, H, Tq, D)
        attended = attended.transpose(1, 2).reshape(B, Tq, C)
        out = hidden[:, queries_from:] + self.dropout(self.attn_proj(attended))
        out = out + self.dropout(self.mlp_out(F.gelu(self.mlp_in(self.ln_2(out)), approximate="tanh")))
        return out, key, value

    @staticmethod
    def attention_bias(
        key_valid: torch.Tensor,
        content_length: int,
        past_length: int,
        new_length: int,
        queries_from: int,
        content_bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The additive attention bias (B, 1, Tq, S + P + T).

        Content columns: ``content_bias`` (0 by default), never causal-masked. Sequence
        columns: 0 where the key is not padding and not after the query, else the
        dtype's most negative number (not -inf, so a fully masked padding row stays finite).
        """
        B = key_valid.size(0)
        S, P, T = content_length, past_length, new_length
        device = key_valid.device
        blocked = torch.finfo(dtype).min
        query_positions = torch.arange(P + queries_from, P + T, device=device)  # (Tq,)
        key_positions = torch.arange(P + T, device=device)  # (P + T,)
        visible = (key_positions[None, :] <= query_positions[:, None])[None] & key_valid[
            :, None, :
        ].bool()  # (B, Tq, P+T)
        zero = torch.zeros((), dtype=dtype, device=device)
        sequence = torch.where(visible, zero, torch.full((), blocked, dtype=dtype, device=device))
        if S == 0:
            return sequence.unsqueeze(1)
        Tq = T - queries_from
        if content_bias is None:
            content = torch.zeros(B, Tq, S, dtype=dtype, device=device)
        else:
            content = content_bias.to(dtype).expand(B, Tq, S)
        return torch.cat([content, sequence], dim=-1).unsqueeze(1)
