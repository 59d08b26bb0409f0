"""Tab completion and the bottom toolbar, as plain functions of the chat state.

The names come from the engine's registry and the setting keys from each plugin's
``Settings`` model (with each field's help), so a third-party decoder or steerer completes like a built-in.
The prompt-toolkit wrappers live in ``terminal.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatcore.options import settings_fields, settings_help
from chatcore.text import one_line

if TYPE_CHECKING:
    from chatcore.adapters.repl.state import ChatState


@dataclass(frozen=True)
class Suggestion:
    text: str  # replaces the word before the cursor
    start: int  # where the replaced word starts, counted back from the cursor (<= 0)
    meta: str = ""


def _setting_keys(entry: Any, given: list[str]) -> list[tuple[str, str]]:
    """Each setting not given yet, with its help (the field's docstring) or else its type."""
    try:
        fields = settings_fields(entry.value.Settings)
        help_texts = settings_help(entry.value.Settings)
    except Exception:  # a plugin with odd Settings must not break completion
        return []
    used = {word.split("=", 1)[0].replace("-", "_") for word in given}
    return [
        (f"{name}=", one_line(str(help_texts.get(name) or getattr(kind, "__name__", kind)), 80))
        for name, kind in fields.items()
        if name not in used
    ]


def _setting_values(entry: Any, key: str) -> list[tuple[str, str]]:
    try:
        choices = entry.value.setting_choices(key.replace("-", "_"))
    except Exception:  # a plugin's odd override must not break typing
        return []
    return [(f"{key}={choice}", "") for choice in choices]


def _names(table: dict[str, Any]) -> list[tuple[str, str]]:
    return [(name, getattr(entry.value, "description", "") or "") for name, entry in sorted(table.items())]


def completions(state: "ChatState", text_before_cursor: str) -> list[Suggestion]:
    """What Tab offers for the input so far (nothing unless it is a slash command)."""
    from chatcore.adapters.repl.slash_commands import COMMANDS

    if not text_before_cursor.startswith("/"):
        return []
    words = text_before_cursor.split(" ")
    word, before = words[-1], [w for w in words[:-1] if w]
    options: list[tuple[str, str]] = []
    registry = state.engine.registry
    decoder = registry.decoders.get(state.options.decoder)
    if "=" in word:
        tables = {"/decoder": registry.decoders, "/steer": registry.steerers}
        table = tables.get(before[0]) if len(before) >= 2 else None
        if table is not None and before[1] in table:
            options = _setting_values(table[before[1]], word.split("=", 1)[0])
        elif before[:1] == ["/set"] and decoder is not None:
            options = _setting_values(decoder, word.split("=", 1)[0])
        return [Suggestion(text, -len(word), meta) for text, meta in options if text.startswith(word)]
    if not before:
        options = [(c.name, c.summary) for c in COMMANDS.values()]
    elif before[0] == "/set":  # the current decoder's settings
        options = _setting_keys(decoder, before[1:]) if decoder is not None else []
    elif before[0] == "/decoder":
        if len(before) == 1:
            options = _names(registry.decoders)
        elif before[1] in registry.decoders:
            options = _setting_keys(registry.decoders[before[1]], before[2:])
    elif before[0] == "/steer":
        active = [name for name, _ in state.options.steerers]
        if len(before) == 1:
            options = [("off", "turn steering off")] + _names(registry.steerers)
        elif before[1] == "off":
            options = [(name, "on now") for name in active if name not in before[2:]]
        elif before[1] in registry.steerers:
            options = _setting_keys(registry.steerers[before[1]], before[2:])
    elif before[0] == "/resume" and len(before) == 1 and state.store is not None:
        try:
            summaries = state.store.list_conversations(limit=20)
        except Exception:  # the log failing must not break typing
            summaries = []
        options = [(s.id, s.title or "") for s in summaries]
    elif before[0] == "/format" and len(before) == 1:
        options = [("auto", "the model's chat template if it has one, else dialogpt")]
        options += _names(registry.prompt_formats)
    elif before[0] == "/system" and len(before) == 1:
        options = [("clear", "no system prompt")]
    elif before[0] == "/seed" and len(before) == 1:
        options = [("random", "a new random seed for every reply")]
    return [Suggestion(text, -len(word), meta) for text, meta in options if text.startswith(word)]


def toolbar_text(state: "ChatState") -> str:
    """The bottom toolbar: model, format, decoder, steerers, system prompt, seed, log, multi-line."""
    name = state.engine.loaded.name
    model = Path(name).name if Path(name).exists() else name
    decoder = state.options.decoder
    if state.options.decoder_settings:
        decoder += " " + " ".join(f"{k}={v}" for k, v in state.options.decoder_settings.items())
    steerers = ", ".join(name for name, _ in state.options.steerers) or "none"
    parts = [model, f"format: {state.format_name}", f"decoder: {decoder}", f"steer: {steerers}"]
    if state.current.system:
        parts.append("system prompt")
    if state.next_seed is not None:
        parts.append(f"seed: {state.next_seed}")
    parts.append(f"log: {state.log_status}")
    if state.multiline:
        parts.append("multi-line: Esc-Enter sends")
    return " | ".join(parts)
