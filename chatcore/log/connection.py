"""The store's connection to its database: the engine, the schema check at opening, errors, sessions.

:class:`StoreConnection` opens the SQLAlchemy engine for a URL (SQLite files in WAL
mode with transactional DDL; PostgreSQL through psycopg with a connect timeout, a statement
timeout and TCP keepalives),
creates or upgrades the schema (:mod:`~chatcore.log.schema`),
notices an SQLite file deleted or replaced under it, and turns database failures into
:class:`~chatcore.log.errors.LogError` (or
:class:`~chatcore.log.errors.LogUnavailableError` when a retry
may work, after dropping the pooled connections).
"""

from __future__ import annotations

import os
import shlex
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

import sqlalchemy as sa
from sqlalchemy.exc import ArgumentError, DataError, DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from chatcore.log import schema
from chatcore.log.errors import LogError, LogUnavailableError, NotALogError, folder_refused
from chatcore.log.location import is_default_folder, private_data_folder
from chatcore.log.private_files import create_private_file, make_private_folder

SYNCHRONOUS_LEVELS = ("normal", "full")
"""SQLite's ``synchronous`` settings a log may ask for with ``?synchronous=`` in its URL.

``normal`` (the default): with WAL, every commit survives the process being killed; an
OS crash or a power cut may roll back the newest commits (SQLite syncs the WAL at
checkpoints, not at each commit). ``full``: each commit is synced to the disk before
it returns, so it survives a power cut too, at the cost of an fsync per write."""


def _sqlite_connector(synchronous: str, switch_journal: bool = True) -> Callable[[Any, Any], None]:
    """Each new SQLite connection's settings; ``switch_journal`` off for a store that only reads
    or checks (a file that is not a log yet, or another program's, is left as it is)."""

    def connect(dbapi_connection: Any, connection_record: Any) -> None:
        # pysqlite's own transaction handling would commit before every DDL statement;
        # with it off, the "begin" listener starts each transaction itself
        # (SQLAlchemy's documented recipe for transactional DDL on SQLite).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA foreign_keys=ON")
            try:
                if switch_journal:
                    cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute(f"PRAGMA synchronous={synchronous.upper()}")
            except sqlite3.OperationalError:
                pass  # a read-only file: reading works without switching the journal
        finally:
            cursor.close()

    return connect


_WRITE = {"sqlite_begin": "BEGIN IMMEDIATE"}
WAL_COMPANIONS = ("-wal", "-shm")

LIBPQ_DRIVERS = ("psycopg", "psycopg2")
POSTGRES_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 3,  # seconds to reach the server and log in (libpq's least is 2)
    # A dead peer or a cut network found in about 25 s rather than the kernel's two hours (TCP only).
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 20_000,  # ms: data the server never acknowledges fails the connection (TCP only)
}
"""libpq settings every PostgreSQL log connection gets, unless its URL sets them
(``?connect_timeout=10&keepalives_idle=60``)."""
POSTGRES_STATEMENT_TIMEOUT = "10s"
"""The server cancels a statement running longer (a lock wait included); ``?options=-c
statement_timeout=...`` in the URL sets another. A server that stops answering altogether
(stopped, frozen) cannot cancel anything: the log plugin's write deadline covers that case."""


def postgres_connect_args(parsed: sa.URL) -> dict[str, Any]:
    """:data:`POSTGRES_DEFAULTS` and the statement timeout, for what the URL leaves unset."""
    given = set(parsed.query)
    args = {key: value for key, value in POSTGRES_DEFAULTS.items() if key not in given}
    options = parsed.query.get("options") or ""
    options = options if isinstance(options, str) else " ".join(options)
    if "statement_timeout" not in options:
        args["options"] = f"{options} -c statement_timeout={POSTGRES_STATEMENT_TIMEOUT}".strip()
    return args


MEMORY_DISPLAY = ":memory: (kept in memory only: gone when this process exits)"
"""How a log kept in memory is named to the person (``--db :memory:`` on a chat, a bot or the server)."""

MEMORY_REFUSED = (
    ":memory: is SQLite's in-memory database: it holds no conversation log to read (a chat, a bot or the "
    "server given --db :memory: keeps its log there only while it runs)"
)

DAMAGE_SIGNS = ("not a database", "malformed", "damaged", "ran out of memory")
"""SQLite's own words for a damaged file (SQLITE_NOTADB, SQLITE_CORRUPT, SQLITE_NOMEM on a damaged
page) and chatcore's: what ``logs export --salvage`` is for."""


