"""The filter's rules, and what they read: the blocklist and the corpus statistics
(see :mod:`chatcore.training.filtering` for the rules' order and meaning)."""

from __future__ import annotations

import math
import operator
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from chatcore.errors import CorpusError
from chatcore.training.corpus import Dialogue
from chatcore.training.filter_config import (
    DEFAULT_BLOCKLIST,
    DEFAULT_URL_PATTERN,
    FilterConfig,
    words_of,
)

# -- the blocklist -------------------------------------------------------------------


@dataclass(frozen=True)
class Blocklist:
    """Whole words, word prefixes ("fuck*") and phrases, matched case-insensitively."""

    words: frozenset[str]
    prefixes: tuple[str, ...]
    phrases: tuple[tuple[str, ...], ...]
    source: str = "<memory>"

    @classmethod
    def from_lines(cls, lines: Iterable[str], source: str = "<memory>") -> Blocklist:
        words: set[str] = set()
        prefixes: list[str] = []
        phrases: list[tuple[str, ...]] = []
        for raw in lines:
            line = raw.split("#", 1)[0].strip().lower()
            if not line:
                continue
            if line.endswith("*") and " " not in line:
                if words_of(line[:-1]) != [line[:-1]]:
                    raise CorpusError(f"{source}: prefix entry {raw.strip()!r} must be a single word")
                prefixes.append(line[:-1])
                continue
            parts = tuple(words_of(line))
            if not parts:
                continue
            if len(parts) == 1:
                words.add(parts[0])
            else:
                phrases.append(parts)
        return cls(frozenset(words), tuple(prefixes), tuple(phrases), source)

    @classmethod
    def load(cls, path: str | Path | None = None) -> Blocklist:
        path = Path(path) if path is not None else DEFAULT_BLOCKLIST
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise CorpusError(f"cannot read the blocklist {path}: {error}") from None
        return cls.from_lines(text.splitlines(), str(path))

    def __len__(self) -> int:
        return len(self.words) + len(self.prefixes) + len(self.phrases)

    def entry_for(self, word: str) -> str | None:
        """The entry a single word matches, or None."""
        if word in self.words:
            return word
        for prefix in self.prefixes:
            if word.startswith(prefix):
                return prefix + "*"
        return None

    def phrase_in(self, words: Sequence[str]) -> str | None:
        for phrase in self.phrases:
            size = len(phrase)
            for start in range(len(words) - size + 1):
                if words[start] == phrase[0] and tuple(words[start : start + size]) == phrase:
                    return " ".join(phrase)
        return None


class BlocklistMatcher:
    """A blocklist with the answer for each distinct word remembered: a corpus has far
    fewer distinct words than word occurrences, and set operations run in C."""

    def __init__(self, blocklist: Blocklist) -> None:
        self.blocklist = blocklist
        self._seen: set[str] = set()
        self._hits: dict[str, str] = {}
        self._phrase_starts = frozenset(phrase[0] for phrase in blocklist.phrases)

    def find(self, words: Sequence[str]) -> str | None:
        """The first blocklist entry the words match, or None."""
        if not self._seen.issuperset(words):
            for word in set(words) - self._seen:
                entry = self.blocklist.entry_for(word)
                if entry is not None:
                    self._hits[word] = entry
                self._seen.add(word)
        if not self._hits.keys().isdisjoint(words):
            return next(self._hits[word] for word in words if word in self._hits)
        if self._phrase_starts and not self._phrase_starts.isdisjoint(words):
            return self.blocklist.phrase_in(words)
        return None


# -- exchanges and corpus statistics ---------------------------------------------------


@dataclass
class TokenizedDialogue:
    """A dialogue with each turn's words computed once for all rules; ``offset`` numbers
    its first turn among all turns of the corpus."""

    dialogue: Dialogue
    words: list[list[str]]
    offset: int


@dataclass(frozen=True)
class Exchange:
    """Turn ``index`` of a dialogue as a target, with the turns before it as its source."""

    item: TokenizedDialogue
    index: int

    @property
    def dialogue(self) -> Dialogue:
        return self.item.dialogue

    @property
    def number(self) -> int:
        """The target's position among all turns of the corpus."""
        return self.item.offset + self.index

    @property
    def target(self) -> str:
        return self.item.dialogue.turns[self.index]

    @property
    def target_words(self) -> list[str]:
        return self.item.words[self.index]

    def source_indices(self, turns: int) -> range:
        return range(max(0, self.index - turns), self.index)


@dataclass
class CorpusStats:
    """Corpus-wide numbers the rules need; per-turn lists are indexed by ``Exchange.number``."""

    words: int
    exchanges: int
    top_words: list[str] = field(default_factory=list)
    has_top_word: list[bool] = field(default_factory=list)
    trigram_threshold: int = 0
    frequent_trigrams: list[int] = field(default_factory=list)
    blocked_communities: dict[str, tuple[int, int]] = field(default_factory=dict)
    communities: int = 0


def bland_threshold(config: FilterConfig, corpus_words: int) -> int:
    """How often a trigram must occur to count as very frequent for the bland rule."""
    scaled = config.bland_reference_count * corpus_words / config.bland_reference_words
    return max(config.bland_min_count, math.ceil(round(scaled, 6)))  # round: 10.000000001 is 10


def gather_stats(
    items: Sequence[TokenizedDialogue], config: FilterConfig, matcher: BlocklistMatcher | None
) -> CorpusStats:
    """Word and trigram counts, done on integer word ids with numpy: counting 2.4
    million trigram tuples in a Counter takes seconds, ``np.unique`` a fraction of one."""
    import numpy as np

    lengths = [len(turn) for item in items for turn in item.words]
    stats = CorpusStats(words=sum(lengths), exchanges=len(lengths))
    flat = [word for item in items for turn in item.words for word in turn]
    vocabulary = {word: number for number, word in enumerate(dict.fromkeys(flat))}  # first seen first
    ids = np.fromiter(map(vocabulary.__getitem__, flat), dtype=np.int64, count=len(flat))
    turn_of_word = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    if config.enabled("top-words"):
        counts = np.bincount(ids, minlength=len(vocabulary))
        top = np.argsort(-counts, kind="stable")[: config.top_words]  # ties: first seen first
        words = list(vocabulary)
        stats.top_words = [words[i] for i in top.tolist()]
        is_top = np.zeros(len(vocabulary), dtype=bool)
        is_top[top] = True
        stats.has_top_word = (np.bincount(turn_of_word, weights=is_top[ids], minlength=len(lengths)) > 0).tolist()
    if config.enabled("bland"):
        stats.trigram_threshold = bland_threshold(config, stats.words)
        stats.frequent_trigrams = [0] * len(lengths)
        if ids.size >= 3:
            same_turn = turn_of_word[:-2] == turn_of_word[2:]
            first, second, third = ids[:-2][same_turn], ids[1:-1][same_turn], ids[2:][same_turn]
            size = len(vocabulary)
            if size < 2**21:  # three ids packed in one int64
                keys = (first * size + second) * size + third
                _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
            else:
                rows = np.stack([first, second, third], axis=1)
                _, inverse, counts = np.unique(rows, axis=0, return_inverse=True, return_counts=True)
            frequent = counts[inverse.reshape(-1)] >= stats.trigram_threshold
            per_turn = np.bincount(turn_of_word[:-2][same_turn], weights=frequent, minlength=len(lengths))
            stats.frequent_trigrams = per_turn.astype(np.int64).tolist()
    if config.enabled("community") and matcher is not None:
        lines: Counter[str] = Counter()
        hits: Counter[str] = Counter()
        for item in items:
            community = item.dialogue.community
            if community is None:
                continue
            lines[community] += len(item.words)
            hits[community] += sum(1 for turn in item.words if matcher.find(turn) is not None)
        stats.communities = len(lines)
        stats.blocked_communities = {
            name: (hits[name], count)
            for name, count in lines.items()
            if count >= config.community_min_lines and hits[name] / count >= config.community_share
        }
    return stats


# -- the rules -------------------------------------------------------------------------


class Rule(Protocol):
    """One filtering rule: ``check`` returns a short reason when the exchange must go."""

    name: str
    description: str

    def check(self, exchange: Exchange) -> str | None: ...


class CommunityRule:
    name = "community"

    def __init__(self, blocked: Mapping[str, tuple[int, int]], share: float) -> None:
        self.blocked = dict(blocked)
        self.description = f"community with >= {share:.0%} blocklisted lines"

    def check(self, exchange: Exchange) -> str | None:
        community = exchange.dialogue.community
        if community is None or community not in self.blocked:
            return None
        hits, lines = self.blocked[community]
        return f"{community}: {hits}/{lines} lines blocklisted"


