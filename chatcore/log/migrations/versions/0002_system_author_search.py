"""Schema version 2: system prompts, authors, idempotent writes, and indexed search.

- ``conversations.system`` and ``conversations.prompt_format``: the system prompt is
  restored when a conversation is resumed;
- ``messages.author_id`` (indexed): who wrote a message, for deletion requests;
- ``messages.write_key`` (unique): a write that is replayed (after a fault, or from
  the spill journal) finds its row instead of storing the message twice;
- search: on SQLite an FTS5 trigram index kept in step by triggers (rebuilt whole
  here, because logs of version 1 could hold a half-made one: their DDL ran outside
  a transaction); on PostgreSQL a pg_trgm GIN index that serves ``ILIKE``.
  Where neither can be made (no FTS5, no permission to add pg_trgm), search scans.
"""

import sqlite3

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_SQLITE_FTS = (
    "DROP TRIGGER IF EXISTS messages_fts_insert",
    "DROP TRIGGER IF EXISTS messages_fts_delete",
    "DROP TRIGGER IF EXISTS messages_fts_update",
    "DROP TABLE IF EXISTS messages_fts",
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
_POSTGRES_TRGM = (
    "CREATE EXTENSION IF NOT EXISTS pg_trgm",
    "CREATE INDEX ix_messages_text_trgm ON messages USING gin (text gin_trgm_ops)",
)


def _try_all(statements: tuple[str, ...]) -> None:
    """Run the statements in a savepoint: all of them, or none when one fails."""
    bind = op.get_bind()
    try:
        with bind.begin_nested():
            for statement in statements:
                bind.exec_driver_sql(statement)
    except sa.exc.DBAPIError:
        pass


def upgrade() -> None:
    op.add_column("conversations", sa.Column("system", sa.Text))
    op.add_column("conversations", sa.Column("prompt_format", sa.String(64)))
    op.add_column("messages", sa.Column("author_id", sa.String(64)))
    op.add_column("messages", sa.Column("write_key", sa.String(32)))
    op.create_index("ix_messages_author_id", "messages", ["author_id"])
    op.create_index("ux_messages_write_key", "messages", ["write_key"], unique=True)
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite" and sqlite3.sqlite_version_info >= (3, 34):  # the trigram tokenizer's first release
        _try_all(_SQLITE_FTS)
    elif dialect == "postgresql":
        _try_all(_POSTGRES_TRGM)
    op.execute(sa.text("UPDATE chatcore_schema SET version = 2"))
