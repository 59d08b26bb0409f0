"""Typed, validated settings for decoders and steerers, as pydantic models.

Every decoder and steerer declares its settings as a subclass of :class:`Settings` (a
pydantic model): field types, ranges (``Annotated[int, Field(ge=1)]``) and per-field help
(the docstring under a field) in one place, and a JSON schema for completion and the HTTP
API. ``parse_settings`` turns ``key=value`` strings (from the CLI, the REPL or Discord)
into that model; unknown keys and bad values become one-line
:class:`~chatcore.errors.OptionError` messages naming the field and the value.

The text a user types is read as follows (on top of pydantic's own conversion):
``a,b,c`` is a list, ``none`` or an empty value unsets an optional setting, a JSON
object fills a ``dict``, ``~`` in a ``Path`` is the home folder, and ``true`` / ``false``
(``yes``/``no``, ``on``/``off``, ``1``/``0``) are booleans. A boolean is not a number.

A plain stdlib dataclass is still accepted as ``Settings`` (pydantic validates its
fields, then its ``__post_init__`` runs), so plugins written against the earlier
interface keep working.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Self, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, model_validator
from pydantic.fields import FieldInfo

from chatcore.errors import OptionError
from chatcore.text import shown_value

T = TypeVar("T")
C = TypeVar("C", bound="Configurable")

__all__ = [
    "ON_THIS_MACHINE",
    "Configurable",
    "OnThisMachine",
    "Settings",
    "check_settings_class",
    "machine_settings",
    "parse_key_values",
    "parse_settings",
    "settings_dict",
    "settings_fields",
    "settings_help",
    "settings_rows",
    "settings_schema",
]


@dataclasses.dataclass(frozen=True)
class OnThisMachine:
    """A setting's marker: its value names something on the machine chatcore runs on (a
    file, a folder, a model to load or download), as in
    ``file: Annotated[str | None, ON_THIS_MACHINE] = None``.

    Entry points whose users are elsewhere (the HTTP server, the Discord bot) let a
    request set such a setting only to one of :meth:`Configurable.setting_choices` (the
    bundled names) or to its default, unless the operator allowed more; otherwise anyone
    who can send a request could make the server read its files (a word file's words show
    in the replies' scores) or load any model. Mark every setting of a plugin that opens
    a path or loads a model.
    """

    what: str = "file or model"


ON_THIS_MACHINE = OnThisMachine()


def machine_settings(settings_cls: type) -> dict[str, tuple[OnThisMachine, Any]]:
    """The settings of ``settings_cls`` marked :class:`OnThisMachine`, by name: each
    marker with the setting's default."""
    if settings_cls is object:
        return {}
    marked = {}
    for name, info in _field_infos(settings_cls).items():
        marker = next((item for item in info.metadata if isinstance(item, OnThisMachine)), None)
        if marker is not None:
            marked[name] = (marker, info.get_default(call_default_factory=True))
    return marked


class Settings(BaseModel):
    """The base of decoder and steerer settings.

    Unknown fields are refused, numbers must be finite, assignments are validated, and
    the docstring under a field is its help text. Building one with bad values raises
    :class:`~chatcore.errors.OptionError` (a ``ValueError``) in one line.
    """

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        validate_assignment=True,
        use_attribute_docstrings=True,
        arbitrary_types_allowed=False,
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as error:
            raise OptionError(describe_error(error, type(self))) from None

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` applied and checked (as ``dataclasses.replace`` does for a dataclass)."""
        return type(self)(**{**{name: getattr(self, name) for name in type(self).model_fields}, **changes})

    @model_validator(mode="before")
    @classmethod
    def _read_typed_text(cls, values: Any) -> Any:
        if isinstance(values, Mapping):
            return prepare_values(settings_fields(cls), values)
        return values


# -- reading typed text ---------------------------------------------------------------


def _strip_annotated(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _optional_parts(annotation: Any) -> tuple[Any, bool]:
    """(the annotation without ``None``, whether ``None`` is allowed)."""
    annotation = _strip_annotated(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        rest = [_strip_annotated(a) for a in args if a is not type(None)]
        allows_none = len(rest) < len(args)
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), allows_none  # noqa: UP007
    return annotation, annotation is type(None)


def prepare_value(name: str, annotation: Any, raw: Any) -> Any:
    """``raw`` with the text conventions above applied for a field of type ``annotation``;
    pydantic converts and checks the result."""
    kind, allows_none = _optional_parts(annotation)
    if allows_none and (raw is None or (isinstance(raw, str) and raw.strip().lower() in ("none", ""))):
        return None
    origin = typing.get_origin(kind)
    if origin in (list, tuple) or kind in (list, tuple):
        if isinstance(raw, str):
            return [item.strip() for item in raw.split(",") if item.strip()]
        if not isinstance(raw, (list, tuple)):
            raise OptionError(f"`{name}` must be a list (comma-separated), got {shown_value(raw)}")
        return raw
    if (kind in (int, float)) and isinstance(raw, bool):
        what = "an integer" if kind is int else "a number"
        raise OptionError(f"`{name}` must be {what}, got {shown_value(raw)}")
    if kind is dict or origin is dict:
        value = raw
        if isinstance(raw, str):
            try:
                value = json.loads(raw)
            except ValueError:
                value = None
        if not isinstance(value, dict):
            raise OptionError(f'`{name}` must be a JSON object such as {{"a": 1}}, got {shown_value(raw)}')
        return value
    if kind is Path and not isinstance(raw, Path):
        if not isinstance(raw, str) or not raw.strip() or "\x00" in raw:
            raise OptionError(f"`{name}` must be a file path, got {shown_value(raw)}")
        return Path(raw).expanduser()
    return raw


def prepare_values(fields: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    return {key: prepare_value(key, fields[key], raw) if key in fields else raw for key, raw in values.items()}


# -- one-line messages from pydantic's errors -----------------------------------------------

_TYPE_PHRASES = {
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_parsing": "a number",
    "float_type": "a number",
    "finite_number": "a finite number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "text",
    "list_type": "a list (comma-separated)",
    "tuple_type": "a list (comma-separated)",
    "dict_type": 'a JSON object such as {"a": 1}',
    "path_type": "a file path",
}
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else str(value)


def _bound(schema: Mapping[str, Any], side: str) -> tuple[Any, bool]:
    """(the ``Minimum`` or ``Maximum`` bound of a JSON schema, or None; whether it is exclusive)."""
    if f"exclusive{side}" in schema:
        return schema[f"exclusive{side}"], True
    return schema.get(side.lower()), False


def range_phrase(schema: Mapping[str, Any], integer: bool) -> str:
    """How a field's bounds (its JSON schema's minimum / maximum, exclusive or not) read in
    an error: "a positive integer", "in (0, 1]" ..."""
    low, low_open = _bound(schema, "Minimum")
    high, high_open = _bound(schema, "Maximum")
    if integer:
        if low is not None and low_open:
            low, low_open = low + 1, False
        if high is not None and high_open:
            high, high_open = high - 1, False
        if high is None:
            if low == 1:
                return "a positive integer"
            if low == 0:
                return "a non-negative integer"
            return f"an integer of at least {low}"
        if low is None:
            return f"an integer of at most {high}"
        return f"an integer from {low} to {high}"
    if high is None and low is not None:
        if low == 0:
            return "a positive number" if low_open else "a non-negative number"
        return f"a number {'above' if low_open else 'of at least'} {_number(low)}"
    if low is None and high is not None:
        return f"a number {'below' if high_open else 'of at most'} {_number(high)}"
    if low is None or high is None:
        return "in range"
    if not low_open and not high_open:
        return f"between {_number(low)} and {_number(high)}"
    return f"in {'(' if low_open else '['}{_number(low)}, {_number(high)}{')' if high_open else ']'}"


def _field_infos(settings_cls: type) -> dict[str, FieldInfo]:
    if isinstance(settings_cls, type) and issubclass(settings_cls, BaseModel):
        return dict(settings_cls.model_fields)
    hints = typing.get_type_hints(settings_cls, include_extras=True)
    infos = {}
    for field in dataclasses.fields(typing.cast(Any, settings_cls)):
        if field.init:
            default = field.default if field.default is not dataclasses.MISSING else ...
            infos[field.name] = FieldInfo.from_annotated_attribute(hints[field.name], default)
    return infos


def _field_schema(settings_cls: type, name: str, entry: bool) -> dict[str, Any]:
    """The JSON schema of setting ``name`` (of one of its entries if ``entry``), its ``None``
    option left out: where an error message reads the field's type, bounds and choices."""
    field = settings_schema(settings_cls).get("properties", {}).get(name, {})
    merged: dict[str, Any] = {}
    for option in field.get("anyOf") or [field]:
        if entry and option.get("type") == "array":
            option = option.get("items") or {}
        if option.get("type") != "null":
            merged.update(option)
    return merged


def describe_error(error: ValidationError, settings_cls: type) -> str:
    """The first of pydantic's errors as one line: "`top_k` must be a positive integer, got 0"."""
    first = error.errors(include_url=False)[0]
    kind, loc, raw = first["type"], first["loc"], first.get("input")
    if kind in ("value_error", "assertion_error"):
        cause = (first.get("ctx") or {}).get("error")
        text = str(cause) if cause is not None else first["msg"]
        # A check on one field's value may leave the field's name to the message.
        return text if not loc or text.startswith("`") else f"`{loc[0]}` {text}"
    name = str(loc[0]) if loc else ""
    where = f"`{name}`" + (" entries" if len(loc) > 1 else "")
    if kind == "extra_forbidden":
        return f"unknown setting {name!r}"
    if kind in _TYPE_PHRASES:
        return f"{where} must be {_TYPE_PHRASES[kind]}, got {shown_value(raw)}"
    if kind == "string_too_short":
        least = (first.get("ctx") or {}).get("min_length", 1)
        if least == 1:
            return f"{where} must not be empty, got {shown_value(raw)}"
        return f"{where} must have {least} characters or more, got {shown_value(raw)}"
    schema = _field_schema(settings_cls, name, entry=len(loc) > 1)
    if kind == "literal_error" and "enum" in schema:
        choices = ", ".join(str(choice) for choice in schema["enum"])
        return f"{where} must be one of {choices}, got {shown_value(raw)}"
    if kind in _RANGE_ERRORS:
        integer = schema.get("type") == "integer"
        shown = raw
        if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
            try:
                shown = int(raw) if integer else float(raw)
            except ValueError:
                pass
        return f"{where} must be {range_phrase(schema, integer)}, got {shown_value(shown)}"
    message = first["msg"].replace("Input should be", "must be").replace("Value should", "must")
    return f"{where} {message[0].lower() + message[1:]}, got {shown_value(raw)}"


# -- the settings interface used by the rest of chatcore -------------------------------------


@functools.lru_cache(maxsize=256)
def _adapter(settings_cls: type) -> TypeAdapter[Any]:
    return TypeAdapter(settings_cls)


def check_settings_class(settings_cls: type) -> None:
    """Refuse (TypeError), when its plugin registers, a Settings class pydantic cannot
    validate or describe: neither a pydantic model nor a dataclass, or a field of a type
    that has no schema."""
    if settings_cls is object:  # no settings
        return
    if not (
        (isinstance(settings_cls, type) and issubclass(settings_cls, BaseModel))
        or dataclasses.is_dataclass(settings_cls)
    ):
        raise TypeError(f"Settings must be a chatcore.options.Settings model (or a dataclass), got {settings_cls!r}")
    try:
        infos = _field_infos(settings_cls)
    except NameError as error:
        raise TypeError(f"Settings {settings_cls.__name__}: a setting's type cannot be resolved ({error})") from None
    for name, info in infos.items():
        try:
            TypeAdapter(typing.cast(Any, info.annotation)).json_schema()
        except Exception:  # pydantic's schema errors have several types
            raise TypeError(
                f"setting `{name}` of {settings_cls.__name__}: chatcore cannot convert {info.annotation!r} "
                "(use a type pydantic validates: int, float, bool, str, Literal, Path, dict, a list or tuple of "
                "those, or one of them | None)"
            ) from None
    try:
        _adapter(settings_cls).json_schema()
    except Exception as error:
        raise TypeError(f"Settings {settings_cls.__name__}: {str(error).splitlines()[0]}") from None


def settings_fields(settings_cls: type) -> dict[str, Any]:
    """Field name -> type annotation (without ``Annotated`` metadata)."""
    if settings_cls is object:
        return {}
    return {name: info.annotation for name, info in _field_infos(settings_cls).items()}


def settings_help(settings_cls: type) -> dict[str, str]:
    """Field name -> its help text (the field's description; empty when it has none)."""
    if settings_cls is object:
        return {}
    return {name: info.description or "" for name, info in _field_infos(settings_cls).items()}


def settings_schema(settings_cls: type) -> dict[str, Any]:
    """The JSON schema of a Settings class (types, defaults, ranges, choices, help)."""
    if settings_cls is object:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return _adapter(settings_cls).json_schema()


def settings_rows(settings_cls: type) -> list[dict[str, str]]:
    """Each setting as text, read from the JSON schema: name, type, default, allowed values
    (a range, or "one of ..." choices; for a list, its entries') and help; for
    ``chatcore plugins NAME``."""
    schema = settings_schema(settings_cls)
    rows = []
    for name, field in schema.get("properties", {}).items():
        kinds, allowed = [], []
        for option in field.get("anyOf") or [field]:
            kind = option.get("type", "any")
            if kind == "array":
                option = option.get("items") or {}
                kind = f"list of {option.get('type', 'any')}"
            kinds.append("none" if kind == "null" else kind)
            if "enum" in option:
                allowed.append("one of " + ", ".join(str(value) for value in option["enum"]))
            (low, low_open), (high, high_open) = _bound(option, "Minimum"), _bound(option, "Maximum")
            bounds = [f"{'>' if low_open else '>='} {_number(low)}"] if low is not None else []
            bounds += [f"{'<' if high_open else '<='} {_number(high)}"] if high is not None else []
            if bounds:
                allowed.append(" and ".join(bounds))
        default = field.get("default", "(required)")
        rows.append(
            {
                "name": name,
                "type": " or ".join(dict.fromkeys(kinds)),
                "default": "none" if default is None else json.dumps(default),
                "allowed": "; ".join(allowed),
                "help": " ".join(str(field.get("description", "")).split()),
            }
        )
    return rows


def parse_settings(settings_cls: type[T], values: Mapping[str, Any], owner: str = "") -> T:
    """Build ``settings_cls`` from raw values; unknown keys and bad values raise OptionError."""
    fields = settings_fields(settings_cls)
    where = f" for {owner}" if owner else ""
    prefix = f"{owner}: " if owner else ""
    unknown = [key for key in values if key.replace("-", "_") not in fields]
    if unknown:
        known = ", ".join(fields) or "none"
        raise OptionError(f"unknown setting{where}: {', '.join(map(repr, unknown))} (known: {known})")
    named = {key.replace("-", "_"): raw for key, raw in values.items()}
    if settings_cls is object:
        return settings_cls()
    try:
        adapter = _adapter(typing.cast(type, settings_cls))
        if not issubclass(typing.cast(type, settings_cls), Settings):  # a Settings model reads the text itself
            named = prepare_values(fields, named)
        return typing.cast(T, adapter.validate_python(named))
    except ValidationError as error:
        raise OptionError(f"{prefix}{describe_error(error, settings_cls)}") from None
    except OptionError as error:
        raise OptionError(f"{prefix}{error}") from None
    except (ValueError, TypeError) as error:
        raise OptionError(f"{prefix}{error}") from error


def settings_dict(settings: Any) -> dict[str, Any]:
    """A JSON-friendly view of a settings object (for provenance and the log)."""
    if isinstance(settings, BaseModel):
        return settings.model_dump(mode="json")
    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        return typing.cast(dict[str, Any], _adapter(type(settings)).dump_python(settings, mode="json"))
    return {}


class Configurable:
    """A named plugin object with typed ``Settings``: the shared base of decoders and
    steerers. ``from_options`` parses raw ``key=value`` settings; ``describe`` gives the
    name and settings for provenance."""

    kind: ClassVar[str] = "plugin"
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Settings: ClassVar[type] = object

    # What :meth:`setup` returned for this class's model and settings (None without a setup).
    shared: Any = None

    def __init__(self, settings: Any = None) -> None:
        self.settings = settings if settings is not None else self.Settings()

    @classmethod
    def setup(cls, model: Any, settings: Any) -> object:
        """Work done once per model and settings, reused by every reply: a steering vector,
        a word list's token ids, an expert or reverse model. The engine calls it (with the
        ``LoadedModel``) the first time a reply uses these settings and hands the result to
        each new instance as ``self.shared`` before ``prepare`` (results are kept for the
        32 newest settings per engine; none is kept anywhere else). It must not change the
        model. Default: nothing."""
        return None

    @classmethod
    def from_options(cls: type[C], options: Mapping[str, Any] | None = None) -> C:
        return cls(parse_settings(cls.Settings, dict(options or {}), owner=f"{cls.kind} {cls.name!r}"))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "settings": settings_dict(self.settings)}

    @classmethod
    def setting_choices(cls, name: str) -> list[str]:
        """The values setting ``name`` may take when they are a short list, for completion
        (the REPL offers them after ``name=``); empty when any value of its type goes.

        The default reads the field's JSON schema (an ``enum`` from ``Literal[...]``, or a
        boolean). A plugin whose setting is checked against a list only at run time (a
        topic name) overrides it.
        """
        schema = settings_schema(cls.Settings).get("properties", {}).get(name) or {}
        options = schema.get("anyOf") or [schema]
        choices = [value for option in options for value in option.get("enum", [])]
        if choices:
            return [str(value) for value in choices]
        if any(option.get("type") == "boolean" for option in options):
            return ["true", "false"]
        return []


def parse_key_values(pairs: Iterable[str]) -> dict[str, str]:
    """``["top_k=40", "temperature=0.7"]`` -> ``{"top_k": "40", "temperature": "0.7"}``."""
    result: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise OptionError(f"expected key=value, got {shown_value(pair)}")
        key = key.strip()
        earlier = next((given for given in result if given.replace("-", "_") == key.replace("-", "_")), None)
        if earlier is not None:
            first, second = shown_value(result[earlier]), shown_value(value)
            raise OptionError(f"`{key}` is given twice ({first} and {second}): give it once")
        result[key] = value
    return result
