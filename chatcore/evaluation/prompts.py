"""Prompt sets for ``chatcore eval``: chat openers, held-out chitchat contexts, files.

A context is a list of turns, oldest first, ending with the turn to reply to. Sets
that come from a corpus also carry the human reply, for reference numbers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatcore.errors import CorpusError, PluginError
from chatcore.text import shown_argument

OPENERS_FILE = Path(__file__).with_name("openers.txt")


@dataclass
class EvalContext:
    turns: list[str]
    reference: str | None = None


def openers() -> list[EvalContext]:
    lines = OPENERS_FILE.read_text(encoding="utf-8").splitlines()
    return [EvalContext([line.strip()]) for line in lines if line.strip() and not line.startswith("#")]


def chitchat_heldout(max_turns: int = 6) -> list[EvalContext]:
    """One context per held-out chitchat dialogue: up to ``max_turns`` turns ending
    before a human reply chosen by a hash of the dialogue id (stable across runs)."""
    from chatcore.training.corpus import load_chitchat, split_heldout

    _, heldout = split_heldout(load_chitchat())
    contexts = []
    for dialogue in heldout:
        digest = int(hashlib.sha256(dialogue.id.encode()).hexdigest()[:8], 16)
        reply_index = 1 + digest % (len(dialogue.turns) - 1)
        start = max(0, reply_index - max_turns)
        contexts.append(EvalContext(list(dialogue.turns[start:reply_index]), dialogue.turns[reply_index]))
    return contexts


def load_prompt_file(path: str | Path) -> list[EvalContext]:
    """A ``.jsonl`` file ({"turns": [...], "reference": "..."} per line) or a text
    file with one opener per line."""
    from chatcore.training.corpus import data_lines, json_line

    path = Path(path)
    contexts = []
    for number, line in data_lines(path, "prompt file"):
        if path.suffix == ".jsonl":
            record = json_line(path, number, line)
            if isinstance(record, list):
                record = {"turns": record}
            turns = record.get("turns") if isinstance(record, dict) else None
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise CorpusError(f'{path}:{number}: expected {{"turns": ["...", ...]}} with at least one turn')
            reference = record.get("reference")
            if reference is not None and not is_text(reference):
                raise CorpusError(
                    f'{path}:{number}: "reference" must be the human reply\'s text (a non-empty string) '
                    f"or left out, got {shown_argument(reference)}"
                )
            for index, turn in enumerate(turns, start=1):
                checked_turn(path, number, turn, f"turn {index}" if len(turns) > 1 else "the turn")
            contexts.append(EvalContext(turns, reference))
        else:
            checked_turn(path, number, line, "the line")
            contexts.append(EvalContext([line.strip()]))
    if not contexts:
        raise CorpusError(f"{path}: no prompts")
    return contexts


def checked_turn(path: Path, number: int, turn: str, which: str) -> None:
    """A turn of a prompt file checked as a message is when it is sent (its length, text that
    is left once control characters go), so that its line is named before the model loads."""
    from chatcore.errors import ChatcoreError
    from chatcore.text import clean_message

    try:
        clean_message(turn)
    except ChatcoreError as error:
        raise CorpusError(f"{path}:{number}: {which}: {error}") from None


def is_text(value: Any) -> bool:
    """Whether ``value`` is a string with something besides whitespace in it."""
    return isinstance(value, str) and bool(value.strip())


def check_prompt_set(name: str, plugin: str, loader: Any) -> list[EvalContext]:
    """The contexts of the prompt set ``name``, which ``plugin`` registered with ``loader``; a
    loader that raises, or returns anything but a non-empty list of contexts (turns: a list
    of strings, at least one; reference: a non-empty string or None), is a PluginError."""
    try:
        contexts = loader()
    except Exception as error:
        raise PluginError(plugin, f"prompt set {name!r} failed to load: {type(error).__name__}: {error}") from error
    if not isinstance(contexts, list):
        raise PluginError(
            plugin, f"prompt set {name!r}: expected a list of EvalContext, got {shown_argument(contexts)}"
        )
    if not contexts:
        raise PluginError(plugin, f"prompt set {name!r} holds no contexts")
    for index, context in enumerate(contexts):
        if not (
            isinstance(context, EvalContext)
            and isinstance(context.turns, list)
            and context.turns
            and all(isinstance(turn, str) for turn in context.turns)
            and (context.reference is None or is_text(context.reference))
        ):
            raise PluginError(
                plugin,
                f"prompt set {name!r}: item {index} is not an EvalContext with at least one turn (strings) "
                f"and a text or no reference, got {shown_argument(context)}",
            )
    return contexts
