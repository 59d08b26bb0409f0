"""One click option from one field of a pydantic settings model (see
:func:`chatcore.cli.options.options_from_model`)."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any

import annotated_types
import click
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


def _plain_type(annotation: Any) -> tuple[Any, bool]:
    """(the annotation without ``Annotated`` and ``None``, whether ``None`` is allowed)."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _plain_type(rest[0])[0], len(rest) < len(args)
    return annotation, False


def _constraints(info: FieldInfo) -> list[Any]:
    """The field's constraints: its own, and those inside an optional ``Annotated`` type
    (``Annotated[int, Field(ge=1)] | None`` keeps them there)."""
    found: list[Any] = list(info.metadata)
    pending = [info.annotation]
    while pending:
        annotation = pending.pop()
        if typing.get_origin(annotation) is typing.Annotated:
            inner, *extra = typing.get_args(annotation)
            for item in extra:
                found.extend(item.metadata if isinstance(item, FieldInfo) else [item])
            pending.append(inner)
        elif typing.get_origin(annotation) in (typing.Union, types.UnionType):
            pending.extend(typing.get_args(annotation))
    return found


def _bounds(info: FieldInfo) -> dict[str, Any]:
    """The field's numeric bounds as click range arguments."""
    bounds: dict[str, Any] = {}
    for item in _constraints(info):
        if isinstance(item, annotated_types.Ge):
            bounds["min"] = item.ge
        elif isinstance(item, annotated_types.Gt):
            bounds.update(min=item.gt, min_open=True)
        elif isinstance(item, annotated_types.Le):
            bounds["max"] = item.le
        elif isinstance(item, annotated_types.Lt):
            bounds.update(max=item.lt, max_open=True)
    return bounds


def _click_type(annotation: Any, info: FieldInfo) -> click.ParamType | type:
    kind, _ = _plain_type(annotation)
    if typing.get_origin(kind) is typing.Literal:
        return click.Choice([str(value) for value in typing.get_args(kind)])
    bounds = _bounds(info)
    if kind is int:
        if bounds.get("min_open"):  # an integer above n is one at least n + 1
            bounds.update(min=bounds["min"] + 1, min_open=False)
        if bounds.get("max_open"):
            bounds.update(max=bounds["max"] - 1, max_open=False)
        return click.IntRange(**bounds) if bounds else int
    if kind is float:
        return click.FloatRange(**bounds) if bounds else float
    if kind in (str, bool):
        return kind
    raise TypeError(f"no command-line option for a field of type {kind!r}")


def field_option(
    model: type[Any], name: str, flags: str | tuple[str, ...] | None, help_text: str | None
) -> Callable[[Any], Any]:
    """The click option for ``model``'s field ``name`` (see ``options_from_model``)."""
    info: FieldInfo = model.model_fields[name]
    declared = (flags,) if isinstance(flags, str) else flags or ("--" + name.replace("_", "-"),)
    text = help_text if help_text is not None else " ".join((info.description or "").split())
    required = info.default is PydanticUndefined and info.default_factory is None
    default = None if required else info.get_default(call_default_factory=True)
    kind, _ = _plain_type(info.annotation)
    if kind is bool:
        long_flag = next(flag for flag in declared if flag.startswith("--"))
        return click.option(
            f"{long_flag}/--no-{long_flag[2:]}", name, default=default, show_default=True, help=text or None
        )
    return click.option(
        *declared,
        name,
        type=_click_type(info.annotation, info),
        default=default,
        required=required,
        show_default=default is not None,
        help=text or None,
    )
