"""ConversationStore: open a log by URL, write turns, and list, search, export, delete.

Every write is its own transaction, committed before the call returns, so a process
that is killed loses at most the turn it was writing. SQLite files run in WAL mode
(readers never block the writer; ``chatcore logs`` can read while a chat writes).
Any SQLAlchemy URL works; PostgreSQL suits several bot processes sharing one log.

Schema versions: the ``chatcore_schema`` table holds the version a file was written
with. Opening an older log runs the steps in :data:`MIGRATIONS` in one transaction;
a log from a newer chatcore is refused with a clear message rather than damaged.

Search uses an SQLite FTS5 trigram index where SQLite has one (substring matches,
case-insensitive, three characters or more) and ``LIKE`` otherwise.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.exc import ArgumentError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from chatcore.adapters.conversation_log.errors import LogError, UnknownConversationError
from chatcore.adapters.conversation_log.models import (
    SCHEMA_VERSION,
    Base,
    ConversationRow,
    MessageRow,
    SchemaVersion,
    utc_now,
)

if TYPE_CHECKING:
    from chatcore.conversation import Conversation, Turn
    from chatcore.engine import Engine

MIGRATIONS: dict[int, Callable[[sa.Connection], None]] = {}
"""``MIGRATIONS[n](connection)`` upgrades a version-``n`` log to version ``n + 1``.

Add a step here whenever :data:`~chatcore.adapters.conversation_log.models.SCHEMA_VERSION`
goes up (version 1 is the first schema, so there are none yet).
"""

# Substring search over an external-content FTS5 table that triggers keep in step
# with ``messages``; 'rebuild' indexes rows written before the index existed.
_FTS_DDL = (
    "CREATE VIRTUAL TABLE messages_fts USING fts5(text, content='messages', content_rowid='id', tokenize='trigram')",
    "CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN "
    "INSERT INTO messages_fts(rowid, text) VALUES (new.id, new.text); END",
    "CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, text) VALUES ('delete', old.id, old.text); END",
    "CREATE TRIGGER messages_fts_update AFTER UPDATE OF text ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, text) VALUES ('delete', old.id, old.text); "
    "INSERT INTO messages_fts(rowid, text) VALUES (new.id, new.text); END",
    "INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')",
)
_FTS_MIN_CHARS = 3  # a trigram index cannot answer shorter queries


@dataclass
class MessageRecord:
    id: int
    conversation_id: str
    role: str
    text: str
    created: datetime
    token_count: int | None = None
    prompt_tokens: int | None = None
    latency_s: float | None = None
    first_token_s: float | None = None
    decoder: dict[str, Any] | None = None
    steerers: list[Any] | None = None
    candidates: list[Any] | None = None
    seed: int | None = None
    interrupted: bool = False
    superseded: bool = False
    provenance: dict[str, Any] | None = None

    @classmethod
    def from_row(cls, row: MessageRow) -> "MessageRecord":
        return cls(
            id=row.id, conversation_id=row.conversation_id, role=row.role, text=row.text, created=row.created,
            token_count=row.token_count, prompt_tokens=row.prompt_tokens, latency_s=row.latency_s,
            first_token_s=row.first_token_s, decoder=row.decoder, steerers=row.steerers, candidates=row.candidates,
            seed=row.seed, interrupted=bool(row.interrupted), superseded=bool(row.superseded),
            provenance=row.provenance,
        )

    def full_provenance(self) -> dict[str, Any]:
        """The reply's provenance as the engine gave it (candidates included)."""
        provenance = dict(self.provenance or {})
        if self.candidates:
            provenance["candidates"] = self.candidates
        return provenance

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["created"] = self.created.isoformat()
        return data


@dataclass
class ConversationSummary:
    id: str
    created: datetime
    updated: datetime
    adapter: str | None
    channel_key: str | None
    model: str | None
    title: str | None
    message_count: int

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["created"] = self.created.isoformat()
        data["updated"] = self.updated.isoformat()
        return data


