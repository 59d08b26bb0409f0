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
its database is empty. The files nobody holds, the journals of chats that ended and the
writes set aside as refused (``<database>-rejected.jsonl``), are rewritten without what
was deleted at once (:func:`scrub_deletion`), in every folder that holds a journal of the
database: a chat journaling into a folder other than the default notes it in the default
one (``<database>-folders.jsonl``, :func:`note_folder`), where a deletion finds it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from chatcore.log.normalise import Normaliser
from chatcore.log.private_files import fsync_folder, open_private_append, replace_private_file
from chatcore.log.turn_writes import title_from

if TYPE_CHECKING:
    from chatcore.log.store import ConversationStore

try:
    import fcntl
except ImportError:  # Windows: files are not shared between processes, nothing is adopted
    fcntl = None  # type: ignore[assignment]

_DATETIME = "$datetime"
JOURNAL_FOLDER = "log-journal"  # in the user data folder
REJECTED_SUFFIX = "-rejected.jsonl"
DELETED_SUFFIX = "-deleted.jsonl"
FOLDERS_SUFFIX = "-folders.jsonl"
_RECORDS = (REJECTED_SUFFIX, DELETED_SUFFIX, FOLDERS_SUFFIX)  # beside the journal files, never replayed


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


def default_journal_folder() -> Path:
    """``log-journal`` in the user data folder (made 0700 if an older version left it open to others)."""
    from chatcore.log.location import private_data_folder

    return private_data_folder(JOURNAL_FOLDER)


