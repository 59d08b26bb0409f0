"""Thread trees and flat chat logs as training dialogues, the DialoGPT way.

Three JSONL corpus formats are read; the first record of a file decides which:

dialogues (``"turns"``), one dialogue per line (see :mod:`chatcore.training.corpus`)::

    {"id": "d1", "turns": ["hi", "hello, how are you?"], "community": "general"}

thread trees (``"parent_id"``), one message per line, as in a Reddit dump. Every
record carries ``parent_id``: ``null`` for a thread's first message. Every root-to-leaf
path of a tree becomes one dialogue, so a message with three replies starts three
dialogues::

    {"id": "t1", "parent_id": null, "text": "what should I cook tonight?", "community": "cooking"}
    {"id": "t2", "parent_id": "t1", "text": "pasta, always pasta"}
    {"id": "t3", "parent_id": "t1", "text": "something with beans"}

A message whose parent is not in the file (deleted, or outside the dump) starts its
own tree, and so does the reply to a message with empty text. A path's community is
the first one given along it, from the root down.

flat chat logs (``"text"`` without ``parent_id``), one message per line in the order
they were sent::

    {"channel": "general", "author": "ann", "text": "anyone up?", "time": 1700000000}
    {"channel": "general", "author": "bo", "text": "me", "time": "2023-11-14T22:14:00Z"}

Messages are grouped by ``channel`` (default: the file name); consecutive messages by
the same ``author`` form one turn; a conversation ends when ``time`` jumps by more than
``gap_seconds`` (when times are given) and is cut every ``max_turns`` turns. The
community is ``community`` if given, else the channel.

Dialogue ids name their thread before the first "/": a tree path is
``<root id>/<leaf id>``, a filtered piece ``<id>/<n>``. The held-out split keeps each
thread whole (:func:`split_heldout_by_thread`): the paths of one tree share their first
turns, and one path in training with its sibling held out would leak those turns.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from chatcore.errors import CorpusError
from chatcore.training.corpus import Dialogue, is_heldout, load_corpus

FORMATS = ("dialogues", "tree", "log")


def _clean(text: str) -> str:
    # Turns are joined with EOS, never newlines, so internal whitespace collapses.
    return " ".join(text.split())


def _safe_id(value: Any) -> str:
    # "/" separates a thread's name from the rest of a dialogue id.
    return str(value).replace("/", "_")


# -- thread trees -------------------------------------------------------------------


@dataclass(frozen=True)
class TreeMessage:
    id: str
    parent_id: str | None
    text: str
    community: str | None = None


def tree_paths(messages: Iterable[TreeMessage], min_turns: int = 2) -> list[Dialogue]:
    """Every root-to-leaf path of the message trees, as dialogues (roots in input order)."""
    by_id: dict[str, TreeMessage] = {}
    for message in messages:
        if message.id in by_id:
            raise CorpusError(f"message id {message.id!r} appears twice")
        by_id[message.id] = message
    children: dict[str, list[str]] = defaultdict(list)
    roots: list[str] = []
    for message in by_id.values():
        text = _clean(message.text)
        parent = by_id.get(message.parent_id) if message.parent_id is not None else None
        if not text:
            continue  # an empty (deleted) message ends the paths through it
        if parent is None or not _clean(parent.text):
            roots.append(message.id)
        else:
            children[parent.id].append(message.id)
    dialogues: list[Dialogue] = []
    for root in roots:
        # Depth-first with an explicit stack: Reddit threads can be deeper than Python's recursion limit.
        stack: list[tuple[str, tuple[str, ...], str | None]] = [(root, (), None)]
        while stack:
            message_id, path, community = stack.pop()
            message = by_id[message_id]
            path = path + (_clean(message.text),)
            community = community or message.community
            replies = children.get(message_id)
            if replies:
                stack.extend((reply, path, community) for reply in reversed(replies))
            elif len(path) >= min_turns:
                dialogue_id = f"{_safe_id(root)}/{_safe_id(message_id)}"
                dialogues.append(Dialogue(id=dialogue_id, turns=path, community=community))
    return dialogues


# -- flat chat logs -------------------------------------------------------------------


@dataclass(frozen=True)
class LogMessage:
    channel: str
    text: str
    author: str | None = None
    time: float | None = None
    community: str | None = None


def parse_time(value: Any) -> float | None:
    """Seconds since the epoch from a number or an ISO-8601 string; None when absent."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise ValueError(f"`time` must be seconds or an ISO-8601 string, got {value!r}")


def log_dialogues(
    messages: Iterable[LogMessage], gap_seconds: float = 3600.0, max_turns: int = 100, min_turns: int = 2
) -> list[Dialogue]:
    """Group a flat log into conversations: by channel, split at silences and every
    ``max_turns`` turns; consecutive messages by one author are one turn."""
    if max_turns < min_turns:
        raise ValueError(f"`max_turns` must be at least {min_turns}, got {max_turns}")
    by_channel: dict[str, list[LogMessage]] = defaultdict(list)
    for message in messages:
        by_channel[message.channel].append(message)
    dialogues: list[Dialogue] = []
    for channel, channel_messages in by_channel.items():
        conversations: list[list[tuple[str | None, str]]] = []
        community = next((m.community for m in channel_messages if m.community), None) or channel
        last_time: float | None = None
        current: list[tuple[str | None, str]] = []
        for message in channel_messages:
            text = _clean(message.text)
            if not text:
                continue
            silent = message.time is not None and last_time is not None and message.time - last_time > gap_seconds
            last_time = message.time if message.time is not None else last_time
            if silent and current:
                conversations.append(current)
                current = []
            same_author = current and message.author is not None and current[-1][0] == message.author
            if same_author:
                current[-1] = (message.author, f"{current[-1][1]} {text}")
            else:
                if len(current) == max_turns:
                    conversations.append(current)
                    current = []
                current.append((message.author, text))
        if current:
            conversations.append(current)
        for number, conversation in enumerate(conversations, start=1):
            if len(conversation) >= min_turns:
                turns = tuple(text for _, text in conversation)
                dialogues.append(Dialogue(id=f"{_safe_id(channel)}@{number}", turns=turns, community=community))
    return dialogues


