"""Prompt sets for ``chatcore eval``: chat openers, held-out chitchat contexts, files.

A context is a list of turns, oldest first, ending with the turn to reply to. Sets
that come from a corpus also carry the human reply, for reference numbers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from chatcore.errors import CorpusError

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
            contexts.append(EvalContext(turns, record.get("reference")))
        else:
            contexts.append(EvalContext([line.strip()]))
    if not contexts:
        raise CorpusError(f"{path}: no prompts")
    return contexts
