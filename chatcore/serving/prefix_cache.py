"""Prefix caching: the key/values of earlier prompts (and replies), reused by prompts that start with them.

When a reply ends, the scheduler stores the key/values of every token it fed the model
(the prompt and the reply); the next turn of that conversation renders a prompt that
starts with those same tokens, so only its new tokens are run. A new prompt takes the
entry with which it shares the longest run of leading tokens (the entry is cut to it),
always leaving its last token to run, since that gives the first reply token's scores.

Entries are bounded by a memory budget in bytes; the least recently used go first.
Only replies that share the batch use it: their steerers (``shares_batch``) never touch
the prompt's cache or hidden states. PPLM, CoCon and other steerers that do are
decoded on their own, from the whole prompt.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Layers = list[tuple["torch.Tensor", "torch.Tensor"]]  # per layer: keys, values, each (1, H, T, D)


@dataclass
class PrefixEntry:
    tokens: tuple[int, ...]
    layers: Layers
    size: int  # bytes


def common_length(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    length = min(len(a), len(b))
    for index in range(length):
        if a[index] != b[index]:
            return index
    return length


class PrefixCache:
    """Key/values of token prefixes under a byte budget, least recently used evicted first."""

    def __init__(self, budget_bytes: int, min_tokens: int = 8) -> None:
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"`budget_bytes` must be a non-negative integer, got {budget_bytes!r}")
        self.budget = budget_bytes
        self.min_tokens = min_tokens  # shorter prefixes are not worth a lookup's bookkeeping
        self.entries: collections.OrderedDict[tuple[int, ...], PrefixEntry] = collections.OrderedDict()
        self.used = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, prompt: list[int]) -> tuple[int, Layers | None]:
        """The longest cached prefix of ``prompt`` (at most all but its last token): its length and key/values."""
        best: PrefixEntry | None = None
        best_length = 0
        for entry in self.entries.values():
            length = min(common_length(entry.tokens, prompt), len(prompt) - 1)
            if length > best_length:
                best, best_length = entry, length
        if best is None or best_length < self.min_tokens:
            return 0, None
        self.entries.move_to_end(best.tokens)
        self.hits += 1
        self.reused_tokens += best_length
        return best_length, [(keys[:, :, :best_length], values[:, :, :best_length]) for keys, values in best.layers]

    def store(self, tokens: list[int], layers: Layers) -> None:
        """Keep the key/values of ``tokens`` (each layer's (1, H, len(tokens), D)), evicting as needed."""
        key = tuple(tokens)
        if len(key) < self.min_tokens or not self.budget:
            return
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if size > self.budget:
            return
        for other in list(self.entries):
            if len(other) >= len(key) and other[: len(key)] == key:
                self.entries.move_to_end(other)  # an entry that covers these tokens already
                return
            if len(other) < len(key) and key[: len(other)] == other:
                self._remove(other)  # this one covers the shorter entry
        # Own copies: the batch's tensors are views that later steps would keep alive.
        owned = [(k.clone(), v.clone()) for k, v in layers]
        self.entries[key] = PrefixEntry(key, owned, size)
        self.used += size
        while self.used > self.budget:
            self._remove(next(iter(self.entries)))

    def _remove(self, key: tuple[int, ...]) -> None:
        entry = self.entries.pop(key)
        self.used -= entry.size

    def clear(self) -> None:
        self.entries.clear()
        self.used = 0


def cache_from_layers(layers: Layers, config: Any) -> Any:
    """A DynamicCache holding ``layers`` (new tensors are concatenated, the given ones never changed)."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=config)
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache
