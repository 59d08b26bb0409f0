"""The conversation log's writes: conversations, messages (retry-safe), retried replies, deletions.

Every write is its own transaction, committed before the call returns. Values a
database cannot hold are made to fit where they enter, alike on every backend, and the
change is noted in the row (:mod:`~chatcore.log.normalise`), so no message is refused
for its content.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from chatcore.log.errors import AwaitingReplyError, ConversationDeletedError, ConversationTakenError, LogError
from chatcore.log.models import ConversationRow, MessageRow, utc_now
from chatcore.log.normalise import NUL_SYMBOL, REPLACEMENT, Normaliser, storable
from chatcore.log.reading import StoreReading
from chatcore.log.turn_writes import title_from

__all__ = ["NUL_SYMBOL", "REPLACEMENT", "StoreWriting", "storable"]


def _rowcount(result: sa.Result[Any]) -> int:
    """The rows an INSERT, UPDATE or DELETE touched (SQLAlchemy runs those into a CursorResult)."""
    return int(cast("sa.CursorResult[Any]", result).rowcount or 0)


class StoreWriting(StoreReading):
    """Adding conversations and messages to the log, and deleting them."""

    superseded_deleted = 0
    """How many of the messages the latest deletion removed were replies superseded by a retry, which
    ``chatcore logs list`` does not count as turns."""

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
        clean = Normaliser()
        values = dict(
            id=conversation_id,
            created=created,
            updated=created,
            adapter=clean.text(fields.get("adapter"), "adapter", 64),
            channel_key=clean.text(fields.get("channel_key"), "channel_key", 255),
            model=clean.text(fields.get("model"), "model", 255),
            title=title and clean.text(title[:255], "title"),
            system=clean.text(fields.get("system"), "system"),
            prompt_format=clean.text(fields.get("prompt_format"), "prompt_format", 64),
            meta=clean.json(dict(fields.get("meta") or {}), "meta"),
        )
        values["meta"] = clean.noted(values["meta"])
        if self.is_sqlite or self.is_postgres:
            if self.is_sqlite:
                from sqlalchemy.dialects.sqlite import insert
            else:
                from sqlalchemy.dialects.postgresql import insert  # type: ignore[assignment]
            inserted = session.execute(insert(ConversationRow).values(**values).on_conflict_do_nothing())
            return bool(_rowcount(inserted))
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
        writer: str | None = None,
        writer_since: int = 0,
        written_before: bool = False,
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

        ``writer``: who writes (one id per chat); with it, a message written into the
        conversation by another writer after message id ``writer_since`` (the newest one
        this writer has read), or another writer's message at the conversation's end still
        waiting for its reply, raises :class:`ConversationTakenError` instead of
        interleaving two chats (:meth:`release` gives up such a message), and a retried
        reply supersedes only this writer's replies and those it had read.

        ``written_before``: the writer has written into this conversation already; if its
        row is gone (deleted meanwhile), :class:`ConversationDeletedError` is raised rather
        than the conversation made again under its old id.
        """
        try:
            return self._insert_message(
                conversation_id,
                role,
                text,
                created=created or utc_now(),
                author_id=author_id,
                token_count=token_count,
                prompt_tokens=prompt_tokens,
                latency_s=latency_s,
                first_token_s=first_token_s,
                decoder=decoder,
                steerers=steerers,
                candidates=candidates,
                seed=seed,
                interrupted=interrupted,
                provenance=provenance,
                keep_replies=keep_replies,
                write_key=write_key,
                conversation=conversation,
                writer=writer,
                writer_since=writer_since,
                written_before=written_before,
            )
        except LogError as error:
            # The same write committed by another attempt meanwhile (one that outlived its
            # deadline, then finished): it is stored, once.
            if write_key is not None and isinstance(error.__cause__, IntegrityError):
                with self._session("add a message") as session:
                    stored = session.scalar(sa.select(MessageRow.id).where(MessageRow.write_key == write_key))
                if stored is not None:
                    return int(stored)
            raise

    def _insert_message(
        self,
        conversation_id: str,
        role: str,
        text: str,
        *,
        created: datetime,
        author_id: str | None,
        token_count: int | None,
        prompt_tokens: int | None,
        latency_s: float | None,
        first_token_s: float | None,
        decoder: dict[str, Any] | None,
        steerers: list[Any] | None,
        candidates: list[Any] | None,
        seed: int | None,
        interrupted: bool,
        provenance: dict[str, Any] | None,
        keep_replies: int | None,
        write_key: str | None,
        conversation: dict[str, Any] | None,
        writer: str | None,
        writer_since: int,
        written_before: bool,
    ) -> int:
        with self._session("add a message", write=True) as session:
            if write_key is not None:
                stored = session.scalar(sa.select(MessageRow.id).where(MessageRow.write_key == write_key))
                if stored is not None:
                    return int(stored)
            if written_before and session.get(ConversationRow, conversation_id) is None:
                raise ConversationDeletedError(f"conversation {conversation_id} was deleted from the log")
            if writer is not None:
                self._check_writer(session, conversation_id, writer, writer_since)
            if conversation is not None:
                self._ensure(session, conversation_id, conversation)
            if keep_replies is not None:
                self._supersede_replies(session, conversation_id, keep_replies, writer, writer_since)
            clean = Normaliser()
            row = MessageRow(
                conversation_id=conversation_id,
                role=role,
                text=clean.text(text, "text"),
                created=created,
                author_id=clean.author_id(author_id),
                token_count=clean.integer(token_count, "token_count"),
                prompt_tokens=clean.integer(prompt_tokens, "prompt_tokens"),
                latency_s=clean.real(latency_s, "latency_s"),
                first_token_s=clean.real(first_token_s, "first_token_s"),
                decoder=clean.json(decoder, "decoder"),
                steerers=clean.json(steerers, "steerers"),
                candidates=clean.json(candidates, "candidates"),
                seed=clean.integer(seed, "seed"),
                interrupted=interrupted,
                superseded=False,
                provenance=clean.json(provenance, "provenance"),
                write_key=write_key,
                writer=writer,
            )
            row.provenance = clean.noted(row.provenance)
            session.add(row)
            session.flush()
            current: dict[str, Any] = {"updated": created}
            if conversation is not None:  # a system prompt or format changed mid-conversation is kept as it is now
                current.update(system=clean.text(conversation.get("system"), "system"))
                if conversation.get("prompt_format") is not None:  # None: the engine's, which names none
                    current.update(prompt_format=clean.text(conversation.get("prompt_format"), "prompt_format", 64))
            session.execute(sa.update(ConversationRow).where(ConversationRow.id == conversation_id).values(**current))
            return row.id

    @staticmethod
    def _check_writer(session: Session, conversation_id: str, writer: str, since: int) -> None:
        """Raise :class:`ConversationTakenError` when another chat writes ``conversation_id``: it wrote
        there after message ``since`` (the newest one ``writer`` has read), or the conversation ends
        with its message still waiting for a reply (:class:`AwaitingReplyError`: that chat may be
        replying to it, and its reply would come after this writer's turns)."""
        other = session.scalar(
            sa.select(MessageRow.writer)
            .where(
                MessageRow.conversation_id == conversation_id,
                MessageRow.id > since,
                MessageRow.writer.is_not(None),
                MessageRow.writer != writer,
            )
            .limit(1)
        )
        if other is not None:
            raise ConversationTakenError(f"conversation {conversation_id} is being written by another chat as well")
        newest = session.execute(
            sa.select(MessageRow.role, MessageRow.writer)
            .where(MessageRow.conversation_id == conversation_id)
            .order_by(MessageRow.id.desc())
            .limit(1)
        ).first()
        if newest is not None and newest.role == "user" and newest.writer not in (None, writer):
            raise AwaitingReplyError(
                f"conversation {conversation_id} ends with another chat's message still waiting for its reply"
            )

    def release(self, conversation_id: str, writer: str) -> bool:
        """The chat ``writer`` has ended with its message at the end of ``conversation_id`` still
        waiting for a reply (the reply failed or was stopped): the message is no longer that chat's,
        so another may go on after it (see ``writer`` in :meth:`add_message`). True if it was."""
        with self._session("release a conversation", write=True) as session:
            newest = session.scalar(
                sa.select(sa.func.max(MessageRow.id)).where(MessageRow.conversation_id == conversation_id)
            )
            released = session.execute(
                sa.update(MessageRow)
                .where(MessageRow.id == newest, MessageRow.role == "user", MessageRow.writer == writer)
                .values(writer=None)
            )
            return bool(_rowcount(released))

    def _supersede_replies(
        self, session: Session, conversation_id: str, keep: int, writer: str | None, since: int = 0
    ) -> None:
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
                # Only this chat's own replies, or those it had read (a resumed conversation's):
                # another chat's, written since, are never taken for retried ones.
                sa.true()
                if writer is None
                else sa.or_(MessageRow.writer.is_(None), MessageRow.writer == writer, MessageRow.id <= since),
            )
            .order_by(MessageRow.id)
        ).all()
        dropped = list(replies[keep:])
        if dropped:
            session.execute(sa.update(MessageRow).where(MessageRow.id.in_(dropped)).values(superseded=True))

    def keep_system(self, conversation_id: str, system: str | None) -> bool:
        """Keep ``system`` as the logged conversation's system prompt (one changed after its last
        message: messages carry it otherwise); True if it changed, False if the conversation is
        not in the log or already has it."""
        cleaned = Normaliser().text(system, "system")
        with self._session("read a system prompt") as session:  # most chats end with it unchanged: no write lock
            row = session.get(ConversationRow, conversation_id)
            if row is None or row.system == cleaned:
                return False
        with self._session("keep a system prompt", write=True) as session:
            session.execute(
                sa.update(ConversationRow).where(ConversationRow.id == conversation_id).values(system=cleaned)
            )
            return True

    def delete_conversation(self, conversation_id: str) -> int:
        """Delete a conversation (id or unique prefix) and its messages; returns the message count
        (superseded replies included: :attr:`superseded_deleted` says how many)."""
        full_id = self.resolve_id(conversation_id)
        self.superseded_deleted = 0
        with self._session("delete a conversation", write=True) as session:
            superseded = _superseded_count(session, MessageRow.conversation_id == full_id)
            deleted = session.execute(sa.delete(MessageRow).where(MessageRow.conversation_id == full_id))
            session.execute(sa.delete(ConversationRow).where(ConversationRow.id == full_id))
        self.superseded_deleted = superseded
        return _rowcount(deleted)

    def delete_author(self, author_id: str) -> int:
        """Delete every message written by ``author_id`` (a deletion request); returns the count
        (superseded replies included: :attr:`superseded_deleted` says how many).

        Conversations keep the other messages; one left with none is deleted too, and one titled by
        the author's message is titled by what remains (:func:`_retitle`). ``author_id`` is the id as
        the adapter gave it (an over-long one is found by its stored digest).
        """
        author_id = Normaliser().author_id(author_id) or ""
        self.superseded_deleted = 0
        by_author = MessageRow.author_id == author_id
        with self._session("delete an author's messages", write=True) as session:
            firsts: dict[str, str] = {}  # conversation -> the author's first message in it
            for conversation_id, text in session.execute(
                sa.select(MessageRow.conversation_id, MessageRow.text).where(by_author).order_by(MessageRow.id.desc())
            ):
                firsts[conversation_id] = text
            superseded = _superseded_count(session, by_author)
            deleted = session.execute(sa.delete(MessageRow).where(by_author))
            still_used = sa.select(MessageRow.id).where(MessageRow.conversation_id == ConversationRow.id).exists()
            session.execute(sa.delete(ConversationRow).where(ConversationRow.id.in_(list(firsts)), ~still_used))
            for conversation_id, text in firsts.items():
                _retitle(session, conversation_id, title_from(text))
        self.superseded_deleted = superseded
        return _rowcount(deleted)


def _superseded_count(session: Session, which: sa.ColumnElement[bool]) -> int:
    """How many of the messages ``which`` selects are replies superseded by a retry."""
    return int(
        session.scalar(sa.select(sa.func.count(MessageRow.id)).where(which, MessageRow.superseded.is_(True))) or 0
    )


def _retitle(session: Session, conversation_id: str, deleted_title: str) -> None:
    """A conversation is titled by its first user message: when the title is that of a message just
    deleted, it is titled by the first message that remains instead (a user's, else a reply shown,
    else any), never left empty in ``chatcore logs list``."""
    remaining = (
        sa.select(MessageRow.text)
        .where(MessageRow.conversation_id == conversation_id)
        .order_by(MessageRow.superseded, MessageRow.role != "user", MessageRow.id)
        .limit(1)
    )
    first = session.scalar(remaining)
    if first is None:
        return  # the conversation went with its last message
    session.execute(
        sa.update(ConversationRow)
        .where(ConversationRow.id == conversation_id, ConversationRow.title == deleted_title)
        .values(title=title_from(first))
    )
