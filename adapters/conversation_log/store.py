"""ConversationStore: open a log by URL, write turns, and list, search, export, delete.

Every write is its own transaction, committed before the call returns, so a process
that is killed loses at most the turn it was writing. SQLite files run in WAL mode
(readers never block the writer; ``chatcore logs`` can read while a chat writes).
Any SQLAlchemy URL works; PostgreSQL suits several bot processes sharing one log.

Schema: created and upgraded by Alembic revisions in one locked transaction, so many
processes may open a new log at once (see :mod:`~chatcore.adapters.conversation_log.schema`).
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

import os
import re
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.exc import ArgumentError, DataError, DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from chatcore.adapters.conversation_log import schema
from chatcore.adapters.conversation_log.errors import LogError, LogUnavailableError, UnknownConversationError
from chatcore.adapters.conversation_log.models import ConversationRow, MessageRow, utc_now
from chatcore.adapters.conversation_log.records import (
    ConversationRecord,
    ConversationSummary,
    MessageRecord,
    SearchHit,
)

if TYPE_CHECKING:
    from chatcore.conversation import Conversation, Turn
    from chatcore.engine import Engine

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"  # stands for a lone surrogate, which no UTF-8 database can hold
NUL_SYMBOL = "\u2400"  # stands for NUL where the database refuses it (PostgreSQL)
_FTS_MIN_CHARS = 3  # a trigram index cannot answer shorter queries


def _sqlite_connect(dbapi_connection: Any, connection_record: Any) -> None:
    # pysqlite's own transaction handling would commit before every DDL statement;
    # with it off, the "begin" listener below starts each transaction itself
    # (SQLAlchemy's documented recipe for transactional DDL on SQLite).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA foreign_keys=ON")
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            # With WAL, NORMAL still keeps every commit when the process is killed;
            # only a power cut can lose the newest ones, and it saves an fsync per turn.
            cursor.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.OperationalError:
            pass  # a read-only file: reading works without switching the journal
    finally:
        cursor.close()


def _sqlite_begin(connection: sa.Connection) -> None:
    # Writers take the write lock at BEGIN: they wait their turn (busy timeout)
    # instead of failing when a read transaction cannot be upgraded.
    connection.exec_driver_sql(connection.get_execution_options().get("sqlite_begin", "BEGIN"))


_WRITE = {"sqlite_begin": "BEGIN IMMEDIATE"}


def _reason(error: BaseException) -> str:
    original = getattr(error, "orig", None) or error
    text = str(original).strip().splitlines()
    return text[0] if text else type(original).__name__


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _is_transient(error: BaseException) -> bool:
    """Whether the database, not the value written, is at fault: locked, read-only, full, damaged, gone.

    Only a constraint or a value the database refuses (IntegrityError, DataError) is
    the write's own fault; retrying that one could never succeed.
    """
    return not isinstance(error, (IntegrityError, DataError)) and (
        isinstance(error, (DBAPIError, sa.exc.TimeoutError, sa.exc.DisconnectionError))
    )


def storable(value: Any, *, nul: bool = True) -> Any:
    """``value`` with every string made storable: lone surrogates replaced, NUL too unless ``nul``.

    Recurses into the JSON columns' dicts and lists, so nothing a reply carries can
    make its write fail.
    """
    if isinstance(value, str):
        value = _LONE_SURROGATE.sub(REPLACEMENT, value)
        return value if nul else value.replace("\x00", NUL_SYMBOL)
    if isinstance(value, dict):
        return {storable(key, nul=nul): storable(item, nul=nul) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable(item, nul=nul) for item in value]
    return value


class ConversationStore:
    """The conversation log's database, opened by SQLAlchemy URL.

    ``create=False`` (the read-only ``logs`` commands): a missing SQLite file is an
    error instead of a new empty log, so a mistyped path creates nothing.

    Failures raise :class:`LogError` with a one-line message naming the database;
    :class:`LogUnavailableError` when trying again later may succeed.
    """

    def __init__(self, url: str, *, timeout_s: float = 3.0, create: bool = True) -> None:
        self.url = url
        try:
            parsed = sa.engine.make_url(url)
        except ArgumentError as error:
            raise LogError(f"{url!r} is not a database URL ({error})") from None
        self.display_url = parsed.render_as_string(hide_password=True)
        self.is_sqlite = parsed.get_backend_name() == "sqlite"
        self.is_postgres = parsed.get_backend_name() == "postgresql"
        connect_args: dict[str, Any] = {}
        if self.is_sqlite:
            parsed = self._check_sqlite_location(parsed, create)
            # check_same_thread off: adapters may write from a worker thread; the
            # plugin serialises its writes.
            connect_args = {"timeout": timeout_s, "check_same_thread": False}
        elif self.is_postgres and parsed.get_driver_name() == "psycopg":
            connect_args = {"connect_timeout": max(1, round(timeout_s))}
        try:
            self.db = sa.create_engine(parsed, connect_args=connect_args, pool_pre_ping=not self.is_sqlite)
        except ImportError as error:
            hint = " (pip install 'chatcore[postgres]')" if self.is_postgres else ""
            raise LogError(f"cannot open the conversation log {self.display_url}: {_reason(error)}{hint}") from None
        except SQLAlchemyError as error:
            raise LogError(f"cannot open the conversation log {self.display_url}: {_reason(error)}") from None
        if self.is_sqlite:
            sa.event.listen(self.db, "connect", _sqlite_connect)
            sa.event.listen(self.db, "begin", _sqlite_begin)
        self._parsed = parsed
        self._sessions = sessionmaker(self.db, expire_on_commit=False)
        self._write_sessions = sessionmaker(self.db.execution_options(**_WRITE), expire_on_commit=False)
        self.fts = False
        try:
            self._prepare_schema()
        except BaseException:
            self.db.dispose()
            raise
        self._file_identity = self._identity()

    # -- the file under it ----------------------------------------------------------
    def _file_path(self) -> Path | None:
        """The SQLite file written to (None for servers, memory and read-only URIs)."""
        database = self._parsed.database if self.is_sqlite else None
        if not database or database == ":memory:" or database.startswith("file:"):
            return None
        return Path(database).expanduser()

    def _identity(self) -> tuple[int, int] | None:
        path = self._file_path()
        try:
            found = path.stat() if path is not None else None
        except OSError:
            return None
        return (found.st_dev, found.st_ino) if found is not None else None

    def file_gone(self) -> str | None:
        """Why the SQLite file this store opened is no longer the one at its path (deleted,
        or replaced by another file), or None. Writes would go to the old, unlinked file."""
        if self._file_identity is None:
            return None
        now = self._identity()
        if now == self._file_identity:
            return None
        return f"the log file {self._file_path()} was {'deleted' if now is None else 'replaced'}"

    def reopen(self) -> None:
        """Open the file at the path afresh (creating it, with its schema, when it is gone)."""
        self.db.dispose()
        self._check_sqlite_location(self._parsed, create=True)
        self._prepare_schema()
        self._file_identity = self._identity()

    # -- opening ------------------------------------------------------------------
    def _check_sqlite_location(self, parsed: sa.URL, create: bool) -> sa.URL:
        """The URL to open: checked, its folder made (``create``), or opened immutable (a read-only folder)."""
        database = parsed.database
        if not database or database == ":memory:" or database.startswith("file:"):
            if not create and (not database or database == ":memory:"):
                raise LogError(f"{self.display_url} is an in-memory database: it holds no conversation log")
            return parsed
        path = Path(database).expanduser()
        if not create:
            if not path.is_file():
                raise LogError(f"no conversation log at {path} (a chat creates it; check the path or URL)")
            wal = path.with_name(path.name + "-wal")
            writable = os.access(path.parent, os.W_OK, effective_ids=os.access in os.supports_effective_ids)
            if not writable and (not wal.exists() or wal.stat().st_size == 0):
                # A WAL reader must create the -shm file; in a read-only folder it cannot, and
                # no writer can be at work there either (it could not make its -wal): read it
                # as an immutable file.
                return parsed.set(database=f"file:{path}?mode=ro&immutable=1", query={"uri": "true"})
            return parsed
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise LogError(f"cannot create the folder for the conversation log {database}: {error}") from None
        return parsed

    def _prepare_schema(self) -> None:
        with self._errors("open"), self.db.connect() as connection:
            with connection.begin():
                current = schema.is_current(connection)
            if not current:
                connection.execution_options(**_WRITE)
                with connection.begin():
                    schema.lock(connection)
                    schema.prepare(connection, self.display_url)  # checks again: another may have done it
            if self.is_sqlite:
                found = connection.exec_driver_sql(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'messages_fts'"
                ).first()
                self.fts = found is not None

    def close(self) -> None:
        self.db.dispose()

    def __enter__(self) -> "ConversationStore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except SQLAlchemyError as error:
            message = f"conversation log {self.display_url}: cannot {action}: {_reason(error)}"
            if _is_transient(error):
                # Fresh connections next time: one opened while the file was
                # read-only, or to a server that went away, never recovers.
                self.db.dispose()
                raise LogUnavailableError(message) from error
            raise LogError(message) from error
        except (ValueError, TypeError) as error:  # a value the driver cannot send
            raise LogError(f"conversation log {self.display_url}: cannot {action}: {error}") from error

    @contextmanager
    def _session(self, action: str, write: bool = False) -> Iterator[Session]:
        sessions = self._write_sessions if write else self._sessions
        with self._errors(action), sessions() as session, session.begin():
            yield session

    def journal_mode(self) -> str | None:
        """SQLite's journal mode ('wal' normally); None for other databases."""
        if not self.is_sqlite:
            return None
        with self._errors("read the journal mode"), self.db.connect() as connection:
            return str(connection.exec_driver_sql("PRAGMA journal_mode").scalar())

    # -- writing ------------------------------------------------------------------
    def _storable(self, value: Any) -> Any:
        return storable(value, nul=not self.is_postgres)

    def ensure_conversation(
        self,
        conversation_id: str,
        *,
        created: datetime | None = None,
        adapter: str | None = None,
        channel_key: str | None = None,
        model: str | None = None,
        title: str | None = None,
        system: str | None = None,
        prompt_format: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> bool:
        """Add the conversation if the log does not have it yet; True if it was added."""
        fields = dict(
            created=created,
            adapter=adapter,
            channel_key=channel_key,
            model=model,
            title=title,
            system=system,
            prompt_format=prompt_format,
            meta=meta,
        )
        try:
            with self._session("add a conversation", write=True) as session:
                return self._ensure(session, conversation_id, fields)
        except LogError as error:
            if isinstance(error.__cause__, IntegrityError):
                return False  # another process added it between our check and insert
            raise

    def _ensure(self, session: Session, conversation_id: str, fields: dict[str, Any]) -> bool:
        """Insert the conversation's row unless it exists; True if this call inserted it.

        On SQLite and PostgreSQL the insert itself skips an existing row (``ON CONFLICT
        DO NOTHING``), so two processes adding the same conversation at once never fail.
        """
        if session.get(ConversationRow, conversation_id) is not None:
            return False
        created = fields.get("created") or utc_now()
        title = fields.get("title") or None
        values = dict(
            id=conversation_id,
            created=created,
            updated=created,
            adapter=self._storable(fields.get("adapter")),
            channel_key=self._storable(fields.get("channel_key")),
            model=self._storable(fields.get("model")),
            title=title and self._storable(title[:255]),
            system=self._storable(fields.get("system")),
            prompt_format=fields.get("prompt_format"),
            meta=self._storable(dict(fields.get("meta") or {})),
        )
        if self.is_sqlite or self.is_postgres:
            if self.is_sqlite:
                from sqlalchemy.dialects.sqlite import insert
            else:
                from sqlalchemy.dialects.postgresql import insert  # type: ignore[assignment]
            inserted = session.execute(insert(ConversationRow).values(**values).on_conflict_do_nothing())
            return bool(inserted.rowcount)  # type: ignore[attr-defined]
        session.add(ConversationRow(**values))
        session.flush()
        return True

    def add_message(
        self,
        conversation_id: str,
        role: str,
        text: str,
        *,
        created: datetime | None = None,
        author_id: str | None = None,
        token_count: int | None = None,
        prompt_tokens: int | None = None,
        latency_s: float | None = None,
        first_token_s: float | None = None,
        decoder: dict[str, Any] | None = None,
        steerers: list[Any] | None = None,
        candidates: list[Any] | None = None,
        seed: int | None = None,
        interrupted: bool = False,
        provenance: dict[str, Any] | None = None,
        keep_replies: int | None = None,
        write_key: str | None = None,
        conversation: dict[str, Any] | None = None,
    ) -> int:
        """Append one message and commit; returns its id.

        ``keep_replies`` (bot messages only): the number of replies to the newest user
        message that the conversation still holds besides this one. Older replies
        beyond that number were dropped (regenerated) and are marked superseded.

        ``write_key``: a message already stored with this key is not stored again
        (its id is returned), so a write may be retried after any failure.
        ``conversation``: :meth:`ensure_conversation`'s fields; the conversation's row
        is added in the same transaction if missing, so a message never depends on an
        earlier write having got through.
        """
        created = created or utc_now()
        with self._session("add a message", write=True) as session:
            if write_key is not None:
                stored = session.scalar(sa.select(MessageRow.id).where(MessageRow.write_key == write_key))
                if stored is not None:
                    return int(stored)
            if conversation is not None:
                self._ensure(session, conversation_id, conversation)
            if keep_replies is not None:
                self._supersede_replies(session, conversation_id, keep_replies)
            clean = self._storable
            row = MessageRow(
                conversation_id=conversation_id,
                role=role,
                text=clean(text),
                created=created,
                author_id=author_id,
                token_count=token_count,
                prompt_tokens=prompt_tokens,
                latency_s=latency_s,
                first_token_s=first_token_s,
                decoder=clean(decoder),
                steerers=clean(steerers),
                candidates=clean(candidates),
                seed=seed,
                interrupted=interrupted,
                superseded=False,
                provenance=clean(provenance),
                write_key=write_key,
            )
            session.add(row)
            session.flush()
            current: dict[str, Any] = {"updated": created}
            if conversation is not None:  # a system prompt or format changed mid-conversation is kept as it is now
                current.update(
                    system=clean(conversation.get("system")), prompt_format=conversation.get("prompt_format")
                )
            session.execute(sa.update(ConversationRow).where(ConversationRow.id == conversation_id).values(**current))
            return row.id

    def _supersede_replies(self, session: Session, conversation_id: str, keep: int) -> None:
        newest_user = (
            sa.select(sa.func.max(MessageRow.id))
            .where(MessageRow.conversation_id == conversation_id, MessageRow.role == "user")
            .scalar_subquery()
        )
        replies = session.scalars(
            sa.select(MessageRow.id)
            .where(
                MessageRow.conversation_id == conversation_id,
                MessageRow.role == "bot",
                MessageRow.superseded.is_(False),
                MessageRow.id > sa.func.coalesce(newest_user, 0),
            )
            .order_by(MessageRow.id)
        ).all()
        dropped = list(replies[keep:])
        if dropped:
            session.execute(sa.update(MessageRow).where(MessageRow.id.in_(dropped)).values(superseded=True))

    def delete_conversation(self, conversation_id: str) -> int:
        """Delete a conversation (id or unique prefix) and its messages; returns the message count."""
        full_id = self.resolve_id(conversation_id)
        with self._session("delete a conversation", write=True) as session:
            deleted = session.execute(sa.delete(MessageRow).where(MessageRow.conversation_id == full_id))
            session.execute(sa.delete(ConversationRow).where(ConversationRow.id == full_id))
            return int(deleted.rowcount or 0)

    def delete_author(self, author_id: str) -> int:
        """Delete every message written by ``author_id`` (a deletion request); returns the count.

        Conversations keep the other messages; one left with none is deleted too.
        """
        with self._session("delete an author's messages", write=True) as session:
            touched = sa.select(MessageRow.conversation_id).where(MessageRow.author_id == author_id).distinct()
            conversation_ids = list(session.scalars(touched))
            deleted = session.execute(sa.delete(MessageRow).where(MessageRow.author_id == author_id))
            still_used = sa.select(MessageRow.id).where(MessageRow.conversation_id == ConversationRow.id).exists()
            session.execute(sa.delete(ConversationRow).where(ConversationRow.id.in_(conversation_ids), ~still_used))
            return int(deleted.rowcount or 0)

    # -- reading ------------------------------------------------------------------
    def resolve_id(self, conversation_id: str) -> str:
        """The full id of the conversation whose id is, or starts with, ``conversation_id``."""
        wanted = conversation_id.strip()
        if not wanted:
            raise UnknownConversationError("a conversation id is needed (`chatcore logs list` shows them)")
        with self._session("look up a conversation") as session:
            if session.get(ConversationRow, wanted) is not None:
                return wanted
            matches = session.scalars(
                sa.select(ConversationRow.id).where(ConversationRow.id.startswith(wanted, autoescape=True)).limit(2)
            ).all()
        if not matches:
            raise UnknownConversationError(f"no conversation {wanted!r} in {self.display_url}")
        if len(matches) > 1:
            raise UnknownConversationError(f"{wanted!r} starts several conversation ids; give more of it")
        return matches[0]

    def _summary_columns(self) -> list[Any]:
        # The turns a reader sees: replies replaced by a retry (superseded) are not counted.
        count = (
            sa.select(sa.func.count(MessageRow.id))
            .where(MessageRow.conversation_id == ConversationRow.id, MessageRow.superseded.is_(False))
            .correlate(ConversationRow)
            .scalar_subquery()
        )
        return [
            ConversationRow.id,
            ConversationRow.created,
            ConversationRow.updated,
            ConversationRow.adapter,
            ConversationRow.channel_key,
            ConversationRow.model,
            ConversationRow.title,
            count.label("n"),
        ]

    def list_conversations(
        self,
        limit: int = 20,
        offset: int = 0,
        adapter: str | None = None,
        channel_key: str | None = None,
    ) -> list[ConversationSummary]:
        """The most recently active conversations first."""
        query = sa.select(*self._summary_columns())
        if adapter is not None:
            query = query.where(ConversationRow.adapter == adapter)
        if channel_key is not None:
            query = query.where(ConversationRow.channel_key == channel_key)
        query = query.order_by(ConversationRow.updated.desc(), ConversationRow.id.desc()).limit(limit).offset(offset)
        with self._session("list conversations") as session:
            return [ConversationSummary(*row) for row in session.execute(query)]

    def count_conversations(self) -> int:
        with self._session("count conversations") as session:
            return int(session.scalar(sa.select(sa.func.count(ConversationRow.id))) or 0)

    def count_messages(self) -> int:
        with self._session("count messages") as session:
            return int(session.scalar(sa.select(sa.func.count(MessageRow.id))) or 0)

    def latest_conversation_id(self, adapter: str | None = None, channel_key: str | None = None) -> str | None:
        found = self.list_conversations(limit=1, adapter=adapter, channel_key=channel_key)
        return found[0].id if found else None

    def get_conversation(self, conversation_id: str, include_superseded: bool = True) -> ConversationRecord:
        """A conversation (id or unique prefix) with its messages, oldest first."""
        full_id = self.resolve_id(conversation_id)
        with self._session("read a conversation") as session:
            summary = session.execute(sa.select(*self._summary_columns()).where(ConversationRow.id == full_id)).one()
            system, prompt_format, meta = session.execute(
                sa.select(ConversationRow.system, ConversationRow.prompt_format, ConversationRow.meta).where(
                    ConversationRow.id == full_id
                )
            ).one()
            query = sa.select(MessageRow).where(MessageRow.conversation_id == full_id).order_by(MessageRow.id)
            if not include_superseded:
                query = query.where(MessageRow.superseded.is_(False))
            messages = [MessageRecord.from_row(row) for row in session.scalars(query)]
        return ConversationRecord(
            **asdict(ConversationSummary(*summary)),
            system=system,
            prompt_format=prompt_format,
            meta=dict(meta or {}),
            messages=messages,
        )

    def iter_conversations(
        self, conversation_ids: Sequence[str] | None = None, author_id: str | None = None
    ) -> Iterator[ConversationRecord]:
        """Each named conversation (or every one, oldest first), with its messages.

        ``author_id``: only the conversations with messages by this author, holding
        only those messages (what a person asking for their data gets).
        """
        if conversation_ids:
            # The same conversation named twice (or by two prefixes) is exported once.
            ids = list(dict.fromkeys(self.resolve_id(value) for value in conversation_ids))
        else:
            query = sa.select(ConversationRow.id).order_by(ConversationRow.created, ConversationRow.id)
            if author_id is not None:
                query = query.where(
                    ConversationRow.id.in_(
                        sa.select(MessageRow.conversation_id).where(MessageRow.author_id == author_id)
                    )
                )
            with self._session("list conversations") as session:
                ids = list(session.scalars(query))
        for full_id in ids:
            record = self.get_conversation(full_id)
            if author_id is not None:
                record.messages = [m for m in record.messages if m.author_id == author_id]
                record.message_count = len(record.messages)
            yield record

    # -- damaged files --------------------------------------------------------------
    def quick_check(self) -> str | None:
        """SQLite's ``PRAGMA quick_check``: None when the file is sound, else the first problem."""
        if not self.is_sqlite:
            return None
        try:
            with self.db.connect() as connection:
                problems = [row[0] for row in connection.exec_driver_sql("PRAGMA quick_check(5)")]
        except SQLAlchemyError as error:
            return _reason(error)
        return None if problems == ["ok"] else "; ".join(problems)

    def salvage(self, problems: list[str]) -> Iterator[ConversationRecord]:
        """Every conversation that can still be read from a damaged file, with its readable messages.

        Unreadable parts are skipped and described in ``problems``. Ids are read by
        scanning the tables forwards and backwards, each scan up to its first bad page,
        so one damaged page hides only the rows it held.
        """
        ids: dict[str, None] = {}
        for table, column in (("conversations", "id"), ("messages", "conversation_id")):
            for order in ("ASC", "DESC"):
                ids.update(
                    dict.fromkeys(
                        self._scan(f"SELECT {column} FROM {table} NOT INDEXED ORDER BY rowid {order}", problems)
                    )
                )
        for conversation_id in ids:
            try:
                yield self.get_conversation(conversation_id)
            except LogError:
                record = self._salvage_one(conversation_id, problems)
                if record is not None:
                    yield record

    def _scan(self, sql: str, problems: list[str]) -> Iterator[Any]:
        try:
            with self.db.connect() as connection:
                for row in connection.exec_driver_sql(sql):
                    yield row[0]
        except SQLAlchemyError as error:
            problems.append(f"{sql.split(' FROM ')[1].split()[0]}: {_reason(error)}")

    def _salvage_one(self, conversation_id: str, problems: list[str]) -> ConversationRecord | None:
        """A conversation whose full read failed: its row if readable, and each readable message."""
        message_ids = list(
            self._scan(
                f"SELECT id FROM messages INDEXED BY ix_messages_conversation_id WHERE conversation_id = "
                f"'{conversation_id.replace(chr(39), chr(39) * 2)}' ORDER BY id",
                problems,
            )
        )
        messages, lost = [], 0
        for message_id in message_ids:
            try:
                with self._session("read a message") as session:
                    row = session.get(MessageRow, message_id)
                    if row is not None:
                        messages.append(MessageRecord.from_row(row))
            except LogError:
                lost += 1
        try:
            with self._session("read a conversation") as session:
                row = session.get(ConversationRow, conversation_id)
                head = (row.created, row.updated, row.adapter, row.channel_key, row.model, row.title) if row else None
        except LogError:
            head = None
        if head is None and not messages:
            problems.append(f"conversation {conversation_id}: unreadable")
            return None
        if lost or head is None:
            problems.append(
                f"conversation {conversation_id}: {lost} message(s) unreadable" + ("" if head else ", its own row too")
            )
        created, updated, adapter, channel_key, model, title = head or (
            messages[0].created,
            messages[-1].created,
            None,
            None,
            None,
            None,
        )
        return ConversationRecord(
            id=conversation_id,
            created=created,
            updated=updated,
            adapter=adapter,
            channel_key=channel_key,
            model=model,
            title=title,
            message_count=len(messages),
            messages=messages,
        )

    def search(self, text: str, limit: int = 50) -> list[SearchHit]:
        """Messages containing ``text`` (case-insensitive), newest first."""
        wanted = text.strip()
        if not wanted:
            raise LogError("the search text is empty")
        query = sa.select(MessageRow, ConversationRow.title).join(ConversationRow)
        if self.fts and len(wanted) >= _FTS_MIN_CHARS:
            phrase = '"' + wanted.replace('"', '""') + '"'  # a phrase: user text is never FTS syntax
            matching = (
                sa.text("SELECT rowid FROM messages_fts WHERE messages_fts MATCH :phrase")
                .bindparams(phrase=phrase)
                .columns(sa.column("rowid", sa.Integer))
            )
            query = query.where(MessageRow.id.in_(matching))
        elif self.is_postgres:
            # ILIKE, so the pg_trgm GIN index answers (``lower(text) LIKE`` would not use it).
            query = query.where(MessageRow.text.ilike("%" + _escape_like(wanted) + "%", escape="\\"))
        else:
            query = query.where(MessageRow.text.icontains(wanted, autoescape=True))
        query = query.order_by(MessageRow.id.desc()).limit(limit)
        with self._session("search") as session:
            return [
                SearchHit(row.conversation_id, title, MessageRecord.from_row(row))
                for row, title in session.execute(query)
            ]

    # -- resuming -----------------------------------------------------------------
    def load_turns(self, conversation_id: str) -> list["Turn"]:
        """The conversation's turns as the engine holds them (superseded replies left out)."""
        return self._turns(self.get_conversation(conversation_id, include_superseded=False))

    @staticmethod
    def _turns(record: ConversationRecord) -> list["Turn"]:
        from chatcore.conversation import Turn

        turns = []
        for message in record.messages:
            meta: dict[str, Any] = {"log_message_id": message.id}
            if message.role == "bot":
                meta["provenance"] = message.full_provenance()
            role = "bot" if message.role == "bot" else "user"
            turns.append(Turn(role, message.text, message.created, message.interrupted, meta))
        return turns

    def resume(self, engine: "Engine", conversation_id: str) -> "Conversation":
        """A live Conversation with the logged turns, id and meta; new turns log to the same row."""
        from chatcore.conversation import Conversation

        record = self.get_conversation(conversation_id, include_superseded=False)
        meta = dict(record.meta)
        meta.update(adapter=record.adapter, channel_key=record.channel_key, title=record.title)
        return Conversation(engine, id=record.id, turns=self._turns(record), system=record.system, **meta)