# -- files ---------------------------------------------------------------------------


def _records(path: Path) -> Iterable[tuple[int, Any]]:
    try:
        handle = path.open(encoding="utf-8-sig", errors="strict")  # a leading byte-order mark is no text
    except OSError as error:
        raise CorpusError(f"cannot read {path}: {error}") from None
    with handle:
        try:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as error:
                    raise CorpusError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        except UnicodeDecodeError as error:
            raise CorpusError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None


def detect_format(path: str | Path) -> str:
    """ "dialogues", "tree" or "log", from the first record of a JSONL file."""
    path = Path(path)
    if path.is_dir():
        raise CorpusError(f"{path} is a folder, not a corpus file")
    if not path.is_file():
        raise CorpusError(f"corpus file not found: {path}")
    for number, record in _records(path):
        if isinstance(record, list) or (isinstance(record, dict) and "turns" in record):
            return "dialogues"
        if isinstance(record, dict) and "parent_id" in record:
            return "tree"
        if isinstance(record, dict) and "text" in record:
            return "log"
        raise CorpusError(
            f'{path}:{number}: unrecognized record: expected "turns" (dialogues), '
            '"parent_id" (a thread tree) or "text" (a chat log)'
        )
    raise CorpusError(f"{path}: the file has no records")


def _string(record: dict[str, Any], key: str, where: str, required: bool = False) -> str | None:
    value = record.get(key)
    if value is None:
        if required:
            raise CorpusError(f'{where}: missing "{key}"')
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise CorpusError(f'{where}: "{key}" must be a string, got {value!r}')
    return str(value)


def load_tree_jsonl(path: str | Path) -> list[Dialogue]:
    path = Path(path)
    messages = []
    for number, record in _records(path):
        where = f"{path}:{number}"
        if not isinstance(record, dict):
            raise CorpusError(f"{where}: expected a message object")
        if "parent_id" not in record:
            raise CorpusError(f'{where}: a thread-tree record needs "parent_id" (null for a first message)')
        messages.append(
            TreeMessage(
                id=_string(record, "id", where, required=True) or "",
                parent_id=_string(record, "parent_id", where),
                text=_string(record, "text", where, required=True) or "",
                community=_string(record, "community", where),
            )
        )
    try:
        dialogues = tree_paths(messages)
    except CorpusError as error:
        raise CorpusError(f"{path}: {error}") from None
    if not dialogues:
        raise CorpusError(f"{path}: no thread with a reply")
    return dialogues


def load_chat_log_jsonl(path: str | Path, gap_seconds: float = 3600.0, max_turns: int = 100) -> list[Dialogue]:
    path = Path(path)
    messages = []
    for number, record in _records(path):
        where = f"{path}:{number}"
        if not isinstance(record, dict):
            raise CorpusError(f"{where}: expected a message object")
        try:
            time = parse_time(record.get("time"))
        except ValueError as error:
            raise CorpusError(f"{where}: {error}") from None
        messages.append(
            LogMessage(
                channel=_string(record, "channel", where) or path.stem,
                text=_string(record, "text", where, required=True) or "",
                author=_string(record, "author", where),
                time=time,
                community=_string(record, "community", where),
            )
        )
    dialogues = log_dialogues(messages, gap_seconds=gap_seconds, max_turns=max_turns)
    if not dialogues:
        raise CorpusError(f"{path}: no conversation with at least two turns")
    return dialogues


def load_dialogues(name_or_path: str) -> list[Dialogue]:
    """Any supported corpus: a built-in name, or a dialogue, thread-tree or chat-log JSONL file."""
    path = Path(name_or_path)
    if not path.is_file():
        return load_corpus(name_or_path)  # built-in names, and its error for missing files
    kind = detect_format(path)
    if kind == "tree":
        return load_tree_jsonl(path)
    if kind == "log":
        return load_chat_log_jsonl(path)
    return load_corpus(name_or_path)


# -- the held-out split ----------------------------------------------------------------


def thread_key(dialogue_id: str) -> str:
    """The thread a dialogue belongs to: its id up to the first "/"."""
    return dialogue_id.split("/", 1)[0]


def split_heldout_by_thread(
    dialogues: Sequence[Dialogue], fraction: float = 0.05
) -> tuple[list[Dialogue], list[Dialogue]]:
    """Like :func:`chatcore.training.corpus.split_heldout`, deciding by thread, so all
    dialogues of one thread land on the same side. Ids without "/" (the chitchat corpus)
    split exactly as there."""
    if not 0.0 <= fraction < 1.0:
        raise CorpusError(f"held-out fraction must be in [0, 1), got {fraction}")
    train: list[Dialogue] = []
    heldout: list[Dialogue] = []
    for dialogue in dialogues:
        (heldout if is_heldout(thread_key(dialogue.id), fraction) else train).append(dialogue)
    return train, heldout
