"""The spill journal: writes the database could not take, kept in a local file until it can.

A write the database cannot take at once is appended here, one JSON line, and is on
the disk (the file fsynced, and its folder when the file is new) before the call
returns: a process killed a moment later loses nothing it acknowledged. The writes
are replayed in order once the database works again, by this process or, for a file
whose process has ended, by the next one logging to the same database.

Appends go straight to the file descriptor: a write that fails (a full disk) is cut
back off the file, so no half line is left, and nothing stays buffered for a later
close to fail on. The file and its folder are private (0600, 0700).

Each file is named after its database (a digest of :func:`database_identity`, so any
spelling of the same database's URL finds it) and its process, and is
held with an exclusive ``flock`` while its process lives; a file nobody holds is an
orphan and is adopted. Replaying twice is harmless: every write carries a key that
the store recognises (``messages.write_key``).

The orphans are replayed when a chat, a bot or the server opens the log
(:func:`replay_left_writes`), before it reads anything: a conversation resumed then holds
the turns an ended chat could only journal, and goes on as one conversation.

A deletion (``chatcore logs delete``) cannot take the writes out of a file that a running
chat holds and appends to, so it is recorded beside them instead
(``<database>-deleted.jsonl``, :func:`record_deletion`): every replay, by any process,
drops the waiting writes it covers, those of a deleted conversation or of a deleted
author made before the deletion, so what was deleted never comes back. It records the
conversation's id and a digest of the author's id, and is removed once the journal of
its database is empty.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from chatcore.log.normalise import Normaliser
from chatcore.log.private_files import open_private_append

if TYPE_CHECKING:
    from chatcore.log.store import ConversationStore

try:
    import fcntl
except ImportError:  # Windows: files are not shared between processes, nothing is adopted
    fcntl = None  # type: ignore[assignment]

_DATETIME = "$datetime"
REJECTED_SUFFIX = "-rejected.jsonl"
DELETED_SUFFIX = "-deleted.jsonl"


def _encode(value: Any) -> Any:
    if isinstance(value, datetime):
        return {_DATETIME: value.isoformat()}
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _decode(value: dict[str, Any]) -> Any:
    return datetime.fromisoformat(value[_DATETIME]) if set(value) == {_DATETIME} else value


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def database_identity(url: str) -> str:
    """The database a URL reaches, however it is spelled: an SQLite file by its real path
    (relative, through a symbolic link, with or without ``?synchronous=``); a server by
    backend, user, host, port and database, the driver and the connection options left out.
    The journal is named after it, so any spelling of the same log replays it."""
    import sqlalchemy as sa

    try:
        parsed = sa.engine.make_url(url)
    except sa.exc.ArgumentError:
        return url
    backend = parsed.get_backend_name()
    database = parsed.database or ""
    if backend == "sqlite":
        if database and database != ":memory:" and not database.startswith("file:"):
            return f"sqlite:{os.path.realpath(os.path.expanduser(database))}"
        return url
    query = {key: value if isinstance(value, str) else value[-1] for key, value in parsed.query.items()}
    host = (parsed.host or query.get("host") or "").lower()
    port = parsed.port or query.get("port") or ""
    return f"{backend}://{parsed.username or ''}@{host}:{port}/{database}"


def _lock(stream: IO[str]) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(stream.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def journal_files(folder: Path, url: str) -> list[Path]:
    """The journal files in ``folder`` of the database at ``url`` (any process's), oldest first.

    Named ``<database>-<pid>-<random>.jsonl``: the writes set aside beside them
    (``<database>-rejected.jsonl``, see the log's plugin) are a record, never replayed."""
    prefixes = {_digest(database_identity(url)), _digest(url)}  # and as older versions named them
    try:
        if not folder.is_dir():
            return []
        found = {
            path
            for prefix in prefixes
            for path in folder.glob(f"{prefix}-*-*.jsonl")
            if not path.name.endswith(REJECTED_SUFFIX)
        }
    except OSError:  # a folder this user may not read (another user's data folder): nothing to adopt
        return []
    return sorted(found, key=_modified)


def _journaled(path: Path) -> Iterator[dict[str, Any]]:
    """The writes in a journal file, read without taking it (its chat may be running)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return
    for line in text.splitlines():
        try:
            yield json.loads(line, object_hook=_decode)
        except ValueError:
            continue  # a line cut short by a crash mid-append


def _utc(moment: Any) -> datetime | None:
    if not isinstance(moment, datetime):
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def _author_digest(author_id: str) -> str:
    """The author as a deletion records it: a digest of the id as the log stores it."""
    return hashlib.sha256((Normaliser().author_id(author_id) or "").encode("utf-8", "surrogatepass")).hexdigest()


class Deletions:
    """The deletions recorded for one database's journal: which waiting writes a replay drops."""

    def __init__(self, records: Iterable[dict[str, Any]] = ()) -> None:
        self.conversations: dict[str, datetime] = {}
        self.authors: dict[str, datetime] = {}
        for record in records:
            deleted = _utc(record.get("deleted"))
            if deleted is None:
                continue
            if isinstance(record.get("conversation_id"), str):
                self.conversations[record["conversation_id"]] = deleted
            if isinstance(record.get("author"), str):
                self.authors[record["author"]] = deleted

    def __bool__(self) -> bool:
        return bool(self.conversations or self.authors)

    def withholds(self, write: dict[str, Any]) -> bool:
        """Whether ``write`` is of what was deleted: a message of a deleted conversation or of a
        deleted author, made before the deletion (one without a time counts as made before)."""
        fields = write.get("fields") or {}
        made = _utc(fields.get("created"))
        deleted = self.conversations.get(write.get("conversation_id", ""))
        if deleted is not None and (made is None or made <= deleted):
            return True
        author = fields.get("author_id")
        deleted = self.authors.get(_author_digest(author)) if isinstance(author, str) else None
        return deleted is not None and (made is None or made <= deleted)

    @classmethod
    def read(cls, folder: Path, url: str) -> "Deletions":
        """The deletions recorded for the database at ``url`` (none when there is no record)."""
        return cls(_journaled(deletions_path(folder, url)))


def deletions_path(folder: Path, url: str) -> Path:
    return folder / f"{_digest(database_identity(url))}{DELETED_SUFFIX}"


def record_deletion(folder: Path, url: str, *, conversation_id: str | None = None, author_id: str | None = None) -> int:
    """Record that a conversation, or an author's messages, were deleted from the log at ``url``,
    so that no replay of the journal in ``folder`` writes them again; returns how many waiting
    writes that withholds. Records nothing when the database has no journal there.
    OSError when the record cannot be written."""
    files = journal_files(folder, url)
    if not files:
        return 0  # nothing waits, and a later write is made after the deletion
    record: dict[str, Any] = {"deleted": datetime.now(timezone.utc)}
    if conversation_id is not None:
        record["conversation_id"] = conversation_id
    if author_id is not None:
        record["author"] = _author_digest(author_id)
    path = deletions_path(folder, url)
    line = (json.dumps(record, default=_encode) + "\n").encode("ascii")
    while True:
        descriptor = open_private_append(path)
        try:
            os.write(descriptor, line)
            os.fsync(descriptor)
            kept = os.fstat(descriptor).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            kept = False  # removed by a replay that had just emptied the journal: record it anew
        finally:
            os.close(descriptor)
        if kept:
            break
    this_one = Deletions([record])
    return sum(this_one.withholds(write) for file in files for write in _journaled(file))


def forget_deletions(folder: Path, url: str) -> None:
    """Remove the deletions recorded for the database at ``url`` once no journal file of it is
    left: every write they withheld is gone, and later writes are made after them."""
    if not journal_files(folder, url):
        try:
            deletions_path(folder, url).unlink(missing_ok=True)
        except OSError:
            pass  # a read-only folder: kept, and still honoured


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # gone meanwhile (adopted and replayed by another process)
        return 0.0


# What the log's plugin says about the database itself: the plugin of the chat that opened the
# store says it again about its own writes, so a replay at opening leaves it to that one.
_SAID_BY_THE_CHAT = ("conversation log unavailable", "conversation log available again")


def replay_left_writes(store: "ConversationStore", folder: Path | None = None) -> None:
    """Write into ``store`` the journaled writes of processes that ended before the database took
    them (``folder``: the journal's, by default ``log-journal`` in the user data folder).

    Called when a chat, a bot or the server opens the log, before it reads a conversation: a
    ``--continue`` then resumes the conversation with the turns an ended chat could only journal,
    rather than without them (its next write would then find them, written since it read, and
    go on in a new conversation). Replayed as the log's plugin replays them (in order, each once,
    one refused for its content set aside); what the database cannot take now stays for the
    chat's own plugin. What the replay finds (a conversation deleted or written by another chat
    meanwhile, a write set aside) is logged as a warning."""
    from chatcore.log.plugin import JOURNAL_FOLDER, ConversationLogPlugin

    if folder is None:
        from chatcore.log.location import user_data_path

        folder = user_data_path() / JOURNAL_FOLDER
    if not journal_files(folder, store.url) or store.quick_check() is not None:
        return  # nothing left, or a damaged file, which is never written into
    told: list[str] = []
    ConversationLogPlugin(store, notify=told.append, journal_dir=folder).close()
    logger = logging.getLogger("chatcore.conversation_log")
    for message in told:
        if message != store.repaired and not message.startswith(_SAID_BY_THE_CHAT):
            logger.warning("%s", message)


class SpillJournal:
    """Append and replay the waiting writes of one process for one database."""

    def __init__(self, folder: Path, url: str) -> None:
        self.folder = folder
        self.url = url
        self.prefix = _digest(database_identity(url))
        self.path = folder / f"{self.prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        self._own: IO[str] | None = None
        self._adopted: list[tuple[Path, IO[str]]] = []
        self.count = 0  # entries in our own file
        self.adopt_orphans()

    def adopt_orphans(self) -> None:
        """Take over the files of ended processes that logged to the same database."""
        held = {path for path, _ in self._adopted} | {self.path}
        for path in journal_files(self.folder, self.url):
            if path in held:
                continue
            try:
                stream = open(path, "r+", encoding="utf-8")
            except OSError:
                continue
            if _lock(stream) and path.exists():
                self._adopted.append((path, stream))
            else:
                stream.close()

    def append(self, record: dict[str, Any]) -> None:
        """Add one write at the end; it is on the disk when this returns (OSError if it cannot be,
        and then the file is as it was)."""
        line = (json.dumps(record, default=_encode, ensure_ascii=True) + "\n").encode("ascii")
        if self._own is None:
            descriptor = open_private_append(self.path)
            self._own = os.fdopen(descriptor, "r", encoding="utf-8")  # held for its lock, read on replay
            _lock(self._own)
        descriptor = self._own.fileno()
        size = os.fstat(descriptor).st_size
        try:
            written = 0
            while written < len(line):
                written += os.write(descriptor, line[written:])
            os.fsync(descriptor)
        except OSError:
            try:
                os.ftruncate(descriptor, size)  # never a half line for the next append to follow
            except OSError:
                pass  # replay skips a line that does not parse
            raise
        self.count += 1

    def __len__(self) -> int:
        return self.count + len(self._adopted)

    def entries(self) -> Iterator[tuple[Path, dict[str, Any]]]:
        """Every waiting write, adopted files first (they are older), each file in order."""
        streams = list(self._adopted)
        if self._own is not None and self.count:
            streams.append((self.path, self._own))
        for path, stream in streams:
            stream.seek(0)
            for line in stream.read().splitlines():
                if line.strip():
                    try:
                        yield path, json.loads(line, object_hook=_decode)
                    except ValueError:
                        continue  # a line cut short by a crash mid-append: it was never acknowledged

    def done(self, path: Path) -> None:
        """Every write of ``path`` is in the database: remove the file."""
        if path == self.path and self._own is not None:
            path.unlink(missing_ok=True)
            self._own.close()
            self._own, self.count = None, 0
            return
        for index, (adopted, stream) in enumerate(self._adopted):
            if adopted == path:
                path.unlink(missing_ok=True)
                stream.close()
                del self._adopted[index]
                return

    def close(self) -> None:
        """Release the files (they stay on the disk for the next process); never raises."""
        streams = [stream for _, stream in self._adopted] + ([self._own] if self._own is not None else [])
        self._adopted, self._own = [], None
        for stream in streams:
            try:
                stream.close()
            except OSError:
                pass  # nothing is buffered: every append went to the file descriptor
