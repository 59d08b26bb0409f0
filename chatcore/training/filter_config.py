"""The filter's settings: rule names, defaults, ``FilterConfig`` and config files (see
:mod:`chatcore.training.filtering`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import tomllib

from chatcore.errors import OptionError
from chatcore.options import convert_value, settings_fields

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
