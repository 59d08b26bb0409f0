"""The log's tables, as SQLAlchemy 2.x declarative models.

    chatcore_schema   one row: the schema version this file was written with
    alembic_version   the Alembic revision the schema is at (see ``migrations/``)
    conversations     id (the Conversation's uuid hex), created, updated, adapter,
                      channel key, model, title, system prompt, prompt format, meta
    messages          one row per turn: role, text, created, author, token counts,
                      latency, decoder and steerers with settings, candidates and
                      scores, seed, interrupted and superseded flags, other
                      provenance, the key of the write that stored it and
                      the writer (chat) that made it

These classes describe the newest schema for queries; the tables themselves are
created and changed only by the Alembic revisions in ``migrations/versions``.

Times are stored as naive UTC (SQLite has no time zones) and come back as aware UTC.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

SCHEMA_VERSION = 3
"""The version the newest migration writes into ``chatcore_schema``; revision ``000N`` is version N."""


class UTCDateTime(TypeDecorator[datetime]):
    """Aware datetimes in, aware UTC datetimes out, naive UTC in the database."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is not None:
            value = value.astimezone(timezone.utc).replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON}


class SchemaVersion(Base):
    __tablename__ = "chatcore_schema"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)


class ConversationRow(Base):
    __tablename__ = "conversations"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created: Mapped[datetime] = mapped_column(default=utc_now)
    # The time of the newest message: "recent conversations" are listed by it.
    updated: Mapped[datetime] = mapped_column(default=utc_now)
    adapter: Mapped[str | None] = mapped_column(String(64))
    channel_key: Mapped[str | None] = mapped_column(String(255))
    model: Mapped[str | None] = mapped_column(String(255))
    title: Mapped[str | None] = mapped_column(String(255))
    system: Mapped[str | None] = mapped_column(Text)  # the system prompt, restored on resume
    prompt_format: Mapped[str | None] = mapped_column(String(64))  # the format the replies were made in
    meta: Mapped[dict[str, Any]] = mapped_column(default=dict)

    messages: Mapped[list["MessageRow"]] = relationship(
        back_populates="conversation",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="MessageRow.id",
    )

    __table_args__ = (
        Index("ix_conversations_updated", "updated"),
        Index("ix_conversations_created", "created"),
        Index("ix_conversations_channel_updated", "channel_key", "updated"),
        Index("ix_conversations_adapter_updated", "adapter", "updated"),
    )


class MessageRow(Base):
    __tablename__ = "messages"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(String(64), ForeignKey("conversations.id", ondelete="CASCADE"))
    role: Mapped[str] = mapped_column(String(16))
    text: Mapped[str] = mapped_column(Text)
    created: Mapped[datetime] = mapped_column(default=utc_now)
    # Who wrote a user message (a Discord user id): `logs delete --author` honours deletion requests.
    author_id: Mapped[str | None] = mapped_column(String(64))
    token_count: Mapped[int | None] = mapped_column(Integer)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    latency_s: Mapped[float | None] = mapped_column(Float)
    first_token_s: Mapped[float | None] = mapped_column(Float)
    decoder: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    steerers: Mapped[list[Any] | None] = mapped_column(JSON)
    candidates: Mapped[list[Any] | None] = mapped_column(JSON)
    seed: Mapped[int | None] = mapped_column(BigInteger)
    interrupted: Mapped[bool] = mapped_column(Boolean, default=False)
    # A reply replaced by a regenerated one (/retry): kept for the record, left out on resume.
    superseded: Mapped[bool] = mapped_column(Boolean, default=False)
    provenance: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # A write replayed after a fault (or from the spill journal) finds its own row and
    # is not stored twice.
    write_key: Mapped[str | None] = mapped_column(String(32))
    # The chat (log writer) that stored it: one writer per conversation (see writing.py).
    writer: Mapped[str | None] = mapped_column(String(32))

    conversation: Mapped[ConversationRow] = relationship(back_populates="messages")

    __table_args__ = (
        Index("ix_messages_conversation_id", "conversation_id", "id"),
        Index("ix_messages_created", "created"),
        Index("ix_messages_author_id", "author_id"),
        Index("ux_messages_write_key", "write_key", unique=True),
    )