def salvage_hint(path: Path) -> str:
    """The command that recovers what the damaged SQLite file at ``path`` holds, as one clause."""
    return f"`chatcore logs export --salvage --db {shlex.quote(str(path))} -o saved.jsonl` recovers what it holds"


def is_memory(parsed: sa.URL) -> bool:
    """An SQLite URL of SQLite's in-memory database (``sqlite://``, ``sqlite:///:memory:``)."""
    return parsed.get_backend_name() == "sqlite" and (not parsed.database or parsed.database == ":memory:")


def reason(error: BaseException) -> str:
    """The first line of what went wrong, for a one-line message (the driver's own error when there is one)."""
    original = getattr(error, "orig", None) or error
    text = str(original).strip().splitlines()
    return text[0] if text else type(original).__name__


def is_transient(error: BaseException) -> bool:
    """Whether the database, not the value written, is at fault: locked, read-only, full, damaged, gone.

    Only a constraint or a value the database refuses (IntegrityError, DataError) is
    the write's own fault; retrying that one could never succeed.
    """
    return not isinstance(error, (IntegrityError, DataError)) and (
        isinstance(error, (DBAPIError, sa.exc.TimeoutError, sa.exc.DisconnectionError))
    )


def sqlite_file(url: str | sa.URL) -> Path | None:
    """The file an SQLite URL names; None for other databases, memory and ``file:`` URI names.
    An unreadable URL raises LogError."""
    if isinstance(url, str):
        try:
            url = sa.engine.make_url(url)
        except ArgumentError as error:
            raise LogError(f"{url!r} is not a database URL ({error})") from None
    database = url.database if url.get_backend_name() == "sqlite" else None
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database).expanduser()


