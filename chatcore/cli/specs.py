"""Parsing ``NAME key=value ...`` specs for decoders and steerers on command lines."""

from __future__ import annotations

import shlex
from typing import Any

from chatcore.errors import OptionError
from chatcore.options import parse_key_values
from chatcore.text import shown_value


def split_settings(text: str) -> list[str]:
    """``text`` split into words as a shell would (quotes group and are removed), except that a
    value written as JSON, ``key={"28": -100}`` or ``key=[1, 2]``, stays one word as typed
    (its quotes and spaces kept): the form an error message shows is the form that works."""
    if _HELD in text:
        raise OptionError(f"cannot parse {shown_value(text)}: it holds a NUL character")
    values: list[str] = []  # each JSON value, held out of the shell's split behind a placeholder
    rest, index = "", 0
    while (equals := text.find("=", index)) >= 0:
        start = equals + 1
        while start < len(text) and text[start] == " ":
            start += 1
        end = _closing(text, start) if text[start : start + 1] in ("{", "[") else None
        if end is None:  # no JSON value here (or an unbalanced one: the shell's rules then apply)
            rest, index = rest + text[index:start], start
            continue
        values.append(text[start:end])
        rest, index = rest + f"{text[index:equals]}={_HELD}{len(values) - 1}{_HELD}", end
    try:
        words = shlex.split(rest + text[index:])
    except ValueError as error:
        raise OptionError(f"cannot parse {shown_value(text)}: {error}") from None
    return ["".join(values[int(p)] if i % 2 else p for i, p in enumerate(word.split(_HELD))) for word in words]


_HELD = "\x00"  # the placeholder's mark: a text holding one is refused


def _closing(text: str, start: int) -> int | None:
    """The index after the bracket that closes the one at ``start`` (JSON strings skipped), or None."""
    depth, in_string, escaped = 0, False, False
    for position in range(start, len(text)):
        char = text[position]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return position + 1
    return None


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"top-k top_k=20 temperature=0.7"`` -> ``("top-k", {"top_k": "20", ...})``; a JSON value
    stays whole (:func:`split_settings`)."""
    parts = split_settings(spec)
    if not parts:
        raise OptionError("empty decoder or steerer spec")
    name, *pairs = parts
    if "=" in name:
        raise OptionError(f"a spec starts with a name, got {name!r}")
    return name, parse_key_values(pairs)


def with_steerer(
    steerers: list[tuple[str, dict[str, Any]]], name: str, settings: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """The steerer list after ``/steer NAME ...``: a steerer named again gets the new settings
    and keeps its place in the composition order; a new one comes last."""
    if any(existing == name for existing, _ in steerers):
        return [(existing, dict(settings) if existing == name else old) for existing, old in steerers]
    return [*steerers, (name, dict(settings))]