@dataclass
class ConversationRecord(ConversationSummary):
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[MessageRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["messages"] = [message.to_dict() for message in self.messages]
        return data


@dataclass
class SearchHit:
    conversation_id: str
    title: str | None
    message: MessageRecord

    def to_dict(self) -> dict[str, Any]:
        return {"conversation_id": self.conversation_id, "title": self.title, "message": self.message.to_dict()}


def _sqlite_pragmas(dbapi_connection: Any, connection_record: Any) -> None:
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


def _reason(error: BaseException) -> str:
    original = getattr(error, "orig", None) or error
    text = str(original).strip().splitlines()
    return text[0] if text else type(original).__name__


class ConversationStore:
    """The conversation log's database, opened by SQLAlchemy URL.

    Failures raise :class:`LogError` with a one-line message naming the database.
    """

    def __init__(self, url: str, *, timeout_s: float = 3.0) -> None:
        self.url = url
        try:
            parsed = sa.engine.make_url(url)
        except ArgumentError as error:
            raise LogError(f"{url!r} is not a database URL ({error})") from None
        self.display_url = parsed.render_as_string(hide_password=True)
        self.is_sqlite = parsed.get_backend_name() == "sqlite"
        connect_args: dict[str, Any] = {}
        if self.is_sqlite:
            self._make_parent_folder(parsed.database)
            # check_same_thread off: adapters may write from a worker thread; the
            # plugin serialises its writes.
            connect_args = {"timeout": timeout_s, "check_same_thread": False}
        try:
            self.db = sa.create_engine(parsed, connect_args=connect_args)
        except (SQLAlchemyError, ImportError) as error:
            raise LogError(f"cannot open the conversation log {self.display_url}: {_reason(error)}") from None
        if self.is_sqlite:
            sa.event.listen(self.db, "connect", _sqlite_pragmas)
        self._sessions = sessionmaker(self.db, expire_on_commit=False)
        self.fts = False
        try:
            self._prepare_schema()
        except BaseException:
            self.db.dispose()
            raise

    # -- opening ------------------------------------------------------------------
    def _make_parent_folder(self, database: str | None) -> None:
        if not database or database == ":memory:" or database.startswith("file:"):
            return
        try:
            Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise LogError(f"cannot create the folder for the conversation log {database}: {error}") from None

    def _prepare_schema(self) -> None:
        with self._errors("open"), self.db.begin() as connection:
            tables = set(sa.inspect(connection).get_table_names())
            if SchemaVersion.__tablename__ in tables:
                version = connection.execute(sa.select(SchemaVersion.version)).scalar_one_or_none() or 1
            elif ConversationRow.__tablename__ in tables:
                raise LogError(f"{self.display_url} has a 'conversations' table but no chatcore schema version; "
                               "it is not a chatcore conversation log")
            else:
                version = None
            if version is None:
                Base.metadata.create_all(connection)
                connection.execute(sa.insert(SchemaVersion).values(id=1, version=SCHEMA_VERSION))
            elif version > SCHEMA_VERSION:
                raise LogError(f"the conversation log {self.display_url} was written by a newer chatcore "
                               f"(schema {version}; this one reads up to {SCHEMA_VERSION}); upgrade chatcore")
            elif version < SCHEMA_VERSION:
                self._migrate(connection, version)
        if self.is_sqlite:
            self.fts = self._prepare_fts()

    def _migrate(self, connection: sa.Connection, version: int) -> None:
        for step in range(version, SCHEMA_VERSION):
            if step not in MIGRATIONS:
                raise LogError(f"the conversation log {self.display_url} has schema {version}, "
                               f"and there is no upgrade from schema {step} to {step + 1}")
            MIGRATIONS[step](connection)
        connection.execute(sa.update(SchemaVersion).values(version=SCHEMA_VERSION))

    def _prepare_fts(self) -> bool:
        exists = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'messages_fts'"
        try:
            with self.db.begin() as connection:
                if connection.execute(sa.text(exists)).first() is not None:
                    return True
                if sqlite3.sqlite_version_info < (3, 34):  # the trigram tokenizer's first release
                    return False
                for statement in _FTS_DDL:
                    connection.execute(sa.text(statement))
            return True
        except SQLAlchemyError:
            return False  # no FTS5 in this SQLite, or a read-only file: search falls back to LIKE

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
            raise LogError(f"conversation log {self.display_url}: cannot {action}: {_reason(error)}") from error

    @contextmanager
    def _session(self, action: str) -> Iterator[Session]:
        with self._errors(action), self._sessions() as session, session.begin():
            yield session

    def journal_mode(self) -> str | None:
        """SQLite's journal mode ('wal' normally); None for other databases."""
        if not self.is_sqlite:
            return None
        with self._errors("read the journal mode"), self.db.connect() as connection:
            return str(connection.exec_driver_sql("PRAGMA journal_mode").scalar())

    # -- writing ------------------------------------------------------------------
    def ensure_conversation(
        self,
        conversation_id: str,
        *,
        created: datetime | None = None,
        adapter: str | None = None,
        channel_key: str | None = None,
        model: str | None = None,
        title: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> bool:
        """Add the conversation if the log does not have it yet; True if it was added."""
        created = created or utc_now()
        row = ConversationRow(
            id=conversation_id, created=created, updated=created, adapter=adapter, channel_key=channel_key,
            model=model, title=(title or None) and title[:255], meta=dict(meta or {}),
        )
        try:
            with self._session("add a conversation") as session:
                if session.get(ConversationRow, conversation_id) is not None:
                    return False
                session.add(row)
        except LogError as error:
            if isinstance(error.__cause__, IntegrityError):
                return False  # another process added it between our check and insert
            raise
        return True

    def add_message(
        self,
        conversation_id: str,
        role: str,
        text: str,
        *,
        created: datetime | None = None,
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
    ) -> int:
        """Append one message and commit; returns its id.

        ``keep_replies`` (bot messages only): the number of replies to the newest user
        message that the conversation still holds besides this one. Older replies
        beyond that number were dropped (regenerated) and are marked superseded.
        """
        created = created or utc_now()
        with self._session("add a message") as session:
            if keep_replies is not None:
                self._supersede_replies(session, conversation_id, keep_replies)
            row = MessageRow(
                conversation_id=conversation_id, role=role, text=text, created=created, token_count=token_count,
                prompt_tokens=prompt_tokens, latency_s=latency_s, first_token_s=first_token_s, decoder=decoder,
                steerers=steerers, candidates=candidates, seed=seed, interrupted=interrupted,
                superseded=False, provenance=provenance,
            )
            session.add(row)
            session.flush()
            session.execute(sa.update(ConversationRow).where(ConversationRow.id == conversation_id)
                            .values(updated=created))
            return row.id

    def _supersede_replies(self, session: Session, conversation_id: str, keep: int) -> None:
        newest_user = (sa.select(sa.func.max(MessageRow.id))
                       .where(MessageRow.conversation_id == conversation_id, MessageRow.role == "user")
                       .scalar_subquery())
        replies = session.scalars(
            sa.select(MessageRow.id)
            .where(MessageRow.conversation_id == conversation_id, MessageRow.role == "bot",
                   MessageRow.superseded.is_(False), MessageRow.id > sa.func.coalesce(newest_user, 0))
            .order_by(MessageRow.id)
        ).all()
        dropped = list(replies[keep:])
        if dropped:
            session.execute(sa.update(MessageRow).where(MessageRow.id.in_(dropped)).values(superseded=True))

    def delete_conversation(self, conversation_id: str) -> int:
        """Delete a conversation (id or unique prefix) and its messages; returns the message count."""
        full_id = self.resolve_id(conversation_id)
        with self._session("delete a conversation") as session:
            deleted = session.execute(sa.delete(MessageRow).where(MessageRow.conversation_id == full_id))
            session.execute(sa.delete(ConversationRow).where(ConversationRow.id == full_id))
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
        count = (sa.select(sa.func.count(MessageRow.id))
                 .where(MessageRow.conversation_id == ConversationRow.id)
                 .correlate(ConversationRow).scalar_subquery())
        return [ConversationRow.id, ConversationRow.created, ConversationRow.updated, ConversationRow.adapter,
                ConversationRow.channel_key, ConversationRow.model, ConversationRow.title, count.label("n")]

    def list_conversations(
        self, limit: int = 20, offset: int = 0, adapter: str | None = None, channel_key: str | None = None,
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
            summary = session.execute(
                sa.select(*self._summary_columns()).where(ConversationRow.id == full_id)
            ).one()
            meta = session.scalar(sa.select(ConversationRow.meta).where(ConversationRow.id == full_id)) or {}
            query = sa.select(MessageRow).where(MessageRow.conversation_id == full_id).order_by(MessageRow.id)
            if not include_superseded:
                query = query.where(MessageRow.superseded.is_(False))
            messages = [MessageRecord.from_row(row) for row in session.scalars(query)]
        return ConversationRecord(*summary, meta=dict(meta), messages=messages)

    def iter_conversations(self, conversation_ids: Sequence[str] | None = None) -> Iterator[ConversationRecord]:
        """Each named conversation (or every one, oldest first), with its messages."""
        if conversation_ids:
            ids = [self.resolve_id(value) for value in conversation_ids]
        else:
            with self._session("list conversations") as session:
                ids = list(session.scalars(sa.select(ConversationRow.id)
                                           .order_by(ConversationRow.created, ConversationRow.id)))
        for full_id in ids:
            yield self.get_conversation(full_id)

    def search(self, text: str, limit: int = 50) -> list[SearchHit]:
        """Messages containing ``text`` (case-insensitive), newest first."""
        wanted = text.strip()
        if not wanted:
            raise LogError("the search text is empty")
        query = sa.select(MessageRow, ConversationRow.title).join(ConversationRow)
        if self.fts and len(wanted) >= _FTS_MIN_CHARS:
            phrase = '"' + wanted.replace('"', '""') + '"'  # a phrase: user text is never FTS syntax
            matching = sa.text("SELECT rowid FROM messages_fts WHERE messages_fts MATCH :phrase").bindparams(
                phrase=phrase).columns(sa.column("rowid", sa.Integer))
            query = query.where(MessageRow.id.in_(matching))
        else:
            query = query.where(MessageRow.text.icontains(wanted, autoescape=True))
        query = query.order_by(MessageRow.id.desc()).limit(limit)
        with self._session("search") as session:
            return [SearchHit(row.conversation_id, title, MessageRecord.from_row(row))
                    for row, title in session.execute(query)]

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
        return Conversation(engine, id=record.id, turns=self._turns(record), **meta)
