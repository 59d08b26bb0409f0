"""ConversationStore: open a log by URL, write turns, and list, search, export, delete.

Every write is its own transaction, committed before the call returns, so a process
that is killed loses at most the turn it was writing. SQLite files run in WAL mode
(readers never block the writer; ``chatcore logs`` can read while a chat writes).
Any SQLAlchemy URL works; PostgreSQL suits several bot processes sharing one log.

Schema: created and upgraded by Alembic revisions in one locked transaction, so many
processes may open a new log at once (see :mod:`~chatcore.log.schema`).
A log from a newer chatcore is refused with a clear message rather than damaged.

Faults: a failure that may pass (locked, read-only, full disk, a dropped server
connection) raises :class:`LogUnavailableError` and drops the pooled connections, so
the next try opens the file or server afresh (a file opened read-only stays so for
the life of its connection). Values a database cannot hold are replaced where they
enter (:func:`storable`), so no message is refused for its content.

Search uses an SQLite FTS5 trigram index where SQLite has one (substring matches,
case-insensitive, three characters or more), on PostgreSQL ``ILIKE`` served by a
pg_trgm GIN index, and ``LIKE`` otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from chatcore.log.check import StoreCheck
from chatcore.log.errors import LogError, LogUnavailableError, UnknownConversationError
from chatcore.log.journal import (
    Deletions,
    journal_folders,
    record_deletion,
    replay_left_writes,
    scrub_deletion,
    waiting_writes,
)
from chatcore.log.writing import NUL_SYMBOL, REPLACEMENT, StoreWriting, storable

__all__ = [
    "NUL_SYMBOL",
    "REPLACEMENT",
    "ConversationStore",
    "LogError",
    "LogUnavailableError",
    "UnknownConversationError",
    "storable",
]


class ConversationStore(StoreWriting, StoreCheck):
    """The conversation log's database, opened by SQLAlchemy URL.

    ``create=False`` (the read-only ``logs`` commands): a missing SQLite file is an
    error instead of a new empty log, so a mistyped path creates nothing.

    Failures raise :class:`LogError` with a one-line message naming the database;
    :class:`LogUnavailableError` when trying again later may succeed.

    The work is split by job: opening, schema and errors
    (:mod:`~chatcore.log.connection`), writing
    (:mod:`~chatcore.log.writing`), reading, search and resuming
    (:mod:`~chatcore.log.reading`), damage
    (:mod:`~chatcore.log.check`; salvage: :mod:`~chatcore.log.salvage`).

    An SQLite file opened for writing (``create=True``: a chat, a bot, the server) is
    checked first (:meth:`check_on_open`): damaged indexes are rebuilt (:attr:`repaired`
    says so), damaged rows are noted in :attr:`damage` and never written into. With
    ``defer_check=True`` the check waits for the caller (:attr:`check_deferred`).

    A store opened for writing then writes what processes that ended could only journal
    (:func:`~chatcore.log.journal.replay_left_writes`; ``journal_dir``: the journal's folder,
    by default ``log-journal`` in the user data folder), so that what is read next (a
    conversation resumed) holds it. With ``defer_check`` the log's plugin does it once the
    check passes.

    A deletion is recorded beside that journal too (:func:`~chatcore.log.journal.record_deletion`),
    so that no replay writes back what was deleted; :attr:`journal_withheld` says how many
    waiting writes the latest one withheld. It reaches every folder that holds a journal of
    the database (``journal_dir``, the default one and those noted in it), and takes what
    was deleted out of the files there that no running chat holds
    (:func:`~chatcore.log.journal.scrub_deletion`): the journals of chats that ended, and the
    writes set aside as refused (:attr:`rejected_removed` counts those).
    """

    journal_withheld = 0
    """How many writes waiting in the journal the latest deletion withheld from replay."""
    rejected_removed = 0
    """How many writes set aside as refused (``-rejected.jsonl``) the latest deletion removed."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 3.0,
        create: bool = True,
        defer_check: bool = False,
        journal_dir: Path | None = None,
    ) -> None:
        super().__init__(url, timeout_s=timeout_s, create=create)
        self.journal_dir = journal_dir
        # ``defer_check``: the caller runs the check (a chat's log plugin, in the background,
        # journaling the turns until it passes) instead of the open waiting for it.
        self.check_deferred = create and self.file_path is not None and defer_check
        if create and self.file_path is not None and not defer_check:
            self.check_on_open()
        if create and not self.in_memory and not self.check_deferred:
            try:
                replay_left_writes(self, journal_dir)
            except BaseException:
                self.close()
                raise

    def delete_conversation(self, conversation_id: str) -> int:
        """Delete a conversation (id or unique prefix) and its messages, and withhold its writes
        waiting in the journal (:attr:`journal_withheld`); returns the message count."""
        full_id = self.resolve_id(conversation_id)
        folders = self._record_deletion(conversation_id=full_id)
        deleted = super().delete_conversation(full_id)
        self._scrub(folders, conversation_id=full_id)
        return deleted

    def waiting_in_journal(self) -> int:
        """How many writes wait in this log's journal (made while the database was locked or
        down), not counting those of what was deleted since: the next process that opens the log
        to write replays them. Read without taking them."""
        if self.in_memory:
            return 0
        count = 0
        for folder in journal_folders(self.url, self.journal_dir):
            deletions = Deletions.read(folder, self.url)
            count += sum(1 for write in waiting_writes(folder, self.url) if not deletions.withholds(write))
        return count

    def delete_author(self, author_id: str) -> int:
        """Delete every message written by ``author_id``, and withhold those waiting in the journal
        (:attr:`journal_withheld`); returns the count of messages deleted from the database."""
        folders = self._record_deletion(author_id=author_id)
        deleted = super().delete_author(author_id)
        self._scrub(folders, author_id=author_id)
        return deleted

    def _record_deletion(self, *, conversation_id: str | None = None, author_id: str | None = None) -> list[Path]:
        """Recorded before the rows go, so that a replay running meanwhile cannot write them back;
        returns the journal folders it was recorded in."""
        self.journal_withheld = self.rejected_removed = 0
        if self.in_memory:
            return []  # no other process replays a journal into memory
        folders = journal_folders(self.url, self.journal_dir)
        self.journal_withheld = self._in_each(
            folders,
            lambda folder: record_deletion(folder, self.url, conversation_id=conversation_id, author_id=author_id),
            lambda folder, reason: (
                f"nothing was deleted: the deletion cannot be recorded in its journal {folder} "
                f"({reason}), whose waiting writes would bring it back"
            ),
        )
        return folders

    def _scrub(self, folders: list[Path], *, conversation_id: str | None = None, author_id: str | None = None) -> None:
        """Take what was deleted out of the journal files nobody holds and the writes set aside as refused."""
        self.rejected_removed = self._in_each(
            folders,
            lambda folder: scrub_deletion(folder, self.url, conversation_id=conversation_id, author_id=author_id),
            lambda folder, reason: f"deleted from the database, but not from the journal folder {folder}: {reason}",
        )

    def _in_each(self, folders: list[Path], act: Callable[[Path], int], failure: Callable[[Path, str], str]) -> int:
        """``act`` on each journal folder, its counts added up; a folder it cannot reach is a
        one-line LogError that ``failure`` words."""
        total = 0
        for folder in folders:
            try:
                total += act(folder)
            except OSError as error:
                reason = error.strerror or str(error)
                raise LogError(f"conversation log {self.display_url}: {failure(folder, reason)}") from None
        return total
