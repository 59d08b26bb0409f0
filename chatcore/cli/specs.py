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
