"""The exchanges ``chatcore serve`` answers, written to the conversation log.

An HTTP client sends the whole conversation with every request, so a request becomes
a conversation in the log (adapter ``http``) the first time its history is seen: its
system prompt, the turns it brings and the reply. A later request whose messages are
exactly an earlier request's messages plus that reply, then a new user message (what a
chat client sends for the next turn), and that names the same ``user`` (OpenAI's field
for the end user; none alike), continues the same conversation: only its new user
message and the reply are written. Two end users who send the same words never share a
conversation, and the ``user`` is kept as the author of the user's messages
(``chatcore logs delete --author USER`` removes them). Continuations are recognised in
memory for the newest ``MAX_THREADS`` conversations; after a restart the next turn starts
a new one.

Writing never slows or fails a request: the log and its store live on a thread of
their own, the handler only queues the exchange, and a database that fails keeps its
writes in the log's journal (see :mod:`chatcore.log.plugin`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatcore.adapters.http_api.exchange_hooks import ExchangeHooks
    from chatcore.conversation import Conversation
    from chatcore.engine import Engine
    from chatcore.log.plugin import ConversationLogPlugin
    from chatcore.log.store import ConversationStore
    from chatcore.prompting import Message

logger = logging.getLogger("chatcore.serve")

ADAPTER = "http"
MAX_THREADS = 10_000


@dataclass
class Exchange:
    """One answered request: the messages it sent and the reply it got."""

    messages: "list[Message]"
    reply: str
    provenance: dict[str, Any] = field(default_factory=dict)
    interrupted: bool = False
    received: "datetime | None" = None  # when the request came (its messages' time in the log)
    finished: "datetime | None" = None  # when its reply ended (the reply's time)
    user: str | None = None  # the request's ``user``: the end user, author of the user's messages
    token_ids: list[int] = field(default_factory=list)  # the reply's tokens, as decoded


def thread_key(messages: "Sequence[Message]", user: str | None = None) -> str:
    """A digest of a conversation's messages (roles and texts, system prompt included) and
    of the end user who sends them."""
    data = json.dumps([user, [[message.role, message.text] for message in messages]], ensure_ascii=False)
    return hashlib.sha256(data.encode("utf-8", "surrogatepass")).hexdigest()


class Threads:
    """Which conversation a request continues: by its messages and end user, for the newest
    ``MAX_THREADS`` conversations (see the module's docstring)."""

    def __init__(self) -> None:
        self._threads: OrderedDict[str, str] = OrderedDict()  # thread key -> conversation id

    def continued(self, exchange: Exchange) -> str | None:
        """The id of the conversation ``exchange`` continues (forgotten here: it is remembered
        again with the reply), or None."""
        history = exchange.messages[:-1]
        return self._threads.pop(thread_key(history, exchange.user), None) if history else None

    def remember(self, exchange: Exchange, conversation_id: str) -> None:
        """``exchange`` with its reply is ``conversation_id`` so far."""
        key = thread_key([*exchange.messages, _assistant(exchange.reply)], exchange.user)
        self._threads[key] = conversation_id
        while len(self._threads) > MAX_THREADS:
            self._threads.popitem(last=False)


def exchange_conversation(exchange: Exchange, engine: "Engine", conversation_id: str | None = None) -> "Conversation":
    """``exchange`` as a conversation: its messages, then the reply (a new id unless given)."""
    from chatcore.conversation import Conversation, Turn

    system = next((m.text for m in exchange.messages if m.role == "system"), None)
    now = datetime.now(timezone.utc)
    received, finished = exchange.received or now, exchange.finished or now
    author = {"author_id": exchange.user} if exchange.user else {}
    history = [m for m in exchange.messages if m.role != "system"]
    # One microsecond apart, in order: a turn that repeats an earlier one ("ok" twice) is a
    # write of its own, not taken for the same turn written again (the write key holds the time).
    times = [received + timedelta(microseconds=index) for index in range(len(history))]
    turns = [
        Turn("user", m.text, created=at, meta=dict(author)) if m.role == "user" else Turn("bot", m.text, created=at)
        for m, at in zip(history, times)
    ]
    turns.append(
        Turn(
            "bot",
            exchange.reply,
            created=max(finished, received + timedelta(microseconds=len(history))),
            interrupted=exchange.interrupted,
            meta={"provenance": exchange.provenance},
        )
    )
    return Conversation(
        id=conversation_id,
        turns=turns,
        system=system,
        # the format the reply was made with: "raw" for /v1/completions' prompts
        prompt_format=str(exchange.provenance.get("prompt_format") or engine.prompt_format.name),
        adapter=ADAPTER,
    )


class RequestLog:
    """Queues exchanges for the conversation log, written on the log's own thread."""

    def __init__(self, db: str | None = None, engine: "Engine | None" = None) -> None:
        self.engine = engine  # set before the first exchange (the log is opened before the model loads)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatcore-http-log")
        self._threads = Threads()
        self.hooks: "ExchangeHooks | None" = None  # the plugins' turn hooks, fired once each exchange is written
        self._closed = False
        self.store: "ConversationStore | None" = None
        self.plugin: "ConversationLogPlugin | None" = None
        # Opened on the log's thread, which then owns the connection; a log that cannot be
        # opened fails here, at start, in one line.
        self._executor.submit(self._open, db).result()

    def _open(self, db: str | None) -> None:
        from chatcore.log.location import resolve_url
        from chatcore.log.plugin import ConversationLogPlugin
        from chatcore.log.store import ConversationStore

        self.store = ConversationStore(resolve_url(db))
        self.plugin = ConversationLogPlugin(self.store, notify=lambda message: logger.warning("%s", message))

    @property
    def display_url(self) -> str:
        assert self.store is not None
        return self.store.display_url

    def record(self, exchange: Exchange) -> None:
        """Queue ``exchange``; returns at once and never raises."""
        try:
            self._executor.submit(self._write, exchange)
        except RuntimeError:  # closed: the server is stopping
            logger.warning("the conversation log is closed: an exchange was not logged")

    def flush(self) -> None:
        """Wait until every exchange queued so far is in the database (or its journal)."""

        def written() -> None:
            if self.plugin is not None:
                self.plugin.flush()

        self._executor.submit(written).result()

    def _write(self, exchange: Exchange) -> None:
        written: str | None = None
        try:
            assert self.plugin is not None and self.engine is not None
            continued = self._threads.continued(exchange)
            conversation = exchange_conversation(exchange, self.engine, continued)
            # A continued conversation has its earlier turns in the log already.
            turns = conversation.turns
            self.plugin.log_conversation(conversation, self.engine.loaded, start=len(turns) - 2 if continued else 0)
            self._threads.remember(exchange, conversation.id)
            written = conversation.id
        except Exception:  # the log must never take the server down
            logger.exception("logging an exchange failed")
        if self.hooks is not None:  # after the write, with its id: a plugin finds the turn in the log
            self.hooks.fire(exchange, written)

    def close(self) -> None:
        """Write what is queued (what the database cannot take waits in the journal) and close.
        Idempotent."""
        if self._closed:
            return
        self._closed = True

        def close_log() -> None:
            if self.plugin is not None:
                journaled = self.plugin.close()
                if journaled:
                    logger.warning("conversation log: %d write(s) kept in the journal for the next start", journaled)
                lost = self.plugin.pending - journaled + self.plugin.dropped
                if lost > 0:
                    logger.warning("conversation log: %d write(s) could not be saved", lost)
            if self.store is not None:
                self.store.close()

        self._executor.submit(close_log).result()
        self._executor.shutdown()


def _assistant(reply: str) -> "Message":
    """The reply as the next request of the conversation will carry it."""
    from chatcore.adapters.http_api.completions import history_text
    from chatcore.prompting import Message

    try:
        return Message("assistant", history_text(reply))
    except Exception:  # an empty reply: the client cannot send it back as it was
        return Message("assistant", reply)
