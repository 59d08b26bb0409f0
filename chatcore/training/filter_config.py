"""The filter's settings: rule names, defaults, ``FilterConfig`` and config files (see
:mod:`chatcore.training.filtering`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import tomllib
from pydantic import (
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
)

from chatcore.errors import OptionError
from chatcore.options import Settings, parse_settings

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


Share = Annotated[float, Field(gt=0.0, le=1.0)]


class FilterConfig(Settings):
    """Which rules run and with what thresholds. Every field has a working default."""

    model_config = ConfigDict(frozen=True)

    disable: tuple[str, ...] = ()
    """Rules that do not run (comma list)."""
    source_turns: PositiveInt = 1
    """How many turns before a reply form its context."""
    url_pattern: str = DEFAULT_URL_PATTERN
    """A regular expression for links."""
    markup_pattern: str = DEFAULT_MARKUP_PATTERN
    """A regular expression for markup."""
    max_words: PositiveInt = 200
    """A longer turn is dropped."""
    repeat_count: Annotated[int, Field(ge=2)] = 3
    """A turn that repeats a word or phrase this many times is dropped."""
    blocklist_path: str | None = None
    """A blocklist file instead of the bundled one."""
    community_share: Share = 0.1
    community_min_lines: PositiveInt = 20
    top_words: PositiveInt = 50
    top_words_min_words: NonNegativeInt = 5
    bland_share: Share = 0.9
    bland_min_count: NonNegativeInt = 20
    bland_reference_count: PositiveFloat = 1000.0
    bland_reference_words: PositiveFloat = 1.8e9
    min_turns: PositiveInt = 2
    """A conversation left with fewer turns is dropped."""
    examples: NonNegativeInt = 3
    """Examples of each rule's drops shown in the report."""

    @field_validator("disable")
    @classmethod
    def _known_rules(cls, disable: tuple[str, ...]) -> tuple[str, ...]:
        for name in disable:
            if name not in RULE_NAMES:
                raise ValueError(f"`disable` names an unknown rule {name!r}; rules: {', '.join(RULE_NAMES)}")
        return disable

    @field_validator("url_pattern", "markup_pattern")
    @classmethod
    def _pattern(cls, pattern: str, info: ValidationInfo) -> str:
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"`{info.field_name}` is not a valid regular expression: {error}") from None
        return pattern

    @field_validator("blocklist_path")
    @classmethod
    def _blocklist(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).is_file():
            raise ValueError(f"`blocklist_path` is not a file: {path}")
        return path

    def enabled(self, rule: str) -> bool:
        return rule not in self.disable

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(cls.model_fields)

    def updated(self, values: Mapping[str, Any], origin: str = "filter settings") -> FilterConfig:
        """A copy with ``values`` applied; strings are converted to each field's type,
        so the same path serves config files and ``--filter-set key=value``."""
        known = self.field_names()
        changes: dict[str, Any] = {}
        for key, raw in values.items():
            name = key.replace("-", "_")
            if name not in known:
                raise OptionError(f"{origin}: unknown filter setting {key!r}; known: {', '.join(known)}")
            changes[name] = raw
        try:
            return parse_settings(FilterConfig, {**self.model_dump(), **changes})
        except OptionError as error:
            raise OptionError(f"{origin}: {error}") from None


def load_filter_config(path: str | Path, base: FilterConfig | None = None) -> FilterConfig:
    """Read a JSON or TOML file of filter settings, e.g. ``{"disable": ["url"], "max_words": 300}``."""
    path = Path(path)
    if not path.is_file():
        raise OptionError(f"filter config not found: {path}")
    kind = "TOML" if path.suffix == ".toml" else "JSON"
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise OptionError(f"filter config {path}: not {kind} text (not UTF-8 at byte {error.start})") from None
    except OSError as error:
        raise OptionError(f"filter config {path}: cannot be read ({error.strerror or error})") from None
    try:
        values = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as error:
        raise OptionError(f"filter config {path}: not valid {kind} ({error})") from None
    if not isinstance(values, dict):
        raise OptionError(f"filter config {path}: expected an object of settings")
    return (base or FilterConfig()).updated(values, origin=f"filter config {path}")
