"""Training-data filtering after DialoGPT's eight rules.

An *exchange* is one turn of a dialogue (the *target*) together with the turns before it
(the *source*). Every turn is a target, the first one too (its source is empty): the
language model learns to produce every turn, so every turn is worth checking. Rules that
look at the source (``url``, ``length``) use the ``source_turns`` turns right before the
target (one by default: the message it answers), not the whole history, which in a
30-turn chat would make the length rule drop almost every late turn.

Rules, in the order they are tried (an exchange removed by several rules is counted by
the first; ``matched`` in the report counts every rule that matched):

    community  the dialogue's community (channel, subreddit, file) has too many
               blocklisted lines: every exchange in it goes (DialoGPT rule 7)
    url        a URL in the source or the target (rule 1)
    markup     the target contains markup markers, "[" or "]" by default (rule 4)
    length     source plus target longer than ``max_words`` words (rule 5)
    repeat     the target repeats a word ``repeat_count`` times in a row (rule 2)
    blocklist  the target contains a blocklisted word or phrase (rule 6)
    top-words  the target contains none of the corpus's ``top_words`` most frequent
               words: likely not the corpus's language (rule 3)
    bland      ``bland_share`` or more of the target's word trigrams are very frequent
               trigrams of the corpus (rule 8)

A removed target is cut out of its dialogue, which is split there: the turns before it
form one dialogue and the turns after it another (``id/2``, ``id/3`` ...), so no reply is
ever trained against a context that lost a turn. Pieces shorter than ``min_turns`` turns
are dropped (a monologue teaches no reply); the report counts their turns as
``orphaned``.

"Very frequent" for the bland rule scales DialoGPT's bar (1,000 occurrences in its 1.8
billion words) to the corpus: a trigram is very frequent when it occurs at least
``max(bland_min_count, bland_reference_count * corpus_words / bland_reference_words)``
times, the floor keeping the rule meaningful on small corpora.
"""

from __future__ import annotations

import json
import math
import operator
import re
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol

import tomllib

from chatcore.errors import CorpusError, OptionError
from chatcore.options import convert_value, settings_fields
from chatcore.training.corpus import Dialogue

RULE_NAMES = ("community", "url", "markup", "length", "repeat", "blocklist", "top-words", "bland")
DEFAULT_BLOCKLIST = Path(__file__).with_name("blocklist.txt")
DEFAULT_URL_PATTERN = (
    r"(?i)\b(?:https?://|ftp://|www\.)\S+"
    r"|\b[a-z0-9][a-z0-9-]*(?:\.[a-z0-9-]+)*\.(?:com|org|net|edu|gov|io|co|uk|de|ly|me|tv|gg|info|biz)\b(?:/\S*)?"
)
DEFAULT_MARKUP_PATTERN = r"[\[\]]"
# Words are runs of letters and digits, with inner apostrophes kept ("don't" is one word).
WORD_PATTERN = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")


def words_of(text: str) -> list[str]:
    """Lower-cased words of a text, the unit every word-based rule counts in."""
    return WORD_PATTERN.findall(text.lower())


# -- configuration -------------------------------------------------------------------


