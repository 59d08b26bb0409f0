"""A training batch's history, read once: the frozen model's keys and values over the
positions that no pass of the batch rewrites.

Every training pass over a batch (the self and null losses, the plain teacher, the cycle's
reconstruction and its generation's prompt) rewrites positions from the last history
token on (``hs - 1``, see chatcore.plugins.cocon.pipeline); the ``hs - 1`` positions before
it reach LM-beta as LM-alpha left them, the same in every pass. :func:`read_history`
runs them through the whole model once, without gradients, and keeps every layer's keys
and values; each pass then runs LM-beta over its rewritten positions alone, reading the
history from a cache (:meth:`History.cache`), instead of running LM-beta over the whole
window and taking gradients through positions whose values no trainable weight changes.
The values are the same and so are the block's gradients (the history's beta states do
not depend on the block).

Shapes: B rows, L window positions, q = hs - 1 history positions, C width, H heads, D head width.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from chatcore.api import cache_holding, plain_cache

from .model_split import SplitModel


@dataclass
class History:
    """Every layer's keys and values (B, H, q, D) over the positions [0, q) of B rows."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    length: int  # q

    def first(self, rows: int) -> History:
        """The history of the first ``rows`` rows."""
        return History([(keys[:rows], values[:rows]) for keys, values in self.layers], self.length)

    @staticmethod
    def stacked(parts: list[History]) -> History:
        """The histories of several groups of rows (of one length) as one batch's, in order."""
        layers = [
            (torch.cat([part.layers[i][0] for part in parts]), torch.cat([part.layers[i][1] for part in parts]))
            for i in range(len(parts[0].layers))
        ]
        return History(layers, parts[0].length)

    def cache(self, split: SplitModel) -> Any:
        """A fresh cache holding the history: passes extend it with new tensors, so the
        history itself is never changed and serves every pass of the batch."""
        return cache_holding(self.layers, split.config)


@torch.no_grad()
def read_history(
    split: SplitModel, input_ids: torch.Tensor, history_length: int
) -> tuple[torch.Tensor, History | None]:
    """LM-alpha's hidden states (B, L, C) of ``input_ids`` (B, L), positions from 0, and the
    history of its first ``history_length - 1`` positions (None where there is none, or where
    the model's cache cannot be rebuilt from its tensors: then every pass reads the whole window)."""
    B, L = input_ids.shape
    q = history_length - 1
    if q < 1 or q >= L or not plain_cache(split.new_cache()):
        return split.hidden_at_split(input_ids), None
    positions = torch.arange(L, device=input_ids.device).expand(B, L)
    cache = split.new_cache()
    embeddings = split.embed(positions, input_ids=input_ids)
    alpha_hidden = split.alpha(embeddings, split.pass_inputs(embeddings, positions, cache=cache))  # (B, L, C)
    # alpha's layers over the history's positions, then beta's written after them
    alpha_layers = [(layer.keys[:, :, :q], layer.values[:, :, :q]) for layer in cache.layers[: split.split_layer]]
    cache = cache_holding(alpha_layers, split.config)
    before = alpha_hidden[:, :q]
    inputs = split.pass_inputs(before, positions[:, :q])  # masks for q positions after none
    split.anatomy.run_blocks(before, range(split.split_layer, split.n_layer), replace(inputs, cache=cache))
    return alpha_hidden, History([(layer.keys, layer.values) for layer in cache.layers], q)


def beta_after_history(split: SplitModel, hidden: torch.Tensor, history: History) -> torch.Tensor:
    """LM-beta and the final norm over the positions right after the history: (B, T, C)
    at positions [q, q + T) -> (B, T, C)."""
    B, T, _ = hidden.shape
    positions = torch.arange(history.length, history.length + T, device=hidden.device).expand(B, T)
    return split.beta(hidden, split.pass_inputs(hidden, positions, cache=history.cache(split)))