class StoreConnection:
    """The database under a conversation log, opened by SQLAlchemy URL (see ``ConversationStore``)."""

    def __init__(self, url: str, *, timeout_s: float = 3.0, create: bool = True) -> None:
        self.url = url
        self._create = create  # may make a log where there is none (see schema.prepare)
        try:
            parsed = sa.engine.make_url(url)
        except ArgumentError as error:
            raise LogError(f"{url!r} is not a database URL ({error})") from None
        self.display_url = parsed.render_as_string(hide_password=True)
        self.is_sqlite = parsed.get_backend_name() == "sqlite"
        self.is_postgres = parsed.get_backend_name() == "postgresql"
        connect_args: dict[str, Any] = {}
        self.synchronous = "normal"
        self._memory_keeper: sqlite3.Connection | None = None
        self.in_memory = create and is_memory(parsed)
        """A log kept in memory for the life of the process (``--db :memory:``), never a file."""
        damage_path = sqlite_file(parsed)  # the file to point a salvage at, should it not open
        if self.in_memory:
            parsed = self._memory_database(parsed)
            self.url = parsed.render_as_string(hide_password=False)  # another store here reaches the same one
            self.display_url = MEMORY_DISPLAY
        elif self.is_sqlite:
            parsed = self._take_synchronous(parsed)
            parsed = self._check_sqlite_location(parsed, create)
            # check_same_thread off: adapters may write from a worker thread; the
            # plugin serialises its writes.
            connect_args = {"timeout": timeout_s, "check_same_thread": False}
        elif self.is_postgres and parsed.get_driver_name() in LIBPQ_DRIVERS:
            connect_args = postgres_connect_args(parsed)
        try:
            self.db = sa.create_engine(parsed, connect_args=connect_args, pool_pre_ping=not self.is_sqlite)
        except ImportError as error:
            hint = " (pip install 'chatcore[postgres]')" if self.is_postgres else ""
            raise LogError(f"cannot open the conversation log {self.display_url}: {reason(error)}{hint}") from None
        except SQLAlchemyError as error:
            raise LogError(f"cannot open the conversation log {self.display_url}: {reason(error)}") from None
        self._timeout_s = timeout_s
        self.write_wait_s: float | None = None
        """How long a write waits for SQLite's lock; None: ``timeout_s``. The log plugin sets it
        short while the log fails, so that retrying never holds a turn up for long."""
        if self.is_sqlite:
            sa.event.listen(self.db, "connect", _sqlite_connector(self.synchronous, switch_journal=create))
            sa.event.listen(self.db, "begin", self._sqlite_begin)
        self._parsed = parsed
        self._sessions = sessionmaker(self.db, expire_on_commit=False)
        self._write_sessions = sessionmaker(self.db.execution_options(**_WRITE), expire_on_commit=False)
        self.fts = False
        try:
            self._prepare_schema()
        except NotALogError:
            self.close()
            raise
        except LogError as error:
            self.close()
            if damage_path is None or not damage_path.is_file() or not any(sign in str(error) for sign in DAMAGE_SIGNS):
                raise  # a server, no file, or a fault that is not damage (locked, read-only): nothing to salvage
            raise type(error)(f"{error}; {salvage_hint(damage_path)}") from error.__cause__
        except BaseException:
            self.close()
            raise
        self._companions: dict[str, tuple[int, int] | None] = {}
        self._note_identity()

    def _sqlite_begin(self, connection: sa.Connection) -> None:
        # Writers take the write lock at BEGIN: they wait their turn (busy timeout)
        # instead of failing when a read transaction cannot be upgraded.
        begin = connection.get_execution_options().get("sqlite_begin", "BEGIN")
        if begin != "BEGIN":
            wait_s = self._timeout_s if self.write_wait_s is None else self.write_wait_s
            connection.exec_driver_sql(f"PRAGMA busy_timeout = {max(0, round(wait_s * 1000))}")
        connection.exec_driver_sql(begin)

    # -- the file under it ----------------------------------------------------------
    def _file_path(self) -> Path | None:
        """The SQLite file written to (None for servers, memory and read-only URIs)."""
        return sqlite_file(self._parsed)

    @property
    def file_path(self) -> Path | None:
        """The SQLite file of this log (None for servers, memory and URI names)."""
        return self._file_path()

    def _identity(self, suffix: str = "") -> tuple[int, int] | None:
        path = self._file_path()
        try:
            found = path.with_name(path.name + suffix).stat() if path is not None else None
        except OSError:
            return None
        return (found.st_dev, found.st_ino) if found is not None else None

    def _note_identity(self) -> None:
        """Remember which files at the path are this log's: the database, its -wal and its -shm."""
        self._file_identity = self._identity()
        self._companions = {suffix: self._identity(suffix) for suffix in WAL_COMPANIONS}

    def file_gone(self) -> str | None:
        """Why the SQLite file this store opened is no longer the one at its path (deleted,
        or replaced by another file), or None. Writes would go to the old, unlinked file."""
        if self._file_identity is None:
            return None
        now = self._identity()
        if now == self._file_identity:
            self._companions = {suffix: self._identity(suffix) for suffix in WAL_COMPANIONS}
            return None
        return f"the log file {self._file_path()} was {'deleted' if now is None else 'replaced'}"

    def reopen(self) -> None:
        """Open the file at the path afresh (creating it, with its schema, when it is gone).

        SQLite leaves the -wal and -shm of a file that was moved or deleted under it where
        they are, unmerged (it will not checkpoint into a file it no longer finds at its
        path). Opened beside the new file, that WAL would be applied to it and overwrite its
        pages with the old file's; so they are removed first, when they are still the very
        files this log used (a -wal that came with the new file is its own, and kept)."""
        self.db.dispose()
        path = self._file_path()
        if path is not None:
            for suffix, identity in self._companions.items():
                if identity is not None and self._identity(suffix) == identity:
                    path.with_name(path.name + suffix).unlink(missing_ok=True)
        self._check_sqlite_location(self._parsed, create=True)
        self._create = True
        self._prepare_schema()
        self._note_identity()

    def _take_synchronous(self, parsed: sa.URL) -> sa.URL:
        """Read ``?synchronous=normal|full`` off an SQLite URL (it is not a driver argument)."""
        value = parsed.query.get("synchronous")
        if value is None:
            return parsed
        level = (value if isinstance(value, str) else value[-1]).strip().lower()
        if level not in SYNCHRONOUS_LEVELS:
            raise LogError(
                f"{self.display_url}: `synchronous` must be one of {', '.join(SYNCHRONOUS_LEVELS)}, got {value!r}"
            )
        self.synchronous = level
        return parsed.difference_update_query(["synchronous"])

    # -- opening ------------------------------------------------------------------
    def _memory_database(self, parsed: sa.URL) -> sa.URL:
        """SQLite's in-memory database, shared by this store's connections (each of SQLAlchemy's
        own ``:memory:`` connections would be a database of its own, one per thread).

        A database of SQLite's ``memdb`` VFS whose name starts with ``/`` is one database for every
        connection in the process that opens that name, locked as a file is; it lives while one
        connection to it is open, so the store holds one until it closes."""
        name = f"/chatcore-log-{uuid.uuid4().hex}"
        try:
            self._memory_keeper = sqlite3.connect(f"file:{name}?vfs=memdb", uri=True, check_same_thread=False)
        except sqlite3.Error as error:
            raise LogError(
                f"cannot keep the conversation log in memory: {error} (SQLite {sqlite3.sqlite_version}; "
                "3.36 or newer has the memdb VFS)"
            ) from None
        return parsed.set(database=f"file:{name}", query={"vfs": "memdb", "uri": "true"})

    def _check_sqlite_location(self, parsed: sa.URL, create: bool) -> sa.URL:
        """The URL to open: checked, its folder made (``create``), or opened immutable (a read-only folder)."""
        database = parsed.database
        if not database or database == ":memory:" or database.startswith("file:"):
            if not create and (not database or database == ":memory:"):
                raise NotALogError(MEMORY_REFUSED)
            return parsed
        path = Path(database).expanduser()
        if path.is_dir():
            raise NotALogError(folder_refused(path))
        if not create:
            if not path.is_file():
                raise NotALogError(f"no conversation log at {path} (a chat creates it; check the path or URL)")
            wal = path.with_name(path.name + "-wal")
            writable = os.access(path.parent, os.W_OK, effective_ids=os.access in os.supports_effective_ids)
            if not writable and (not wal.exists() or wal.stat().st_size == 0):
                # A WAL reader must create the -shm file; in a read-only folder it cannot, and
                # no writer can be at work there either (it could not make its -wal): read it
                # as an immutable file.
                return parsed.set(database=f"file:{path}?mode=ro&immutable=1", query={"uri": "true"})
            return parsed
        folder = path.parent
        if not folder.is_dir() and not is_default_folder(folder):
            # Only the user data folder is made when missing: a folder in a path given by hand that
            # does not exist is a mistyped path far more often than a wish for a new folder tree.
            raise LogError(
                f"cannot create the conversation log {path}: no folder {folder} (create it first, or give a "
                "file in a folder that exists)"
            )
        try:
            make_private_folder(path.parent)
        except OSError as error:
            raise LogError(f"cannot create the folder for the conversation log {database}: {error}") from None
        if is_default_folder(folder):
            private_data_folder()  # one an older version made 0755 is made 0700, as it is created now
        try:
            # Made here, 0600, rather than by SQLite (0644 under the usual umask): SQLite gives
            # the -wal and -shm files it makes the mode of the database file.
            create_private_file(path)
        except OSError as error:
            if not path.exists():
                raise LogError(f"cannot create the conversation log {database}: {error.strerror or error}") from None
        return parsed

    def _prepare_schema(self) -> None:
        with self._errors("open"), self.db.connect() as connection:
            with connection.begin():
                current = schema.is_current(connection)
            if not current:
                connection.execution_options(**_WRITE)
                with connection.begin():
                    schema.lock(connection)
                    # prepare checks again: another process may have made it meanwhile.
                    schema.prepare(connection, self.display_url, self._create)
            if self.is_sqlite:
                found = connection.exec_driver_sql(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'messages_fts'"
                ).first()
                self.fts = found is not None

    def close(self) -> None:
        self.db.dispose()
        if self._memory_keeper is not None:  # the in-memory log goes with it
            self._memory_keeper.close()
            self._memory_keeper = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except SQLAlchemyError as error:
            message = f"conversation log {self.display_url}: cannot {action}: {reason(error)}"
            if is_transient(error):
                # Fresh connections next time: one opened while the file was
                # read-only, or to a server that went away, never recovers.
                self.db.dispose()
                raise LogUnavailableError(message) from error
            raise LogError(message) from error
        except (ValueError, TypeError) as error:  # a value the driver cannot send
            raise LogError(f"conversation log {self.display_url}: cannot {action}: {error}") from error
        except MemoryError as error:
            if not self.is_sqlite:
                raise
            # SQLite reports SQLITE_NOMEM when a damaged page (a search-index block, a record
            # header) asks it for an absurd allocation: the file's damage, not the process's memory.
            raise LogError(
                f"conversation log {self.display_url}: cannot {action}: SQLite ran out of memory reading the file"
                " (damaged? `chatcore logs check` finds out)"
            ) from error

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