class UrlRule:
    name = "url"
    # Every match of the default pattern contains "://", "www." or a dot before a known
    # top-level domain; this cheaper pattern rules most turns out before the full one runs.
    DEFAULT_PREFILTER = re.compile(
        r"://|www\.|\.(?:com|org|net|edu|gov|io|co|uk|de|ly|me|tv|gg|info|biz)\b", re.IGNORECASE
    )

    def __init__(self, pattern: str, source_turns: int) -> None:
        self.pattern = re.compile(pattern)
        self.prefilter = self.DEFAULT_PREFILTER if pattern == DEFAULT_URL_PATTERN else None
        self.source_turns = source_turns
        self.description = "URL in the source or the target"
        self._found: dict[int, str | None] = {}  # by turn number: each turn is searched once

    def _url_in(self, exchange: Exchange, index: int) -> str | None:
        number = exchange.item.offset + index
        if number not in self._found:
            text = exchange.dialogue.turns[index]
            if self.prefilter is not None and not self.prefilter.search(text):
                self._found[number] = None
            else:
                match = self.pattern.search(text)
                self._found[number] = match.group(0)[:60] if match else None
        return self._found[number]

    def check(self, exchange: Exchange) -> str | None:
        found = self._url_in(exchange, exchange.index)
        if found:
            return f"target: {found}"
        for index in exchange.source_indices(self.source_turns):
            found = self._url_in(exchange, index)
            if found:
                return f"source: {found}"
        return None


class MarkupRule:
    name = "markup"

    def __init__(self, pattern: str) -> None:
        self.pattern = re.compile(pattern)
        self.description = f"markup marker in the target (/{pattern}/)"

    def check(self, exchange: Exchange) -> str | None:
        found = self.pattern.search(exchange.target)
        return f"marker {found.group(0)!r}" if found else None


class LengthRule:
    name = "length"

    def __init__(self, max_words: int, source_turns: int) -> None:
        self.max_words = max_words
        self.source_turns = source_turns
        self.description = f"source ({source_turns} turn(s)) + target longer than {max_words} words"

    def check(self, exchange: Exchange) -> str | None:
        words = exchange.item.words
        total = len(words[exchange.index]) + sum(len(words[i]) for i in exchange.source_indices(self.source_turns))
        return f"{total} words" if total > self.max_words else None


class RepeatRule:
    name = "repeat"

    def __init__(self, count: int) -> None:
        self.count = count
        self.description = f"target repeats a word {count}+ times in a row"

    def check(self, exchange: Exchange) -> str | None:
        words = exchange.target_words
        if not any(map(operator.eq, words, words[1:])):  # no word follows itself: the common case
            return None
        run = 1
        for previous, word in zip(words, words[1:]):
            run = run + 1 if word == previous else 1
            if run >= self.count:
                return f"{word!r} x{self.count}"
        return None


class BlocklistRule:
    name = "blocklist"

    def __init__(self, matcher: BlocklistMatcher) -> None:
        self.matcher = matcher
        self.description = f"blocklisted word in the target ({Path(matcher.blocklist.source).name})"

    def check(self, exchange: Exchange) -> str | None:
        entry = self.matcher.find(exchange.target_words)
        return f"{entry!r}" if entry is not None else None


class TopWordsRule:
    name = "top-words"

    def __init__(self, has_top_word: Sequence[bool], count: int, min_words: int) -> None:
        self.has_top_word = has_top_word
        self.min_words = min_words
        self.description = f"target has none of the corpus's {count} most frequent words"

    def check(self, exchange: Exchange) -> str | None:
        words = len(exchange.target_words)
        if words < self.min_words or self.has_top_word[exchange.number]:
            return None
        return f"{words} words, none frequent"


class BlandRule:
    name = "bland"

    def __init__(self, frequent_trigrams: Sequence[int], share: float, threshold: int) -> None:
        self.frequent_trigrams = frequent_trigrams
        self.share = share
        self.description = f">= {share:.0%} of target trigrams seen >= {threshold} times"

    def check(self, exchange: Exchange) -> str | None:
        trigrams = len(exchange.target_words) - 2
        if trigrams < 1:
            return None
        common = self.frequent_trigrams[exchange.number]
        return f"{common}/{trigrams} trigrams frequent" if common / trigrams >= self.share else None


def build_rules(config: FilterConfig, stats: CorpusStats, matcher: BlocklistMatcher | None) -> list[Rule]:
    """The enabled rules in the order they are tried (see the module docstring)."""
    rules: list[Rule] = []
    if config.enabled("community") and stats.communities:
        rules.append(CommunityRule(stats.blocked_communities, config.community_share))
    if config.enabled("url"):
        rules.append(UrlRule(config.url_pattern, config.source_turns))
    if config.enabled("markup"):
        rules.append(MarkupRule(config.markup_pattern))
    if config.enabled("length"):
        rules.append(LengthRule(config.max_words, config.source_turns))
    if config.enabled("repeat"):
        rules.append(RepeatRule(config.repeat_count))
    if config.enabled("blocklist") and matcher is not None:
        rules.append(BlocklistRule(matcher))
    if config.enabled("top-words"):
        rules.append(TopWordsRule(stats.has_top_word, config.top_words, config.top_words_min_words))
    if config.enabled("bland"):
        rules.append(BlandRule(stats.frequent_trigrams, config.bland_share, stats.trigram_threshold))
    return rules
