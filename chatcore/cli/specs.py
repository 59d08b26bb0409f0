"""Parsing ``NAME key=value ...`` specs for decoders and steerers on command lines."""

from __future__ import annotations

import shlex
from typing import Any

from chatcore.errors import OptionError
from chatcore.options import parse_key_values


def split_settings(text: str) -> list[str]:
    """``text`` split into words as a shell would (quotes group and are removed), except that a
    value written as JSON, ``key={"28": -100}`` or ``key=[1, 2]``, stays one word as typed
    (its quotes and spaces kept): the form an error message shows is the form that works."""
    values: list[str] = []
    rest = ""
    index = 0
    while index < len(text):
        opened = text.find("=", index)
        start = opened + 1
        while 0 <= opened and start < len(text) and text[start] == " ":
            start += 1
        if opened < 0:
            rest += text[index:]
            break
        if start >= len(text) or text[start] not in "{[":
            rest += text[index:start]
            index = start
            continue
        end = _closing(text, start)
        if end is None:  # unbalanced: the shell's rules (and their error) apply
            rest += text[index:]
            break
        values.append(text[start:end])
        rest += text[index:opened] + f"={_PLACEHOLDER}{len(values) - 1}{_PLACEHOLDER}"
        index = end
    try:
        words = shlex.split(rest)
    except ValueError as error:
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise OptionError(f"cannot parse {shown!r}: {error}") from None
    return [_restore(word, values) for word in words]


_PLACEHOLDER = "\x00"


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


def _restore(word: str, values: list[str]) -> str:
    parts = word.split(_PLACEHOLDER)
    return "".join(values[int(part)] if odd else part for odd, part in ((i % 2 == 1, p) for i, p in enumerate(parts)))


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
