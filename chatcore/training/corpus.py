"""Dialogue corpora: the built-in chitchat loader, the JSONL format, and the held-out split.

A corpus is a list of :class:`Dialogue`: an id and its turns, oldest first, each turn the
text of one speaker's message(s). The JSONL format, one dialogue per line::

    {"id": "optional-stable-id", "turns": ["hi there", "hello! how are you?", "fine"],
     "community": "optional channel, subreddit or file name"}

A line may also be a bare JSON list of turns. Blank lines are skipped. ``community``
groups dialogues for the filtering rule that drops whole communities.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatcore.errors import CorpusError

BUILTIN_CORPORA = ("chitchat",)


@dataclass(frozen=True)
class Dialogue:
    id: str
    turns: tuple[str, ...]
    community: str | None = None


def _clean_turn(text: str) -> str:
    # Collapse internal whitespace: turns are separated by EOS, never by newlines.
    return " ".join(text.split())


def load_chitchat() -> list[Dialogue]:
    """The chitchat-dataset package's 7,168 conversations.

    Consecutive messages by the same sender form one turn, joined by a space.
    """
    try:
        import chitchat_dataset
    except ImportError as error:  # pragma: no cover - it is a dependency
        raise CorpusError("the chitchat corpus needs the 'chitchat-dataset' package") from error
    path = Path(chitchat_dataset.__file__).with_name("dataset.json")
    with path.open(encoding="utf-8") as handle:
        raw = json.load(handle)
    dialogues = []
    for key, conversation in raw.items():
        turns = []
        for messages in conversation["messages"]:
            text = _clean_turn(" ".join(message["text"] for message in messages))
            if text:
                turns.append(text)
        if len(turns) >= 2:
            dialogues.append(Dialogue(id=f"chitchat:{key}", turns=tuple(turns)))
    return dialogues


def data_lines(path: str | Path, what: str) -> list[tuple[int, str]]:
    """The (line number, line) pairs of a UTF-8 data file, blank lines and lines starting
    with ``#`` (after any indentation) left out; a missing or non-UTF-8 file is a
    CorpusError naming ``what``."""
    path = Path(path)
    if path.is_dir():
        raise CorpusError(f"{what} {str(path)!r} is a folder, not a file")
    if not path.is_file():
        raise CorpusError(f"no such {what} {str(path)!r}")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # a leading byte-order mark is no text
    except UnicodeDecodeError:
        raise CorpusError(f"{what} {str(path)!r} is not UTF-8 text") from None
    return [
        (number, line)
        for number, line in enumerate(lines, start=1)
        if line.strip() and not line.lstrip().startswith("#")
    ]


def json_line(path: str | Path, number: int, line: str) -> Any:
    """One JSONL record; invalid JSON is a CorpusError pointing at the line."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise CorpusError(
            f"{path}:{number}: not valid JSON ({error.msg.removesuffix(' at')} at column {error.colno})"
        ) from None


def load_jsonl(path: str | Path) -> list[Dialogue]:
    """Read dialogues from a JSONL file (see the module docstring for the format)."""
    path = Path(path)
    if path.is_dir():
        raise CorpusError(f"{path} is a folder, not a corpus file")
    if not path.exists():
        raise CorpusError(f"corpus file not found: {path}")
    dialogues = []
    with path.open(encoding="utf-8-sig", errors="strict") as handle:
        try:
            lines = list(handle)
        except UnicodeDecodeError as error:
            raise CorpusError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from error
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise CorpusError(
                f"{path}:{number}: not valid JSON ({error.msg.removesuffix(' at')} at column {error.colno})"
            ) from error
        if isinstance(record, list):
            record = {"turns": record}
        if not isinstance(record, dict) or not isinstance(record.get("turns"), list):
            raise CorpusError(f'{path}:{number}: expected {{"turns": [...]}} or a list of turns')
        turns = record["turns"]
        if not all(isinstance(turn, str) for turn in turns):
            raise CorpusError(f"{path}:{number}: every turn must be a string")
        cleaned = tuple(text for text in (_clean_turn(turn) for turn in turns) if text)
        if len(cleaned) < 2:
            continue  # a monologue teaches no reply
        dialogue_id = str(record.get("id") or hashlib.sha1("\n".join(cleaned).encode()).hexdigest()[:16])
        community = record.get("community")
        if community is not None and not isinstance(community, str):
            raise CorpusError(f"{path}:{number}: `community` must be a string")
        dialogues.append(Dialogue(id=dialogue_id, turns=cleaned, community=community or None))
    if not dialogues:
        raise CorpusError(f"{path}: no dialogue with at least two turns")
    return dialogues


def load_corpus(name_or_path: str) -> list[Dialogue]:
    """Load a built-in corpus by name or a JSONL file by path."""
    if name_or_path == "chitchat":
        return load_chitchat()
    if name_or_path in BUILTIN_CORPORA:  # pragma: no cover - one built-in today
        raise CorpusError(f"no loader for {name_or_path!r}")
    path = Path(name_or_path)
    if path.suffix not in (".jsonl", ".json") and not path.exists():
        raise CorpusError(
            f"unknown corpus {name_or_path!r}: give a built-in name ({', '.join(BUILTIN_CORPORA)}) "
            "or the path of a JSONL file"
        )
    return load_jsonl(path)


def is_heldout(dialogue_id: str, fraction: float) -> bool:
    """Whether a dialogue belongs to the held-out split.

    Decided by a hash of the id alone, so the forward model, the reverse model and
    ``chatcore eval`` agree on the split whatever the corpus order.
    """
    digest = hashlib.sha256(dialogue_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_heldout(dialogues: list[Dialogue], fraction: float = 0.05) -> tuple[list[Dialogue], list[Dialogue]]:
    """Split by dialogue (never inside one) into (train, held-out)."""
    if not 0.0 <= fraction < 1.0:
        raise CorpusError(f"held-out fraction must be in [0, 1), got {fraction}")
    train = [d for d in dialogues if not is_heldout(d.id, fraction)]
    heldout = [d for d in dialogues if is_heldout(d.id, fraction)]
    return train, heldout
