"""Damaged SQLite files: a quick integrity check, and reading back whatever is still readable."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from chatcore.log.connection import reason
from chatcore.log.errors import LogError
from chatcore.log.models import ConversationRow, MessageRow
from chatcore.log.reading import StoreReading
from chatcore.log.records import ConversationRecord, MessageRecord


class StoreSalvage(StoreReading):
    """Checking a file for damage (before writing to it) and `chatcore logs export --salvage`."""

    def quick_check(self) -> str | None:
        """SQLite's ``PRAGMA quick_check``: None when the file is sound, else the first problem."""
        if not self.is_sqlite:
            return None
        try:
            with self.db.connect() as connection:
                problems = [row[0] for row in connection.exec_driver_sql("PRAGMA quick_check(5)")]
        except SQLAlchemyError as error:
            return reason(error)
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
            problems.append(f"{sql.split(' FROM ')[1].split()[0]}: {reason(error)}")

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
                conversation = session.get(ConversationRow, conversation_id)
                head = (
                    (
                        conversation.created,
                        conversation.updated,
                        conversation.adapter,
                        conversation.channel_key,
                        conversation.model,
                        conversation.title,
                    )
                    if conversation
                    else None
                )
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
