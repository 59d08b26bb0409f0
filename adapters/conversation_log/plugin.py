"""The log as a plugin: ``on_user_message`` and ``on_response`` write each turn to a store.

An adapter decides which conversations are logged by registering a plugin object
that holds its own store::

    store = ConversationStore(resolve_url(db_option))
    engine.host.register(ConversationLogPlugin(store, notify=show_to_user), "conversation-log")

(the REPL does this unless ``--no-log``; a Discord bot registers one with its own
store). One-shot commands such as ``generate`` and ``eval`` register none, so they
leave no trace in the log.

A database that is unavailable, locked or read-only never stops the chat: the write
is kept in memory, ``notify`` is called once with the reason, and the kept writes go
out, in order, with a later turn that finds the database working again. While it
fails, it is tried again at most every ``retry_after_s`` seconds, so that a locked
file does not add its busy timeout to every turn.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import chatcore
from chatcore.errors import ChatcoreError

if TYPE_CHECKING:
    from chatcore.adapters.conversation_log.store import ConversationStore
    from chatcore.conversation import Conversation, Turn
    from chatcore.response import Response

logger = logging.getLogger("chatcore.conversation_log")

MAX_PENDING_WRITES = 10_000
TITLE_CHARS = 80
_CONVERSATION_COLUMNS = ("adapter", "channel_key", "title")

Write = Callable[[], None]


def json_safe(value: Any) -> Any:
    """``value`` as plain JSON types (tuples become lists, unknown objects their str)."""
    return json.loads(json.dumps(value, default=str))


def title_from(text: str) -> str:
    return text if len(text) <= TITLE_CHARS else text[: TITLE_CHARS - 1].rstrip() + "…"


class ConversationLogPlugin:
    """Persists every turn of the conversations on its host to ``store``.

    ``notify(message)`` tells the person in front of the adapter about a failing log
    (once per outage) and about its recovery.
    """

    def __init__(self, store: "ConversationStore", notify: Callable[[str], None] | None = None,
                 retry_after_s: float = 30.0) -> None:
        self.store = store
        self.notify = notify or (lambda message: logger.warning("%s", message))
        self.retry_after_s = retry_after_s
        self.failing: str | None = None  # the reason, while writes fail
        self._failed_at = 0.0
        self.dropped = 0  # writes given up because too many were waiting
        self._pending: list[Write] = []
        self._known: set[str] = set()
        self._lock = threading.Lock()

    # -- hooks ----------------------------------------------------------------------
    @chatcore.hookimpl
    def on_user_message(self, conversation: "Conversation", turn: "Turn") -> None:
        fields = {"token_count": self._count_tokens(conversation, turn.text)}
        self._submit(conversation, self._message_write(conversation.id, "user", turn, fields))

    @chatcore.hookimpl
    def on_response(self, conversation: "Conversation", response: "Response") -> None:
        turn = conversation.turns[-1]  # the bot turn just recorded for this response
        provenance = json_safe(response.provenance)
        timings = provenance.get("timings") or {}
        fields = {
            "token_count": len(response.token_ids),
            "prompt_tokens": provenance.get("prompt_tokens"),
            "latency_s": timings.get("total_s"),
            "first_token_s": timings.get("first_token_s"),
            "decoder": provenance.get("decoder"),
            "steerers": provenance.get("steerers"),
            "candidates": provenance.pop("candidates", None),
            "seed": provenance.get("seed"),
            "provenance": provenance,
            "keep_replies": self._replies_kept(conversation),
        }
        self._submit(conversation, self._message_write(conversation.id, "bot", turn, fields))

    # -- what to write ---------------------------------------------------------------
    @staticmethod
    def _count_tokens(conversation: "Conversation", text: str) -> int | None:
        try:
            from chatcore.text import encode_text

            return len(encode_text(conversation.engine.tokenizer, text))
        except Exception:  # a count is nice to have; never worth losing the message
            return None

    @staticmethod
    def _replies_kept(conversation: "Conversation") -> int:
        """Bot turns after the newest user turn, not counting the one just added.

        A regenerated reply (/retry) replaces the previous one in memory; the log
        keeps the old one but marks it superseded, so resuming gives the same turns.
        """
        kept = 0
        for turn in reversed(conversation.turns[:-1]):
            if turn.role != "bot":
                break
            kept += 1
        return kept

    def _message_write(self, conversation_id: str, role: str, turn: "Turn", fields: dict[str, Any]) -> Write:
        text, created, interrupted = turn.text, turn.created, turn.interrupted

        def write() -> None:
            self.store.add_message(conversation_id, role, text, created=created, interrupted=interrupted, **fields)

        return write

    def _conversation_write(self, conversation: "Conversation") -> Write:
        meta = json_safe(conversation.meta)
        columns = {key: meta.pop(key, None) for key in _CONVERSATION_COLUMNS}
        first_user = next((t for t in conversation.turns if t.role == "user"), None)
        title = columns["title"] or (title_from(first_user.text) if first_user else None)
        created = conversation.turns[0].created if conversation.turns else None
        model = getattr(getattr(conversation.engine, "loaded", None), "name", None)
        conversation_id = conversation.id

        def write() -> None:
            self.store.ensure_conversation(
                conversation_id, created=created, adapter=columns["adapter"], channel_key=columns["channel_key"],
                model=model, title=title, meta=meta,
            )

        return write

    # -- writing ----------------------------------------------------------------------
    def _submit(self, conversation: "Conversation", write: Write) -> None:
        with self._lock:
            if conversation.id not in self._known:  # its row is written (or waiting) once
                self._known.add(conversation.id)
                self._pending.append(self._conversation_write(conversation))
            self._pending.append(write)
            if len(self._pending) > MAX_PENDING_WRITES:
                overflow = len(self._pending) - MAX_PENDING_WRITES
                del self._pending[:overflow]
                self.dropped += overflow
            if self.failing is None or time.monotonic() - self._failed_at >= self.retry_after_s:
                self._flush()

    def _flush(self) -> None:
        written = 0
        while self._pending:
            try:
                self._pending[0]()
            except ChatcoreError as error:  # the store turns every database failure into LogError
                if self.failing is None:
                    self.notify(f"conversation log unavailable ({error}); the chat goes on and "
                                "turns are written when it works again")
                self.failing = str(error)
                self._failed_at = time.monotonic()
                return
            self._pending.pop(0)
            written += 1
        if self.failing is not None:
            self.failing = None
            self.notify(f"conversation log available again; {written} waiting write(s) saved")

    @property
    def pending(self) -> int:
        """Writes kept in memory because the database failed."""
        return len(self._pending)

    def flush(self) -> bool:
        """Try the waiting writes now, however recently they failed; True when none is left."""
        with self._lock:
            self._flush()
            return not self._pending
