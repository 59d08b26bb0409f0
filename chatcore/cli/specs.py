"""Parsing ``NAME key=value ...`` specs for decoders and steerers on command lines."""

from __future__ import annotations

import shlex
from typing import Any

from chatcore.errors import OptionError
from chatcore.options import parse_key_values


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"top-k top_k=20 temperature=0.7"`` -> ``("top-k", {"top_k": "20", ...})``."""
    try:
        parts = shlex.split(spec)
    except ValueError as error:
        raise OptionError(f"cannot parse {spec!r}: {error}") from None
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
