"""Stop strings on a stream of text deltas.

A stop string may arrive split over several deltas ("<|us" then "er|>"), so text that
could still be the start of one is held back until it cannot; the stop string itself and
everything after it are never emitted.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Feed deltas to :meth:`push`; emit what it returns; :attr:`hit` says a stop string was found."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not isinstance(stop, str) or not stop for stop in stops):
            raise ValueError(f"`stop` strings must be non-empty text, got {list(stops)!r}")
        self.stops = tuple(stops)
        self.pending = ""
        self.hit = False

    def push(self, delta: str) -> str:
        """The part of ``delta`` (and of held-back text) that is certain to be in the reply."""
        if self.hit:
            return ""
        text = self.pending + delta
        found = [text.find(stop) for stop in self.stops if stop in text]
        if found:
            self.hit = True
            self.pending = ""
            return text[: min(found)]
        hold = self._held_tail(text)
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """The held-back text at the end of the reply (no stop string came)."""
        text, self.pending = self.pending, ""
        return "" if self.hit else text

    def _held_tail(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
