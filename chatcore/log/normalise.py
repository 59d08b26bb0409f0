"""Values made storable on every database alike, each change noted in the row it changes.

SQLite stores nearly anything; PostgreSQL refuses a NUL in text, NaN and Infinity in
JSON, a string longer than its column, an integer wider than its column. A message
refused on one backend and kept on the other would make the same chat logged twice
differ, so every value is made to fit before it is written, on both:

- a lone surrogate (no UTF-8 database can hold one) becomes U+FFFD;
- NUL becomes U+2400 ``␀``, in text and in every JSON field;
- NaN and ±Infinity become null, in JSON and in the float columns;
- a string longer than its column is cut to fit; an integer wider than its column is left out;
- but an ``author_id`` longer than its column is stored as a digest of it
  (:func:`stored_author_id`), never cut: two authors whose ids share their first 64
  characters would merge, and a deletion by the full id would find nothing.

What was changed is listed in the row: ``provenance["normalised"]`` for a message,
``meta["normalised"]`` for a conversation (one line per field, e.g.
``"author_id: NUL replaced by U+2400"``), so nothing is changed silently.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

REPLACEMENT = "\ufffd"  # stands for a lone surrogate, which no UTF-8 database can hold
NUL_SYMBOL = "\u2400"  # stands for NUL, which PostgreSQL's text cannot hold
NOTES_KEY = "normalised"

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
INTEGER_BITS = {"token_count": 32, "prompt_tokens": 32, "seed": 64}
AUTHOR_ID_CHARS = 64  # the author_id column's width
AUTHOR_DIGEST_PREFIX = "sha256:"


def stored_author_id(author_id: str) -> str:
    """``author_id`` as the log stores and looks it up: itself when it fits its column, else
    ``sha256:`` and the first 57 hex digits of its SHA-256 (64 characters in all).

    An id given as it is never takes the digest form (one that starts with ``sha256:`` is
    digested too), so no author can pose as another by sending that author's digest. The
    writes, ``logs export --author`` and ``logs delete --author`` all map ids through this.
    """
    if len(author_id) <= AUTHOR_ID_CHARS and not author_id.startswith(AUTHOR_DIGEST_PREFIX):
        return author_id
    digest = hashlib.sha256(author_id.encode("utf-8", "surrogatepass")).hexdigest()
    return AUTHOR_DIGEST_PREFIX + digest[: AUTHOR_ID_CHARS - len(AUTHOR_DIGEST_PREFIX)]


class Normaliser:
    """Cleans the values of one row; :attr:`notes` lists what it changed, by field."""

    def __init__(self) -> None:
        self._notes: dict[str, None] = {}

    @property
    def notes(self) -> list[str]:
        return list(self._notes)

    def _note(self, field: str, change: str) -> None:
        self._notes[f"{field}: {change}"] = None

    def text(self, value: str | None, field: str, limit: int | None = None) -> str | None:
        if value is None:
            return None
        if _LONE_SURROGATE.search(value):
            value = _LONE_SURROGATE.sub(REPLACEMENT, value)
            self._note(field, "lone surrogate replaced by U+FFFD")
        if "\x00" in value:
            value = value.replace("\x00", NUL_SYMBOL)
            self._note(field, "NUL replaced by U+2400")
        if limit is not None and len(value) > limit:
            value = value[:limit]
            self._note(field, f"cut to {limit} characters")
        return value

    def author_id(self, value: str | None) -> str | None:
        """The author as :func:`stored_author_id` maps it (the change noted), else cleaned as text."""
        if value is None:
            return None
        stored = stored_author_id(value)
        if stored != value:
            self._note("author_id", f"stored as its SHA-256 digest ({len(value)} characters)")
            return stored
        return self.text(value, "author_id")

    def real(self, value: float | None, field: str) -> float | None:
        if isinstance(value, float) and not math.isfinite(value):
            self._note(field, f"{value} replaced by null")
            return None
        return value

    def integer(self, value: int | None, field: str) -> int | None:
        bits = INTEGER_BITS[field]
        if isinstance(value, int) and not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
            self._note(field, f"{value} does not fit {bits} bits; left out")
            return None
        return value

    def json(self, value: Any, field: str) -> Any:
        """``value`` with every string cleaned and every non-finite float made null, recursively."""
        if isinstance(value, str):
            return self.text(value, field)
        if isinstance(value, float):
            return self.real(value, field)
        if isinstance(value, dict):
            return {self.json(key, field): self.json(item, field) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.json(item, field) for item in value]
        return value

    def noted(self, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """``value`` (a JSON object) with the notes added, when there are any."""
        if not self._notes:
            return value
        return {**(value or {}), NOTES_KEY: [*((value or {}).get(NOTES_KEY) or []), *self.notes]}


def storable(value: Any) -> Any:
    """``value`` made storable on every backend (strings, lists and dicts, recursively); the notes dropped."""
    return Normaliser().json(value, "value")
