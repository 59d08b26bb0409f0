"""Text <-> token helpers that treat user text as text, never as control tokens."""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from typing import Any

from chatcore.errors import ChatcoreError

MAX_MESSAGE_CHARS = 8000

# Terminal escape sequences (ECMA-48), removed whole: dropping only the ESC character
# would leave "[31mred[0m" behind. In order: control strings (OSC, DCS, APC ...)
# ended by BEL or ST; CSI sequences; two-part escapes ("ESC ( B"); one-character
# escapes ("ESC 7"). An unterminated control string loses only its introducer, so
# text after a stray "ESC ]" is kept.
ESCAPE_SEQUENCE = re.compile(
    r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"
    r"|(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
    r"|\x1b[ -/]+[0-~]"
    r"|\x1b[0-~]"
)


def remove_escape_sequences(text: str) -> str:
    """``text`` without terminal escape sequences (colours, cursor moves, window titles)."""
    return ESCAPE_SEQUENCE.sub("", text)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with special-token strings (``<|endoftext|>``) kept as text."""
    # verbose=False: chatcore fits prompts to the model itself, so transformers' warning about
    # text longer than the model's positions is not for the user.
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"])


def undecodable_at(text: str) -> int | None:
    """Where the first byte that was not UTF-8 sits in ``text`` (decoded with surrogateescape,
    as Python decodes command-line arguments and the chat its input), or None."""
    return next((index for index, char in enumerate(text) if "\udc80" <= char <= "\udcff"), None)


def checked_text(text: Any, what: str, max_chars: int) -> str:
    """``text`` as str (UTF-8 bytes decoded), or ChatcoreError naming ``what`` is wrong with it."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ChatcoreError(f"the {what} is not UTF-8 text (bad byte at position {error.start})") from None
    if not isinstance(text, str):
        raise ChatcoreError(f"a {what} must be text, got {type(text).__name__}")
    if len(text) > max_chars:
        raise ChatcoreError(f"the {what} is {len(text):,} characters long; the limit is {max_chars:,}")
    return text


# Every way of breaking a line (CR LF, CR, vertical tab, form feed, NEL, U+2028, U+2029): one "\n".
LINE_BREAK = re.compile("\r\n|[\r\v\f\x85\u2028\u2029]")
# Spaces between words (not a line's indentation): one.
INNER_SPACES = re.compile("(?<=\\S) {2,}")


def clean_message(text: Any, max_chars: int = MAX_MESSAGE_CHARS) -> str:
    """Normalise one incoming message, or raise ChatcoreError saying what is wrong.

    Its lines are kept as written (code, lists and indentation reach the model as sent):
    every kind of line break becomes a newline; each line keeps its indentation and loses
    its trailing spaces, and runs of spaces between its words become one; the message
    loses the whitespace at either end and any run of more than one blank line; tabs
    stay. Terminal escape sequences, other control characters and lone surrogates are
    removed.
    """
    text = checked_text(text, "message", max_chars)
    text = LINE_BREAK.sub("\n", remove_escape_sequences(text))
    kept = "".join(char for char in text if char in "\n\t" or unicodedata.category(char) not in ("Cc", "Cs"))
    lines = [INNER_SPACES.sub(" ", line.rstrip()) for line in kept.split("\n")]
    cleaned = re.sub("\n{3,}", "\n\n", "\n".join(lines)).strip()
    if not cleaned:
        raise ChatcoreError("the message is empty")
    return cleaned


# Explicit bidi embeddings, overrides and isolates, and the marks: they reorder a line.
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


# Unicode's control characters (category Cc: C0, DEL and C1) but newline and tab, lone
# surrogates (Cs) and the bidi controls: one regular expression, so a 10 MB text is escaped
# at C speed.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff" + "".join(sorted(BIDI_CONTROLS)) + "]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def display_safe(text: str) -> str:
    """``text`` with control characters (ESC, BEL, bidi overrides ...) shown as ``\\x1b`` instead of acted on."""
    return _UNSAFE.sub(_escaped, text)


MAX_SHOWN_VALUE = 60  # characters of a refused value an error message repeats


def shown_value(value: object) -> str:
    """``repr(value)`` for an error message, cut to about MAX_SHOWN_VALUE characters: a
    5,000-character value must not become a 5,000-character message."""
    text = repr(value)
    if len(text) <= MAX_SHOWN_VALUE:
        return text
    return f"{text[: MAX_SHOWN_VALUE - 1]}… ({len(str(value)):,} characters)"


def shown_argument(value: object) -> str:
    """What an error message about a wrong argument shows of it, on one line: a plain value
    (text, a number, None, a list or dict) as :func:`shown_value`, anything else by its type
    (an object's repr may run over many lines: a model's does)."""
    if value is None or isinstance(value, (str, bytes, bytearray, int, float, list, tuple, dict, set)):
        return one_line(shown_value(value))
    return f"a {type(value).__name__} object"


def one_line(text: str, limit: int | None = None) -> str:
    flat = " ".join(display_safe(text).split())
    if limit is not None and len(flat) > limit:
        return flat[: limit - 1] + "…"
    return flat


def vocabulary_sha256(tokenizer: Any, *also: Any) -> str:
    """sha256 of a tokenizer's vocabulary (token -> id, in id order), independent of how its
    files are laid out; ``also`` (JSON-able values such as the EOS id) joins the hash. Saved
    files (CoCon blocks, discriminator heads) record it to recognise the tokenizer they need."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    payload = [vocab, *also] if also else vocab
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode("utf-8")).hexdigest()
