"""Key/value deltas on the most recent positions of a past: dense, or as low-rank factors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .kv import Past


def apply_deltas(past: Past, deltas: list[torch.Tensor] | None, first_layer: int = 0) -> Past:
    """``past`` with ``deltas`` (keys and values of each layer in turn from ``first_layer``
    up, each (B, H, W, D)) added to its most recent W positions."""
    if deltas is None:
        return past
    out: Past = list(past[:first_layer])
    for index, (keys, values) in enumerate(past[first_layer:]):
        out.append((_add_recent(keys, deltas[2 * index]), _add_recent(values, deltas[2 * index + 1])))
    return out


def _add_recent(tensor: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    length, window = tensor.size(2), delta.size(2)
    assert window <= length, (window, length)
    if window == length:
        return tensor + delta.to(tensor.dtype)
    return torch.cat([tensor[:, :, : length - window], tensor[:, :, length - window :] + delta.to(tensor.dtype)], dim=2)


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
    ) -> LowRankDeltas:
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

    def expand_rows(self, rows: torch.Tensor, batch: int) -> LowRankDeltas:
        """The deltas of ``rows`` placed in a batch of ``batch`` rows (zeros elsewhere)."""

        def place(tensor: torch.Tensor) -> torch.Tensor:
            full = tensor.new_zeros((tensor.size(0), batch, *tensor.shape[2:]))
            return full.index_copy_(1, rows, tensor)

        return LowRankDeltas(place(self.key_a), place(self.key_b), place(self.value_a), place(self.value_b))
