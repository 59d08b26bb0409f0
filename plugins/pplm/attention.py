"""Single-query attention over a past with low-rank deltas, with its backward written out."""

from __future__ import annotations

from typing import Any

import torch


class SingleQueryAttention(torch.autograd.Function):
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
        window = key_a.size(2) if key_a is not None else (score_probe.size(-1) if score_probe is not None else 0)
        if window:
            recent = scores[..., length - window :]
            if key_a is not None and key_b_t is not None:
                recent += (q @ key_b_t) @ key_a.transpose(-1, -2)
            if score_probe is not None:
                recent += score_probe
        scores = torch.cat([scores, (q * k).sum(-1, keepdim=True)], dim=-1)  # (B, H_kv, G, L + 1)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = probs[..., :length] @ values + probs[..., length:] * v
        if value_a is not None and value_b is not None:
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