@dataclass(frozen=True)
class FilterConfig:
    """Which rules run and with what thresholds. Every field has a working default."""

    disable: tuple[str, ...] = ()
    source_turns: int = 1
    url_pattern: str = DEFAULT_URL_PATTERN
    markup_pattern: str = DEFAULT_MARKUP_PATTERN
    max_words: int = 200
    repeat_count: int = 3
    blocklist_path: str | None = None
    community_share: float = 0.1
    community_min_lines: int = 20
    top_words: int = 50
    top_words_min_words: int = 5
    bland_share: float = 0.9
    bland_min_count: int = 20
    bland_reference_count: float = 1000.0
    bland_reference_words: float = 1.8e9
    min_turns: int = 2
    examples: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.disable, str):
            object.__setattr__(self, "disable", tuple(n.strip() for n in self.disable.split(",") if n.strip()))
        else:
            object.__setattr__(self, "disable", tuple(self.disable))
        for name in self.disable:
            if name not in RULE_NAMES:
                raise ValueError(f"`disable` names an unknown rule {name!r}; rules: {', '.join(RULE_NAMES)}")
        positive = ("source_turns", "max_words", "community_min_lines", "top_words", "min_turns")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        for name in ("top_words_min_words", "bland_min_count", "examples"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}")
        if not isinstance(self.repeat_count, int) or self.repeat_count < 2:
            raise ValueError(f"`repeat_count` must be an integer of at least 2, got {self.repeat_count!r}")
        for name in ("community_share", "bland_share"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                raise ValueError(f"`{name}` must be a share in (0, 1], got {value!r}")
        for name in ("bland_reference_count", "bland_reference_words"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"`{name}` must be a positive number, got {value!r}")
        for name in ("url_pattern", "markup_pattern"):
            try:
                re.compile(getattr(self, name))
            except (re.error, TypeError) as error:
                raise ValueError(f"`{name}` is not a valid regular expression: {error}") from None
        if self.blocklist_path is not None and not Path(self.blocklist_path).is_file():
            raise ValueError(f"`blocklist_path` is not a file: {self.blocklist_path}")

    def enabled(self, rule: str) -> bool:
        return rule not in self.disable

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def updated(self, values: Mapping[str, Any], origin: str = "filter settings") -> FilterConfig:
        """A copy with ``values`` applied; strings are converted to each field's type,
        so the same path serves config files and ``--filter-set key=value``."""
        known = self.field_names()
        fields = settings_fields(type(self))
        changes: dict[str, Any] = {}
        for key, raw in values.items():
            name = key.replace("-", "_")
            if name not in known:
                raise OptionError(f"{origin}: unknown filter setting {key!r}; known: {', '.join(known)}")
            try:
                changes[name] = convert_value(name, fields[name], raw)
            except OptionError as error:
                raise OptionError(f"{origin}: {error}") from None
        try:
            return replace(self, **changes)
        except ValueError as error:
            raise OptionError(f"{origin}: {error}") from None


def load_filter_config(path: str | Path, base: FilterConfig | None = None) -> FilterConfig:
    """Read a JSON or TOML file of filter settings, e.g. ``{"disable": ["url"], "max_words": 300}``."""
    path = Path(path)
    if not path.is_file():
        raise OptionError(f"filter config not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        values = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as error:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise OptionError(f"filter config {path}: not valid {kind} ({error})") from None
    if not isinstance(values, dict):
        raise OptionError(f"filter config {path}: expected an object of settings")
    return (base or FilterConfig()).updated(values, origin=f"filter config {path}")


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


# -- the report ------------------------------------------------------------------------


@dataclass
class Example:
    dialogue_id: str
    turn: int
    source: str
    target: str
    reason: str


@dataclass
class RuleReport:
    name: str
    description: str
    status: str  # "on", "off" (disabled) or "n/a" (does not apply to this corpus)
    removed: int = 0
    matched: int = 0
    examples: list[Example] = field(default_factory=list)


@dataclass
class FilterReport:
    """What filtering did: per-rule counts (``removed`` sums to ``exchanges_removed``)."""

    rules: list[RuleReport]
    dialogues_in: int = 0
    dialogues_out: int = 0
    exchanges_in: int = 0
    exchanges_removed: int = 0
    exchanges_orphaned: int = 0
    exchanges_out: int = 0
    words_in: int = 0
    words_out: int = 0
    trigram_threshold: int = 0
    top_words: list[str] = field(default_factory=list)
    blocked_communities: dict[str, tuple[int, int]] = field(default_factory=dict)
    seconds: float = 0.0

    def rule(self, name: str) -> RuleReport:
        for report in self.rules:
            if report.name == name:
                return report
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)

    def format(self, examples: int | None = None) -> str:
        """A plain-text table of the counts, then the examples of each rule."""
        share = lambda n: f"{100 * n / max(1, self.exchanges_in):5.2f}%"  # noqa: E731
        lines = [
            f"filtering: {self.exchanges_in:,} exchanges in {self.dialogues_in:,} dialogues "
            f"({self.words_in:,} words), {self.seconds:.1f} s",
            f"  {'rule':<10} {'status':<6} {'removed':>9} {'share':>7} {'matched':>9}  description",
        ]
        for report in self.rules:
            lines.append(
                f"  {report.name:<10} {report.status:<6} {report.removed:>9,} {share(report.removed):>7} "
                f"{report.matched:>9,}  {report.description}"
            )
        lines += [
            f"  {'removed':<17} {self.exchanges_removed:>9,} {share(self.exchanges_removed):>7}",
            f"  {'orphaned':<17} {self.exchanges_orphaned:>9,} {share(self.exchanges_orphaned):>7}"
            "  (kept turns left alone in a piece shorter than min_turns)",
            f"  {'kept':<17} {self.exchanges_out:>9,} {share(self.exchanges_out):>7}"
            f"  in {self.dialogues_out:,} dialogues ({self.words_out:,} words)",
        ]
        if self.trigram_threshold:
            lines.append(f"  bland: a trigram is very frequent from {self.trigram_threshold} occurrences")
        if self.blocked_communities:
            names = ", ".join(sorted(self.blocked_communities))
            lines.append(f"  communities dropped: {names}")
        for report in self.rules:
            shown = report.examples[: examples if examples is not None else len(report.examples)]
            if not shown:
                continue
            lines.append(f"examples removed by {report.name}:")
            for example in shown:
                source = f"{example.source!r} -> " if example.source else ""
                lines.append(
                    f"  [{example.dialogue_id} #{example.turn}] {source}{example.target!r}  ({example.reason})"
                )
        return "\n".join(lines)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- filtering -------------------------------------------------------------------------


@dataclass
class FilterResult:
    dialogues: list[Dialogue]
    report: FilterReport


def kept_runs(removed: Sequence[bool]) -> list[list[int]]:
    """Indices of each run of kept turns, in order (removed turns separate runs)."""
    runs: list[list[int]] = [[]]
    for index, drop in enumerate(removed):
        if not drop:
            runs[-1].append(index)
        elif runs[-1]:
            runs.append([])
    return [run for run in runs if run]


def split_dialogue(dialogue: Dialogue, removed: Sequence[bool], min_turns: int = 2) -> list[Dialogue]:
    """Cut the removed turns out: each run of kept turns of at least ``min_turns`` turns
    becomes a dialogue.

    An untouched dialogue keeps its id; pieces are ``id/1``, ``id/2`` ... (numbered by
    position among all runs, so ids stay stable when a short run is dropped), and so
    share the thread key of the original for the held-out split.
    """
    if not any(removed):
        return [dialogue] if len(dialogue.turns) >= min_turns else []
    return [
        Dialogue(
            id=f"{dialogue.id}/{number}", turns=tuple(dialogue.turns[i] for i in run), community=dialogue.community
        )
        for number, run in enumerate(kept_runs(removed), start=1)
        if len(run) >= min_turns
    ]


def filter_dialogues(
    dialogues: Sequence[Dialogue], config: FilterConfig | None = None, blocklist: Blocklist | None = None
) -> FilterResult:
    """Apply the enabled rules to every exchange and split dialogues at removed turns."""
    config = config or FilterConfig()
    started = time.perf_counter()
    needs_blocklist = config.enabled("blocklist") or config.enabled("community")
    if blocklist is None and needs_blocklist:
        blocklist = Blocklist.load(config.blocklist_path)
    matcher = BlocklistMatcher(blocklist) if blocklist is not None and needs_blocklist else None
    items, offset = [], 0
    for dialogue in dialogues:
        items.append(TokenizedDialogue(dialogue, [words_of(turn) for turn in dialogue.turns], offset))
        offset += len(dialogue.turns)
    stats = gather_stats(items, config, matcher)
    rules = build_rules(config, stats, matcher)
    reports = {rule.name: RuleReport(rule.name, rule.description, "on") for rule in rules}
    report = FilterReport(
        rules=[
            reports.get(name) or RuleReport(name, "", "off" if not config.enabled(name) else "n/a")
            for name in RULE_NAMES
        ],
        dialogues_in=len(items),
        exchanges_in=stats.exchanges,
        words_in=stats.words,
        trigram_threshold=stats.trigram_threshold,
        top_words=stats.top_words,
        blocked_communities=dict(stats.blocked_communities),
    )
    community_report = report.rule("community")
    if community_report.status == "n/a":
        community_report.description = "no dialogue has a community"
    kept: list[Dialogue] = []
    for item in items:
        removed = [False] * len(item.words)
        for index in range(len(item.words)):
            exchange = Exchange(item, index)
            first = True
            for rule in rules:
                reason = rule.check(exchange)
                if reason is None:
                    continue
                rule_report = reports[rule.name]
                rule_report.matched += 1
                if first:
                    first = False
                    removed[index] = True
                    rule_report.removed += 1
                    if len(rule_report.examples) < config.examples:
                        source = item.dialogue.turns[index - 1] if index else ""
                        rule_report.examples.append(
                            Example(item.dialogue.id, index, _clip(source, 100), _clip(exchange.target, 160), reason)
                        )
        kept.extend(split_dialogue(item.dialogue, removed, config.min_turns))
        report.exchanges_removed += sum(removed)
        for run in kept_runs(removed):
            if len(run) >= config.min_turns:
                report.exchanges_out += len(run)
                report.words_out += sum(len(item.words[i]) for i in run)
            else:
                report.exchanges_orphaned += len(run)
    report.dialogues_out = len(kept)
    report.seconds = time.perf_counter() - started
    return FilterResult(kept, report)