def _lock(stream: IO[Any], wait: bool = False) -> bool:
    if fcntl is None:
        return True
    try:
        fcntl.flock(stream.fileno(), fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def journal_files(folder: Path, url: str) -> list[Path]:
    """The journal files in ``folder`` of the database at ``url`` (any process's), oldest first.

    Named ``<database>-<pid>-<random>.jsonl``: the writes set aside beside them
    (``<database>-rejected.jsonl``, see the log's plugin) are a record, never replayed, as are
    the deletions and the folders noted there."""
    prefixes = {_digest(database_identity(url)), _digest(url)}  # and as older versions named them
    try:
        if not folder.is_dir():
            return []
        found = {
            path
            for prefix in prefixes
            for path in folder.glob(f"{prefix}-*-*.jsonl")
            if not path.name.endswith(_RECORDS)
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


def waiting_writes(folder: Path, url: str) -> Iterator[dict[str, Any]]:
    """The writes waiting in the journal files in ``folder`` of the database at ``url``, any chat's,
    oldest file first (read without taking them)."""
    for path in journal_files(folder, url):
        yield from _journaled(path)


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


def screened(write: dict[str, Any], deletions: Deletions, titles: set[tuple[str, str]]) -> dict[str, Any] | None:
    """``write`` as it may be written (or kept) after ``deletions``: None when it is of what was
    deleted. A deleted author's first message titled its conversation in every write of it: such a
    message is noted in ``titles`` (conversation, title), and the later writes lose that title."""
    conversation_id = write.get("conversation_id", "")
    fields = write.get("fields") or {}
    if deletions.withholds(write):
        if write.get("role") == "user" and isinstance(write.get("text"), str):
            titles.add((conversation_id, title_from(write["text"])))
        return None
    conversation = fields.get("conversation") or {}
    if (conversation_id, conversation.get("title")) in titles:
        return dict(write, fields=dict(fields, conversation=dict(conversation, title=None)))
    return write


def deletions_path(folder: Path, url: str) -> Path:
    return folder / f"{_digest(database_identity(url))}{DELETED_SUFFIX}"


def _deletion_record(conversation_id: str | None, author_id: str | None) -> dict[str, Any]:
    record: dict[str, Any] = {"deleted": datetime.now(timezone.utc)}
    if conversation_id is not None:
        record["conversation_id"] = conversation_id
    if author_id is not None:
        record["author"] = _author_digest(author_id)
    return record


def record_deletion(folder: Path, url: str, *, conversation_id: str | None = None, author_id: str | None = None) -> int:
    """Record that a conversation, or an author's messages, were deleted from the log at ``url``,
    so that no replay of the journal in ``folder`` writes them again; returns how many waiting
    writes that withholds. Records nothing when the database has no journal there.
    OSError when the record cannot be written."""
    files = journal_files(folder, url)
    if not files:
        return 0  # nothing waits, and a later write is made after the deletion
    record = _deletion_record(conversation_id, author_id)
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


def note_folder(folder: Path, url: str) -> None:
    """Note in the default journal folder that ``folder``, another one, holds journal files (or writes
    set aside) of the database at ``url``, so that a deletion finds them (:func:`journal_folders`).
    Never raises: a data folder that cannot be written leaves the folder unnoted."""
    default = default_journal_folder()
    try:
        entry = os.path.realpath(folder)
        if entry == os.path.realpath(default):
            return
        if entry in _noted_folders(default, url):
            return
        append_line(_folders_path(default, url), (json.dumps(entry) + "\n").encode("ascii"))
    except OSError:
        pass


def journal_folders(url: str, given: Path | None = None) -> list[Path]:
    """Every folder that may hold the journal of the database at ``url``: ``given``, the default
    one, and those noted in it by chats that journaled elsewhere (:func:`note_folder`)."""
    default = default_journal_folder()
    noted = [Path(entry) for entry in _noted_folders(default, url)]
    folders: dict[str, Path] = {}
    for folder in [*([given] if given is not None else []), default, *noted]:
        if folder.is_dir():
            folders.setdefault(os.path.realpath(folder), folder)
    return list(folders.values())


def _folders_path(default: Path, url: str) -> Path:
    return default / f"{_digest(database_identity(url))}{FOLDERS_SUFFIX}"


def _noted_folders(default: Path, url: str) -> list[str]:
    """The other folders noted in ``default`` as holding journal files of the database at ``url``."""
    try:
        lines = _folders_path(default, url).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    noted = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash mid-append
        if isinstance(entry, str):
            noted.append(entry)
    return noted


def append_line(path: Path, line: bytes) -> None:
    """Append ``line`` to ``path`` (created 0600) under the file's lock, so that a deletion rewriting
    it meanwhile (:func:`scrub_deletion`) loses nothing; on the disk when this returns. OSError if not."""
    while True:
        descriptor = open_private_append(path)
        try:
            if fcntl is not None:
                fcntl.flock(descriptor, fcntl.LOCK_EX)
            try:
                current = os.stat(path).st_ino == os.fstat(descriptor).st_ino
            except FileNotFoundError:
                current = False  # rewritten, or removed, while this waited for the lock: append anew
            if current:
                written = 0
                while written < len(line):
                    written += os.write(descriptor, line[written:])
                os.fsync(descriptor)
                return
        finally:
            os.close(descriptor)


def scrub_deletion(folder: Path, url: str, *, conversation_id: str | None = None, author_id: str | None = None) -> int:
    """Take what was deleted from the log at ``url`` (a conversation, or an author's messages) out of
    the files in ``folder`` that no running chat holds: the writes set aside as refused, and the
    journal files of chats that ended (a running chat's journal withholds it on replay, see
    :func:`record_deletion`). Returns how many writes set aside as refused went. OSError when a file
    cannot be rewritten."""
    deletions = Deletions([_deletion_record(conversation_id, author_id)])
    titles: set[tuple[str, str]] = set()
    files = journal_files(folder, url)
    for path in files:  # the titles a deleted message gave, those in a running chat's journal too
        for write in _journaled(path):
            screened(write, deletions, titles)

    def refused(entry: dict[str, Any]) -> dict[str, Any] | None:
        write = entry.get("write") or {}
        kept = screened(write, deletions, titles)
        return entry if kept is write else None if kept is None else dict(entry, write=kept)

    removed = 0
    for prefix in sorted({_digest(database_identity(url)), _digest(url)}):  # and as older versions named it
        removed += _rewrite(folder / f"{prefix}{REJECTED_SUFFIX}", refused, wait=True)
    for path in files:
        _rewrite(path, lambda write: screened(write, deletions, titles), wait=False)
    forget_deletions(folder, url)
    return removed


def _rewrite(path: Path, edit: Callable[[dict[str, Any]], dict[str, Any] | None], wait: bool) -> int:
    """Rewrite ``path`` with each line as ``edit`` gives it back (None: left out; the same object:
    kept as it was), under the file's lock: whole (a new file renamed over it, or the file removed
    when nothing is left), or not at all. Returns how many lines were left out. A file held by
    another process is left (``wait`` False: a running chat's journal), and so are lines that do
    not parse (cut short by a crash: they were never acknowledged)."""
    while True:
        try:
            stream = open(path, "rb")
        except FileNotFoundError:
            return 0
        with stream:
            if not _lock(stream, wait):
                return 0
            try:
                if os.stat(path).st_ino != os.fstat(stream.fileno()).st_ino:
                    continue  # rewritten meanwhile: read the new one
            except FileNotFoundError:
                return 0
            lines = stream.read().splitlines(keepends=True)
            edited = [_edited(line, edit) for line in lines]
            kept = [line for line in edited if line is not None]
            if kept != lines:
                _replace(path, kept)
            return len(lines) - len(kept)


def _edited(line: bytes, edit: Callable[[dict[str, Any]], dict[str, Any] | None]) -> bytes | None:
    try:
        entry = json.loads(line, object_hook=_decode)
    except ValueError:
        return line
    if not isinstance(entry, dict):
        return line
    changed = edit(entry)
    if changed is entry:
        return line
    if changed is None:
        return None
    return (json.dumps(changed, default=_encode, ensure_ascii=True) + "\n").encode("ascii")


def _replace(path: Path, lines: list[bytes]) -> None:
    """``path`` now holds ``lines`` (0600, on the disk), or is gone when there are none."""
    if not lines:
        path.unlink()
        fsync_folder(path.parent)
        return
    replace_private_file(path, b"".join(line if line.endswith(b"\n") else line + b"\n" for line in lines))


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
    from chatcore.log.plugin import ConversationLogPlugin

    if folder is None:
        folder = default_journal_folder()
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
            note_folder(self.folder, self.url)
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
