"""The conversation log's reads: look-up by id prefix, listing, counts, whole conversations, search, resuming.

Search uses an SQLite FTS5 trigram index where SQLite has one (substring matches,
case-insensitive, three characters or more), on PostgreSQL ``ILIKE`` served by a
pg_trgm GIN index, and ``LIKE`` otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from chatcore.log.connection import StoreConnection
from chatcore.log.errors import LogError, UnknownConversationError
from chatcore.log.models import ConversationRow, MessageRow
from chatcore.log.normalise import Normaliser
from chatcore.log.records import (
    ConversationRecord,
    ConversationSummary,
    MessageRecord,
    SearchHit,
)
from chatcore.text import shown_argument

if TYPE_CHECKING:
    from chatcore.conversation import Conversation, Role, Turn

_FTS_MIN_CHARS = 3  # a trigram index cannot answer shorter queries


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


class StoreReading(StoreConnection):
    """Reading conversations and messages back from the log."""

    def resolve_id(self, conversation_id: str) -> str:
        """The full id of the conversation whose id is, or starts with, ``conversation_id``."""
        if not isinstance(conversation_id, str):
            shown = shown_argument(conversation_id)
            raise LogError(f"a conversation id is a string (`chatcore logs list` shows them), got {shown}")
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
        only those messages (what a person asking for their data gets); the id as the
        adapter gave it (an over-long one is found by its stored digest).
        """
        if author_id is not None:
            author_id = Normaliser().author_id(author_id)
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

    def search(self, text: str, limit: int = 50) -> list[SearchHit]:
        """Messages containing ``text`` (case-insensitive), newest first."""
        if not isinstance(text, str):
            raise LogError(f"the search text must be a string, got {shown_argument(text)}")
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
        return self._turns(self.get_conversation(conversation_id, include_superseded=False).messages)

    @staticmethod
    def _turns(messages: Sequence[MessageRecord]) -> list["Turn"]:
        from chatcore.conversation import Turn

        turns = []
        for message in messages:
            meta: dict[str, Any] = {"log_message_id": message.id}
            if message.role == "bot":
                meta["provenance"] = message.full_provenance()
            role: Role = "bot" if message.role == "bot" else "user"
            turns.append(Turn(role, message.text, message.created, message.interrupted, meta))
        return turns

    def resume(self, conversation_id: str) -> "Conversation":
        """A live Conversation with the logged turns, id and meta; new turns log to the same row."""
        from chatcore.conversation import Conversation

        record = self.get_conversation(conversation_id)
        meta = dict(record.meta)
        meta.update(adapter=record.adapter, channel_key=record.channel_key, title=record.title)
        shown = [message for message in record.messages if not message.superseded]
        conversation = Conversation(id=record.id, turns=self._turns(shown), system=record.system, **meta)
        conversation.logged_up_to = max((message.id for message in record.messages), default=0)
        return conversation
