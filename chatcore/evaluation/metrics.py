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


# Words a content phrase may carry that say nothing of its content ("is perfect" is about
# "perfect"). Used by ``mentions``.
_FUNCTION_WORDS = frozenset(
    "a an the is are was were be been am i you he she it we they my your his her its our their this that "
    "these those to of in on at for with and or but so very really too not no do does did have has had "
    "will would can could".split()
)
# Endings that make a close variant of a word: plurals, verb forms, -ly/-al/-ian/-ness ...
_SUFFIXES = (
    "",
    "s",
    "es",
    "e",
    "ed",
    "d",
    "ing",
    "er",
    "ers",
    "y",
    "ly",
    "al",
    "ally",
    "ian",
    "ians",
    "ist",
    "ists",
    "ic",
    "ful",
    "ness",
    "ies",
    "ily",
    "iness",
    "ier",
    "iest",
)


def content_keywords(content: str) -> list[str]:
    """The words of ``content`` that carry it: all but function words (all of them if
    the content has nothing else)."""
    tokens = [t for t in words(content) if any(ch.isalnum() for ch in t)]
    kept = [t for t in tokens if t not in _FUNCTION_WORDS]
    return kept or tokens


def is_variant(word: str, keyword: str) -> bool:
    """Whether ``word`` is ``keyword`` or a close variant of it: the keyword (or the keyword
    without a final e / y) followed by one of a few inflectional or derivational endings.
    ``music`` matches musical, musician; ``horrible`` horribly; ``happy`` happiness; ``cat``
    does not match catch."""
    if word == keyword:
        return True
    stems = {keyword}
    if len(keyword) > 3 and keyword[-1] in "ey":
        stems.add(keyword[:-1])
    for stem in stems:
        if word.startswith(stem) and word[len(stem) :] in _SUFFIXES:
            return True
    return False


def mentions(text: str, content: str) -> bool:
    """Whether ``text`` carries ``content``: every keyword of the content (see
    ``content_keywords``) occurs in it, as itself or a close variant (``is_variant``)."""
    tokens = set(words(text))
    keywords = content_keywords(content)
    return bool(keywords) and all(any(is_variant(token, keyword) for token in tokens) for keyword in keywords)
