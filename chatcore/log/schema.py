"""Create or upgrade a log's schema: atomically, once, however many processes open it at once.

Everything happens in one transaction that first takes a lock every opener waits on:
``BEGIN IMMEDIATE`` on SQLite (the database's write lock; SQLite's DDL is
transactional once pysqlite's own transaction handling is off, see
:mod:`~chatcore.log.connection`), ``pg_advisory_xact_lock`` on
PostgreSQL (its DDL is transactional too). The first opener creates the schema; the
others wait, then find it made. A crash at any point rolls the whole step back.

The steps are Alembic revisions (``migrations/versions``); revision ``000N`` writes
version N into ``chatcore_schema``, which older chatcores read to refuse a newer log.
A log made before Alembic (version 1, no ``alembic_version`` table) is stamped at
``0001`` and upgraded in place.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa

from chatcore.log.errors import LogError, NotALogError
from chatcore.log.models import SCHEMA_VERSION

MIGRATIONS = Path(__file__).with_name("migrations")
# Any constant: every chatcore process takes the same advisory lock on the database.
_POSTGRES_LOCK_KEY = 0x63686174636F7265 & 0x7FFFFFFFFFFFFFFF  # "chatcore"
_LOG_TABLES = {"conversations", "messages"}


def _alembic_config(connection: sa.Connection) -> "object":
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


def _revision(version: int) -> str:
    return f"{version:04d}"


def lock(connection: sa.Connection) -> None:
    """Serialise schema work; on SQLite the ``BEGIN IMMEDIATE`` that opened the transaction did it."""
    if connection.dialect.name == "postgresql":
        connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _POSTGRES_LOCK_KEY})


def is_current(connection: sa.Connection) -> bool:
    """Whether the log is at the newest schema, read without taking any lock or writing.

    Most opens end here, so a read-only file or folder can be read, and opens of a
    made log never queue behind each other.
    """
    from alembic.runtime.migration import MigrationContext

    tables = set(sa.inspect(connection).get_table_names())
    if "chatcore_schema" not in tables:
        return False
    if MigrationContext.configure(connection).get_current_revision() != _revision(SCHEMA_VERSION):
        return False
    versions = connection.execute(sa.text("SELECT version FROM chatcore_schema")).scalars().all()
    return versions == [SCHEMA_VERSION]


def prepare(connection: sa.Connection, display_url: str, create: bool = True) -> None:
    """Bring the log on ``connection`` (in a transaction, holding :func:`lock`) to the newest schema.

    A database that holds no log yet gets one only with ``create`` (a chat, a bot, the
    server; never a command that only reads or checks). An SQLite file holding another
    program's tables is never written into."""
    from alembic import command
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    tables = set(sa.inspect(connection).get_table_names())
    if "chatcore_schema" not in tables and not tables & _LOG_TABLES:
        others = sorted(tables - {"alembic_version"})
        if others and connection.dialect.name == "sqlite":
            listed = ", ".join(repr(name) for name in others[:3]) + (", ..." if len(others) > 3 else "")
            raise NotALogError(f"{display_url} is not a chatcore conversation log: it holds other tables ({listed})")
        if not create:
            raise NotALogError(f"{display_url} holds no chatcore conversation log (a chat creates one)")
    revision = MigrationContext.configure(connection).get_current_revision()
    config = _alembic_config(connection)
    script = ScriptDirectory.from_config(config)  # type: ignore[arg-type]
    if revision is not None:
        try:
            script.get_revision(revision)
        except Exception:  # alembic raises several kinds for a revision it does not know
            raise LogError(
                f"the conversation log {display_url} was written by a newer chatcore "
                f"(revision {revision}; this one knows up to {_revision(SCHEMA_VERSION)}); "
                "upgrade chatcore"
            ) from None
    if "chatcore_schema" in tables:
        version = _schema_version(connection, tables, revision, display_url)
        if revision is None:  # a log from before Alembic
            command.stamp(config, _revision(version))  # type: ignore[arg-type]
    elif tables & _LOG_TABLES:
        raise LogError(
            f"{display_url} has a {sorted(tables & _LOG_TABLES)[0]!r} table but no chatcore schema "
            "version; it is not a chatcore conversation log"
        )
    command.upgrade(config, "head")  # type: ignore[arg-type]


def _schema_version(connection: sa.Connection, tables: set[str], revision: str | None, display_url: str) -> int:
    """The version in ``chatcore_schema``: checked, and restored when its row was deleted."""
    versions = connection.execute(sa.text("SELECT version FROM chatcore_schema")).scalars().all()
    if not versions:
        if revision is not None:
            version = int(revision)
        elif _LOG_TABLES <= tables:
            version = 1  # the only version without an Alembic revision
        else:
            raise LogError(
                f"the conversation log {display_url} is damaged: its schema version row and tables are missing"
            )
        connection.execute(
            sa.text("INSERT INTO chatcore_schema (id, version) VALUES (1, :version)"), {"version": version}
        )
        return version
    version = versions[0]
    if len(versions) > 1 or not isinstance(version, int) or version < 1:
        raise LogError(
            f"the conversation log {display_url} is damaged: schema version {versions!r} is not one chatcore writes"
        )
    if version > SCHEMA_VERSION:
        raise LogError(
            f"the conversation log {display_url} was written by a newer chatcore "
            f"(schema {version}; this one reads up to {SCHEMA_VERSION}); upgrade chatcore"
        )
    if revision is not None and int(revision) != version:
        raise LogError(
            f"the conversation log {display_url} is damaged: schema version {version} but revision {revision}"
        )
    return version
