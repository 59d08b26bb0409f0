"""What filtering did: per-rule counts and examples, as text or JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
