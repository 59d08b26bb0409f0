"""Score processors: small objects that edit next-token scores, one call each.

``processor(sequences, scores) -> scores`` where ``sequences`` is (B, T) every token so
far (prompt included, as in transformers) and ``scores`` is (B, V) float32. Token
decoders chain them in this documented order, after the steerers have run:

1. ``RepetitionPenalty``   (CTRL-style, on every token already in the sequence)
2. ``NoRepeatNGram``       (bans tokens that would repeat an n-gram)
3. ``Temperature``
4. ``TopK``
5. ``TopP``

Constructors validate their arguments and raise ``ValueError`` naming them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class ScoreProcessor(Protocol):
    def __call__(self, sequences: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor": ...


class RepetitionPenalty:
    """Divide positive scores (multiply negative ones) of already-seen tokens by ``penalty``."""

    def __init__(self, penalty: float) -> None:
        if not penalty > 0:
            raise ValueError(f"`repetition_penalty` must be a positive number, got {penalty}")
        self.penalty = float(penalty)

    def __call__(self, sequences: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor":
        import torch

        seen = torch.gather(scores, 1, sequences)  # (B, T)
        seen = torch.where(seen < 0, seen * self.penalty, seen / self.penalty)
        return scores.scatter(1, sequences, seen)


class NoRepeatNGram:
    """Forbid any token that would complete an n-gram already present in the sequence."""

    def __init__(self, size: int) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"`no_repeat_ngram_size` must be a positive integer, got {size!r}")
        self.size = size

    def __call__(self, sequences: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor":
        n = self.size
        length = sequences.size(1)
        if length + 1 < n:
            return scores
        scores = scores.clone()
        rows = sequences.tolist()
        for row_index, row in enumerate(rows):
            prefix = tuple(row[length - n + 1 :]) if n > 1 else ()
            banned = {row[i + n - 1] for i in range(length - n + 1) if tuple(row[i : i + n - 1]) == prefix}
            if banned:
                scores[row_index, list(banned)] = float("-inf")
        return scores


class Temperature:
    def __init__(self, temperature: float) -> None:
        if not temperature > 0:
            raise ValueError(f"`temperature` must be a positive number, got {temperature}")
        self.temperature = float(temperature)

    def __call__(self, sequences: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor":
        return scores / self.temperature


class TopK:
    """Keep the ``k`` best scores of each row."""

    def __init__(self, k: int) -> None:
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"`top_k` must be a positive integer, got {k!r}")
        self.k = k

    def __call__(self, sequences: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor":
        import torch

        k = min(self.k, scores.size(-1))
        threshold = torch.topk(scores, k, dim=-1).values[..., -1:]  # (B, 1)
        return scores.masked_fill(scores < threshold, float("-inf"))


class TopP:
    """Nucleus filtering: keep the smallest set of tokens whose probability reaches ``p``."""

    def __init__(self, p: float) -> None:
        if not 0.0 < p <= 1.0:
            raise ValueError(f"`top_p` must be in (0, 1], got {p}")
        self.p = float(p)

    def __call__(self, sequences: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor":
        import torch

        if self.p >= 1.0:
            return scores
        sorted_scores, sorted_index = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose mass is at most 1 - p; the best token always stays.
        remove = cumulative <= (1 - self.p)
        remove[..., -1:] = False
        mask = remove.scatter(1, sorted_index, remove)
        return scores.masked_fill(mask, float("-inf"))
