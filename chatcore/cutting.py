"""Cutting a reply short without leaving half a word: what a timeout, a shutdown or a
disconnected client leaves of a reply ends at its last whole word.

A word is known to be whole only once something after it shows that it ended: a space,
a line break, or punctuation that ends a word (``. , ; : ! ? …`` and closing brackets and
quotes). "Hi there" cut short keeps "Hi": "there" might have gone on as "therefore".
Scripts written without spaces (Chinese, Japanese) are cut between any two characters,
as line breaking does; an emoji followed by something other than its modifiers (skin
tone, a joiner, a variation selector) is whole too. A mark that combines with the
character before it never holds back what came before (the character is whole; the
mark follows it). A run of letters with no such
boundary (a long word, a URL, Thai) is one unfinished word, and a trailing U+FFFD (the
first bytes of a character whose other bytes never came) is never whole.

:func:`whole_words` cuts a finished text; :class:`WholeWords` holds back the unfinished
end of a streamed one, so that what a person sees can always stop where it is.
"""

from __future__ import annotations

import unicodedata

# Punctuation after which a word has ended. The first group also appears inside words
# and numbers ("3.14", "a,b", "12:30"), so it ends a word only before a non-alphanumeric
# character (or at the very end).
INNER_MARKS = frozenset(".,:;")
END_MARKS = frozenset("!?…‼⁇⁈⁉،؛؟।॥")
# A closing quote that is also the apostrophe of "don’t": not an end of a word.
APOSTROPHES = frozenset("\u2019\u02bc")
ZERO_WIDTH_JOINER = "\u200d"
KATAKANA_LONG_MARK = "\u30fc"
# Each of these characters is a unit of its own: scripts written without spaces, and
# their punctuation ("。", "、", full-width forms).
UNSPACED_RANGES = (
    (0x2E80, 0x2FDF),  # CJK radicals
    (0x3000, 0x30FF),  # CJK symbols and punctuation, Hiragana, Katakana
    (0x3100, 0x31FF),  # Bopomofo, Katakana extensions
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFE30, 0xFE4F),  # CJK compatibility forms
    (0xFF01, 0xFF9F),  # full-width punctuation and letters, half-width Katakana
    (0x20000, 0x3FFFF),  # CJK extensions B and on
)


def _unspaced(char: str) -> bool:
    code = ord(char)
    return any(low <= code <= high for low, high in UNSPACED_RANGES)


def _regional_indicator(char: str) -> bool:
    return 0x1F1E6 <= ord(char) <= 0x1F1FF  # two of them make a flag


def _attaches(char: str) -> bool:
    """Whether ``char`` belongs to the character before it (a combining mark, a joiner,
    a variation selector, a skin tone, a Katakana length mark)."""
    return (
        unicodedata.category(char) in ("Mn", "Mc", "Me")
        or char == ZERO_WIDTH_JOINER
        or 0x1F3FB <= ord(char) <= 0x1F3FF
        or char == KATAKANA_LONG_MARK
    )


def _ends_a_word(text: str, index: int, final: bool) -> bool:
    """Whether ``text[:index]`` ends with a whole word (``0 < index <= len(text)``);
    ``final``: the text will not go on (a stream's end may still become "3.14")."""
    after = text[index] if index < len(text) else None
    if after is not None and after.isspace():
        return True
    before = text[index - 1]
    if before in INNER_MARKS:
        return final if after is None else not after.isalnum()
    if before in END_MARKS or _unspaced(before):
        return True
    category = unicodedata.category(before)
    if category in ("Pe", "Pf") and before not in APOSTROPHES:
        return True
    # A symbol (an emoji) is whole once something that does not attach to it follows.
    if after is None or _attaches(after) or before in (ZERO_WIDTH_JOINER, "\ufffd"):
        return False
    if _regional_indicator(before) and _regional_indicator(after):
        return _flag_ends_at(text, index)
    return category.startswith("S")


def _flag_ends_at(text: str, index: int) -> bool:
    """Whether an even run of regional indicators (whole flags) ends at ``index``."""
    start = index
    while start > 0 and _regional_indicator(text[start - 1]):
        start -= 1
    return (index - start) % 2 == 0


def last_boundary(text: str, start: int = 0, final: bool = True) -> int:
    """The largest ``index`` where ``text[:index]`` ends with a whole word, else 0. Only
    indexes above ``start`` are looked at: a caller that has looked at a shorter text
    knows that none below it ends a word (other than in whitespace it holds back)."""
    for index in range(len(text), start, -1):
        if _ends_a_word(text, index, final):
            return index
    return 0


def whole_words(text: str) -> str:
    """``text`` cut back to the end of its last whole word, trailing whitespace removed:
    "Hello, wor" -> "Hello,"; "no boundary" with nothing whole -> "".

    The one cut every adapter applies to a reply stopped before its end (a timeout, a
    shutdown, a client gone, Ctrl-C), so that what a person reads and what the log keeps
    never end in half a word."""
    return text[: last_boundary(text)].rstrip()


class WholeWords:
    """A stream of text deltas with the unfinished end held back.

    :meth:`push` returns the text now known to be whole words (whitespace after the last
    one waits with the unfinished word); :meth:`flush` returns what is held when the
    reply ends by itself. Whatever was returned so far is always the start of
    ``whole_words`` of the text pushed: a reply cut at any moment has shown nothing it does
    not keep (at most a final "." or "," that waited to see whether a number went on).
    """

    def __init__(self) -> None:
        self.pending = ""

    def push(self, delta: str) -> str:
        checked = max(len(self.pending) - 1, 0)  # boundaries before it were looked for already
        self.pending += delta
        end = last_boundary(self.pending, checked, final=False)
        whole = self.pending[:end].rstrip()
        self.pending = self.pending[len(whole) :]
        return whole

    def flush(self) -> str:
        rest, self.pending = self.pending, ""
        return rest
