"""Reply-quality metrics for ``chatcore eval``: diversity, degeneracy, attributes."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

_WORD = re.compile(r"[\w']+|[^\w\s]", re.UNICODE)


def words(text: str) -> list[str]:
    """Lower-cased word and punctuation tokens."""
    return _WORD.findall(text.lower())


def ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(texts: Iterable[str], n: int) -> float:
    """Distinct n-grams over all n-grams across replies (Li et al., 2016); 0 if none."""
    total: Counter[tuple[str, ...]] = Counter()
    for text in texts:
        total.update(ngrams(words(text), n))
    count = sum(total.values())
    return len(total) / count if count else 0.0


def is_degenerate(text: str, max_repeats: int = 3, max_n: int = 4) -> bool:
    """Empty, or an n-gram (n <= max_n) repeated ``max_repeats``+ times in a row, or any
    word trigram occurring ``max_repeats``+ times anywhere in the reply."""
    tokens = [t for t in words(text) if any(ch.isalnum() for ch in t)]
    if not tokens:
        return True
    for n in range(1, max_n + 1):
        for start in range(len(tokens) - n * max_repeats + 1):
            gram = tokens[start : start + n]
            if all(tokens[start + k * n : start + (k + 1) * n] == gram for k in range(1, max_repeats)):
                return True
    trigrams = Counter(ngrams(tokens, 3))
    return any(count >= max_repeats for count in trigrams.values())


def contains_any(text: str, vocabulary: set[str]) -> bool:
    """Whether the reply contains any word (or multi-word phrase) of ``vocabulary``."""
    tokens = words(text)
    joined = " " + " ".join(tokens) + " "
    for entry in vocabulary:
        entry_tokens = words(entry)
        if len(entry_tokens) == 1:
            if entry_tokens[0] in tokens:
                return True
        elif entry_tokens and " " + " ".join(entry_tokens) + " " in joined:
            return True
    return False
