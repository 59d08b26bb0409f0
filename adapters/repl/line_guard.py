"""What the chat's input does with text that would make a line longer than the chat accepts.

Laying out 100,000 characters on every redraw froze the terminal for minutes, so a paste
that makes the line too long is not inserted: it and whatever follows it are counted and
dropped until Enter, which reports the line's length and sends nothing (or Ctrl-C, which
clears it). A terminal without bracketed paste delivers a paste in pieces, one per read
of the terminal (see ``coalesce_pastes``), and the pieces that fit are inserted as they
come; the piece that makes the line too long takes the pieces of the same paste back out,
so the input shows what it held before the paste, as it does for a bracketed paste.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prompt_toolkit.document import Document

# Enough of a line's beginning to tell a command (and its name) from a message.
START = 100


class LineGuard:
    """One input line's guard: how much it dropped, and where the paste now arriving began."""

    def __init__(self, fits: Callable[[str], bool]) -> None:
        self.fits = fits  # whether the chat accepts a line with this text
        self.reset()

    def reset(self) -> None:
        """A new line: nothing dropped, no paste under way."""
        self.dropped = 0  # characters counted and not inserted
        self._before: Document | None = None  # the input before the paste now arriving
        self._after: Document | None = None  # the input as that paste's last piece left it
        self._start = ""  # the line's beginning as entered, once a paste was taken back

    @property
    def overflowing(self) -> bool:
        return self.dropped > 0

    def length(self, text: str) -> int:
        """The length of the line the person entered: what the input shows and what it dropped."""
        return len(text) + self.dropped

    def start(self, text: str) -> str:
        """The beginning of the line the person entered, whose input now shows ``text`` (what
        says whether the line is a message or a command, if the paste began with one)."""
        return self._start or text

    def paste(self, document: Document, data: str) -> Document:
        """The input after a pasted piece ``data`` arrives while it holds ``document``.

        A piece that follows the previous one with nothing typed in between (the input is
        as that piece left it) belongs to the same paste."""
        from prompt_toolkit.document import Document

        continuing = self._after is not None and document == self._after
        if not continuing:
            self._before = document
        cursor = document.cursor_position
        entered = document.text[:cursor] + data + document.text[cursor:]
        if self.dropped or not self.fits(entered):
            if not self.dropped:
                self._start = entered[:START]
            if continuing and self._before is not None:
                self.dropped += len(document.text) - len(self._before.text)
                document = self._before
            self.dropped += len(data)
            self._after = None
            return document
        self._after = Document(entered, cursor + len(data))
        return self._after

    def typed(self, data: str) -> None:
        """A key typed while the line is too long: counted, not inserted."""
        self.dropped += len(data)
