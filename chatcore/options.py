"""Typed, validated settings for decoders and steerers.

Every decoder and steerer declares its settings as a dataclass. ``parse_settings``
turns ``key=value`` strings (from the CLI, the REPL or Discord) into that dataclass,
converting each value to the field's type and refusing unknown keys. Range checks
live in the dataclass's ``__post_init__`` and raise ``ValueError`` naming the field
and the value; they are reported as :class:`~chatcore.errors.OptionError`.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from chatcore.errors import OptionError

T = TypeVar("T")
C = TypeVar("C", bound="Configurable")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def convert_value(field_name: str, annotation: Any, raw: Any) -> Any:
    """``raw`` (a ``key=value`` string, or a value from a settings file) as ``annotation``
    says; OptionError naming ``field_name`` when it cannot be."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "")):
            if type(None) in args:
                return None
        errors = []
        for option in non_none:
            try:
                return convert_value(field_name, option, raw)
            except OptionError as error:
                errors.append(str(error))
        raise OptionError(errors[0] if errors else f"`{field_name}`: cannot parse {raw!r}")
    if origin is typing.Literal:
        if raw not in args:
            choices = ", ".join(str(a) for a in args)
            raise OptionError(f"`{field_name}` must be one of {choices}, got {raw!r}")
        return raw
    if origin in (tuple, list):
        items: Iterable[Any]
        if isinstance(raw, str):
            items = [item.strip() for item in raw.split(",") if item.strip()]
        elif isinstance(raw, (list, tuple)):
            items = list(raw)
        else:
            raise OptionError(f"`{field_name}` must be a list (comma-separated), got {raw!r}")
        inner = args[0] if args else str
        converted = [convert_value(field_name, inner, item) for item in items]
        return tuple(converted) if origin is tuple else converted
    if annotation is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise OptionError(f"`{field_name}` must be true or false, got {raw!r}")
    if annotation is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise OptionError(f"`{field_name}` must be an integer, got {raw!r}")
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise OptionError(f"`{field_name}` must be an integer, got {raw!r}") from None
    if annotation is float:
        if isinstance(raw, bool):
            raise OptionError(f"`{field_name}` must be a number, got {raw!r}")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise OptionError(f"`{field_name}` must be a number, got {raw!r}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise OptionError(f"`{field_name}` must be a finite number, got {raw!r}")
        return value
    if annotation is str:
        if not isinstance(raw, str):
            raise OptionError(f"`{field_name}` must be text, got {raw!r}")
        return raw
    if annotation is Path:
        if isinstance(raw, Path):
            return raw
        if not isinstance(raw, str) or not raw.strip() or "\x00" in raw:
            raise OptionError(f"`{field_name}` must be a file path, got {raw!r}")
        return Path(raw).expanduser()
    if annotation is dict or origin is dict:
        value = raw
        if isinstance(raw, str):
            try:
                value = json.loads(raw)
            except ValueError:
                raise OptionError(f'`{field_name}` must be a JSON object such as {{"a": 1}}, got {raw!r}') from None
        if not isinstance(value, dict):
            raise OptionError(f'`{field_name}` must be a JSON object such as {{"a": 1}}, got {raw!r}')
        return value
    if annotation is Any:
        return raw
    raise OptionError(f"`{field_name}`: chatcore cannot convert settings of type {annotation!r}")


def check_settings_class(settings_cls: type) -> None:
    """Refuse (TypeError) a Settings class with a field of a type the conversion rules
    do not cover, when its plugin registers it rather than when someone sets it."""
    if settings_cls is object:  # no settings
        return
    if not dataclasses.is_dataclass(settings_cls):
        raise TypeError(f"Settings must be a dataclass, got {settings_cls!r}")
    for name, annotation in settings_fields(settings_cls).items():
        if not _convertible(annotation):
            raise TypeError(
                f"setting `{name}` of {settings_cls.__name__}: chatcore cannot convert "
                f"{annotation!r} (use int, float, bool, str, Literal, Path, dict, a list or "
                "tuple of those, or one of them | None)"
            )


def _convertible(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return all(_convertible(a) for a in args if a is not type(None))
    if origin is typing.Literal or annotation in (bool, int, float, str, Path, dict, Any) or origin is dict:
        return True
    if origin in (tuple, list):
        return not args or all(_convertible(a) for a in args if a is not Ellipsis)
    return False


def settings_fields(settings_cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation."""
    hints = typing.get_type_hints(settings_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(settings_cls) if f.init}


def parse_settings(settings_cls: type[T], values: Mapping[str, Any], owner: str = "") -> T:
    """Build ``settings_cls`` from raw values; unknown keys and bad values raise OptionError."""
    fields = settings_fields(settings_cls)
    where = f" for {owner}" if owner else ""
    unknown = [key for key in values if key.replace("-", "_") not in fields]
    if unknown:
        known = ", ".join(fields) or "none"
        raise OptionError(f"unknown setting{where}: {', '.join(map(repr, unknown))} (known: {known})")
    converted = {}
    for key, raw in values.items():
        name = key.replace("-", "_")
        converted[name] = convert_value(name, fields[name], raw)
    try:
        return settings_cls(**converted)
    except OptionError:
        raise
    except (ValueError, TypeError) as error:
        raise OptionError(f"{error}{where}") from error


class Configurable:
    """A named plugin object with typed ``Settings``: the shared base of decoders and
    steerers. ``from_options`` parses raw ``key=value`` settings; ``describe`` gives the
    name and settings for provenance."""

    kind: ClassVar[str] = "plugin"
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Settings: ClassVar[type] = object

    def __init__(self, settings: Any = None) -> None:
        self.settings = settings if settings is not None else self.Settings()

    @classmethod
    def from_options(cls: type[C], options: Mapping[str, Any] | None = None) -> C:
        return cls(parse_settings(cls.Settings, dict(options or {}), owner=f"{cls.kind} {cls.name!r}"))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "settings": settings_dict(self.settings)}

    @classmethod
    def setting_choices(cls, name: str) -> list[str]:
        """The values setting ``name`` may take when they are a short list, for completion
        (the REPL offers them after ``name=``); empty when any value of its type goes.

        The default reads ``Literal[...]`` and ``bool`` annotations. A plugin whose
        setting is checked against a list only at run time (a topic name) overrides it.
        """
        kind = settings_fields(cls.Settings).get(name)
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            options = [arg for arg in typing.get_args(kind) if arg is not type(None)]
            kind = options[0] if len(options) == 1 else None
        if typing.get_origin(kind) is typing.Literal:
            return [str(value) for value in typing.get_args(kind)]
        if kind is bool:
            return ["true", "false"]
        return []


def parse_key_values(pairs: Iterable[str]) -> dict[str, str]:
    """``["top_k=40", "temperature=0.7"]`` -> ``{"top_k": "40", "temperature": "0.7"}``."""
    result: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise OptionError(f"expected key=value, got {pair!r}")
        result[key.strip()] = value
    return result


def settings_dict(settings: Any) -> dict[str, Any]:
    """A JSON-friendly view of a settings dataclass (for provenance and the log)."""
    out = {}
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        out[field.name] = list(value) if isinstance(value, tuple) else value
    return out
