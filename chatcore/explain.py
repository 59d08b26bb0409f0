"""How a reply was made, in words: the "why" the REPL's ``/why`` and Discord's ``/chat why`` show.

Both read a reply's provenance (see :mod:`chatcore.engine`): its decoder and settings,
seed, steerers and their details, the reranked candidates, the prompt's size and the
timings. The REPL lists every candidate; Discord, with little room, sums them up.
"""

from __future__ import annotations

import json
from typing import Any

from chatcore.text import one_line


def format_settings(settings: dict[str, Any]) -> str:
    """``key=value`` pairs, leaving out unset values (None, empty text, lists or mappings); a
    mapping as compact JSON, the form ``/set`` and ``--decoder`` take back."""
    parts = []
    for key, value in settings.items():
        if value is None or value == "" or value == [] or value == () or value == {}:
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(item) for item in value)
        elif isinstance(value, dict):
            value = json.dumps(value, separators=(",", ":"), default=str)
        parts.append(f"{key}={value}")
    return " ".join(parts)


def format_scores(scores: dict[str, Any]) -> str:
    return "  ".join(
        f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}" for key, value in scores.items()
    )


def explain(provenance: dict[str, Any], every_candidate: bool = True) -> list[str]:
    """The lines that explain one reply. ``every_candidate``: list each reranked candidate
    with its scores (else one line: how many, and the chosen one's scores)."""
    decoder = provenance.get("decoder") or {}
    lines = [
        f"decoder {decoder.get('name', '?')} {format_settings(decoder.get('settings') or {})}".rstrip()
        + f", seed {provenance.get('seed')}"
    ]
    candidates = provenance.get("candidates") or []
    if candidates and every_candidate:
        lines.append(f"{len(candidates)} candidates (* = chosen):")
        for index, candidate in enumerate(candidates, 1):
            mark = "*" if candidate.get("chosen") else " "
            scores = format_scores(candidate.get("scores") or {})
            lines.append(f" {mark}{index:>2}  {scores}  {one_line(candidate.get('text', ''), 70)!r}")
    elif candidates:
        chosen = next((c for c in candidates if c.get("chosen")), None)
        scores = json.dumps(chosen.get("scores", {})) if chosen else "?"
        lines.append(f"{len(candidates)} candidates; the chosen one scored {scores}")
    steerers = provenance.get("steerers") or []
    for steerer in steerers:
        lines.append(f"steerer {steerer.get('name')}: {format_settings(steerer.get('settings') or {})}")
    details = provenance.get("details") or {}
    for key, value in details.items():
        lines.append(f"{key}: {one_line(str(value), 200)}")
    if "prompt_tokens" in provenance:
        lines.append(
            f"context: {provenance.get('prompt_tokens')} prompt tokens ({provenance.get('model', '?')}), "
            f"{provenance.get('history_turns_used', '?')} turn(s) used, "
            f"{provenance.get('history_turns_dropped', 0)} older turn(s) left out"
        )
    timings = provenance.get("timings") or {}
    new_tokens = timings.get("new_tokens")
    if timings:
        first = timings.get("first_token_s")
        lines.append(
            f"{new_tokens} {'token' if new_tokens == 1 else 'tokens'} in {timings.get('total_s')} s"
            + (f" (first token after {first} s)" if first is not None else "")
        )
    if provenance.get("finish_reason") == "length" and not provenance.get("interrupted"):
        lines.append(
            f"cut by its budget: the reply used all of its max_new_tokens ({provenance.get('max_new_tokens')}) "
            "and may end mid-sentence"
        )
    if provenance.get("error"):
        lines.append(f"cut short by an error: {one_line(str(provenance['error']), 200)}")
    elif provenance.get("interrupted"):
        lines.append(
            "interrupted before the decoder had chosen anything (no candidates were ranked)"
            if not new_tokens and not candidates
            else "interrupted: the reply was cut short"
        )
    elif not candidates and not steerers and not details:
        lines.append("no candidates or steering: the decoder chose every token itself")
    return lines
