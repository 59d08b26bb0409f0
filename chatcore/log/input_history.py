"""The REPL's input history file: its entries as prompt-toolkit keeps them, appended under a lock,
and the messages ``chatcore logs delete`` deleted taken out of it.

The file (``repl_history`` in the user data folder, or the chat's ``--history-file``) is
prompt-toolkit's ``FileHistory``, created 0600: each entry is an empty line, a comment with its
time (``# 2024-05-01 12:00:00.123456``), then each of its lines after a ``+``.

Deleting a conversation the REPL logged takes out the entries that sent one of its messages
(:func:`scrub_history`): the file is rewritten whole (a new file, 0600, renamed over it) under
its ``flock``, the other entries kept byte for byte. The REPL appends each entry under the same
lock (:func:`append_entry`, through the journal's :func:`~chatcore.log.journal.append_line`)
and appends anew to a file rewritten while it waited, so neither loses the other's lines, as
with the journal's files. A chat running meanwhile keeps the entries it loaded in memory (Up
still offers them) until it ends; it never writes them back.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from chatcore.log.journal import append_line, journal_folders, waiting_writes
from chatcore.log.private_files import replace_private_file

if TYPE_CHECKING:
    from chatcore.log.records import ConversationRecord
    from chatcore.log.store import ConversationStore

try:
    import fcntl
except ImportError:  # Windows: files are not locked; the chat and a deletion rarely write at once
    fcntl = None  # type: ignore[assignment]

REPL_ADAPTER = "repl"
"""The adapter name the REPL logs its conversations under (``ADAPTER`` in ``adapters/repl/state.py``)."""


def entry_bytes(text: str, moment: datetime.datetime | None = None) -> bytes:
    """One entry as prompt-toolkit's ``FileHistory`` writes it (``moment``: its time, by default now)."""
    stamp = moment if moment is not None else datetime.datetime.now()
    lines = [f"\n# {stamp}\n", *(f"+{line}\n" for line in text.split("\n"))]
    return "".join(lines).encode("utf-8", errors="replace")


def append_entry(path: Path, text: str) -> None:
    """Append the entry ``text`` to the history file at ``path`` (created 0600) under its lock; it is on
    the disk when this returns. OSError if it cannot be."""
    append_line(path, entry_bytes(text))


def split_entries(data: bytes) -> list[tuple[bytes, str | None]]:
    """A history file's entries, in order: the bytes of each (the comment lines before it included)
    and its text as prompt-toolkit reads it back; None for lines that hold no entry."""
    pieces = data.split(b"\n")
    lines = [piece + b"\n" for piece in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])
    entries: list[tuple[bytes, str | None]] = []
    held: list[bytes] = []
    text: list[str] = []
    for line in lines:
        if text and not line.startswith(b"+"):  # the first line that is not the entry's ends it
            entries.append((b"".join(held), "".join(text)[:-1]))
            held, text = [], []
        held.append(line)
        if line.startswith(b"+"):
            text.append(line[1:].decode("utf-8", errors="replace"))
    if held:
        entries.append((b"".join(held), "".join(text)[:-1] if text else None))
    return entries


def typed_message(entry: str) -> str | None:
    """The message an entry sent, read as the REPL reads a line (``handle_line``): none for an empty
    line or a command (``/...``); ``//`` sends a line that starts with ``/``; cleaned as every
    message is."""
    from chatcore.errors import ChatcoreError
    from chatcore.text import clean_message

    stripped = entry.strip()
    if not stripped or (stripped.startswith("/") and not stripped.startswith("//")):
        return None
    try:
        return clean_message(stripped[1:] if stripped.startswith("//") else entry)
    except ChatcoreError:
        return None


def _lock(stream: IO[Any]) -> None:
    if fcntl is not None:
        fcntl.flock(stream.fileno(), fcntl.LOCK_EX)


def scrub_history(path: Path, messages: Iterable[str]) -> int:
    """Take the entries that sent one of ``messages`` out of the history file at ``path`` (one behind a
    symbolic link: its target), under the file's lock, the other entries kept as they were; returns
    how many went. A missing file has none. OSError if the file cannot be read or rewritten (it is
    then as it was)."""
    wanted = set(messages)
    if not wanted:
        return 0
    target = Path(os.path.realpath(path))
    while True:
        try:
            stream = open(target, "rb")
        except FileNotFoundError:
            return 0
        with stream:
            _lock(stream)
            try:
                current = os.stat(target).st_ino == os.fstat(stream.fileno()).st_ino
            except FileNotFoundError:
                current = False
            if not current:
                continue  # rewritten, or removed, while this waited for the lock: read it anew
            entries = split_entries(stream.read())
            kept = [data for data, text in entries if text is None or typed_message(text) not in wanted]
            if len(kept) < len(entries):
                replace_private_file(target, b"".join(kept))
            return len(entries) - len(kept)


def typed_messages(store: "ConversationStore", record: "ConversationRecord") -> set[str]:
    """What was typed in the REPL of the conversation ``record``, about to be deleted: its user messages
    when the REPL logged it, those still waiting in the journal included."""
    if record.adapter != REPL_ADAPTER:
        return set()
    texts = {message.text for message in record.messages if message.role == "user"}
    for folder in journal_folders(store.url, store.journal_dir):
        for write in waiting_writes(folder, store.url):
            text = write.get("text")
            if write.get("conversation_id") == record.id and write.get("role") == "user" and isinstance(text, str):
                texts.add(text)
    return texts
