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

import time
from collections.abc import Sequence
from dataclasses import dataclass

from chatcore.training.corpus import Dialogue
from chatcore.training.filter_config import (
    RULE_NAMES,
    FilterConfig,
    load_filter_config,
    words_of,
)
from chatcore.training.filter_report import Example, FilterReport, RuleReport, clip
from chatcore.training.filter_rules import (
    Blocklist,
    BlocklistMatcher,
    CorpusStats,
    Exchange,
    TokenizedDialogue,
    bland_threshold,
    build_rules,
    gather_stats,
)

# The filter's public names, whichever module of it holds them.
__all__ = [
    "RULE_NAMES",
    "Blocklist",
    "BlocklistMatcher",
    "CorpusStats",
    "Example",
    "FilterConfig",
    "FilterReport",
    "FilterResult",
    "RuleReport",
    "bland_threshold",
    "build_rules",
    "filter_dialogues",
    "gather_stats",
    "load_filter_config",
    "split_dialogue",
    "words_of",
]

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
                            Example(item.dialogue.id, index, clip(source, 100), clip(exchange.target, 160), reason)
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
