"""Where the bot's conversations come from and go to.

Each channel, thread or DM has one current conversation, found by its channel key
(``guild/channel/thread``, see :func:`chatcore.adapters.discord_bot.routing.conversation_key`).
With the conversation log, the newest logged conversation of a key is resumed after
a restart and every turn is written by the log's plugin; without it, conversations
live in memory only.

``latest`` and ``create`` read or write the database, so they run on the inference
worker's thread; turns are written by the log's plugin on the log's own thread, and
:meth:`held` gives the event loop a future to await before it shows a reply.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from concurrent.futures import Future

    from chatcore.conversation import Conversation
    from chatcore.engine import Engine

ADAPTER = "discord"
LOG_PLUGIN_NAME = "discord-conversation-log"

logger = logging.getLogger("chatcore.discord")


class ConversationPersistence(Protocol):
    def latest(self, engine: "Engine", key: str) -> "Conversation | None":
        """The current conversation of ``key`` with its turns, or None if it has none."""

    def create(self, engine: "Engine", key: str, replacing: bool = False) -> "Conversation":
        """A new, empty conversation for ``key``; ``replacing``: it supersedes the current one."""

    def held(self, conversation_id: str) -> "Future[None] | None":
        """A future that resolves once the conversation's newest turn is held by the storage
        (None: nothing to wait for)."""

    def close(self) -> None:
        """Write what is pending and release the storage."""


def new_conversation(engine: "Engine", key: str) -> "Conversation":
    return engine.conversation(adapter=ADAPTER, channel_key=key)


class MemoryPersistence:
    """No log: a conversation lasts as long as the process (and the in-memory cache)."""

    def latest(self, engine: "Engine", key: str) -> "Conversation | None":
        return None

    def create(self, engine: "Engine", key: str, replacing: bool = False) -> "Conversation":
        return new_conversation(engine, key)

    def held(self, conversation_id: str) -> "Future[None] | None":
        return None

    def close(self) -> None:
        pass


class LogPersistence:
    """Conversations in the conversation log (SQLite file or any SQLAlchemy URL).

    Registers the log's plugin on the engine's host, so ``on_user_message`` and
    ``on_response`` write each turn as it happens.
    """

    def __init__(self, engine: "Engine", db: str | None = None) -> None:
        from chatcore.log.location import resolve_url
        from chatcore.log.plugin import ConversationLogPlugin
        from chatcore.log.store import ConversationStore

        # The check on open runs in the background (turns are journaled until it passes), and the
        # hooks only queue their turns: the event loop awaits :meth:`held` instead.
        self.store = ConversationStore(resolve_url(db), defer_check=True)
        self.plugin = ConversationLogPlugin(
            self.store, notify=lambda message: logger.warning("%s", message), wait=False
        )
        self.host = engine.host
        if not self.host.register(self.plugin, LOG_PLUGIN_NAME):
            self.store.close()
            raise RuntimeError(f"cannot register the conversation log on the plugin host: {self.host.problems[-1]}")
        logger.info("conversation log: %s", self.store.display_url)

    def latest(self, engine: "Engine", key: str) -> "Conversation | None":
        from chatcore.errors import ChatcoreError

        try:
            conversation_id = self.store.latest_conversation_id(adapter=ADAPTER, channel_key=key)
            if conversation_id is None:
                return None
            return self.store.resume(conversation_id)
        except ChatcoreError as error:
            # An unavailable log must not silence the bot: start afresh; the log
            # plugin keeps the new turns until the database works again.
            logger.warning("cannot resume the conversation of %s: %s", key, error)
            return None

    def create(self, engine: "Engine", key: str, replacing: bool = False) -> "Conversation":
        from chatcore.errors import ChatcoreError

        conversation = new_conversation(engine, key)
        if replacing:
            # The log adds a conversation's row with its first message; a reset must
            # win over the old conversation at once, or a restart before anyone
            # speaks would bring the old one back.
            try:
                self.store.ensure_conversation(
                    conversation.id, adapter=ADAPTER, channel_key=key, model=engine.loaded.name
                )
            except ChatcoreError as error:
                logger.warning("cannot record the reset of %s: %s", key, error)
        return conversation

    def held(self, conversation_id: str) -> "Future[None] | None":
        return self.plugin.held(conversation_id)

    def close(self) -> None:
        try:
            journaled = self.plugin.close()  # what the log cannot take now waits in its journal
            if journaled:
                logger.warning("conversation log: %d write(s) kept in the journal for the next start", journaled)
            lost = self.plugin.pending - journaled + self.plugin.dropped
            if lost > 0:
                logger.warning("conversation log: %d write(s) could not be saved", lost)
        finally:
            self.host.unregister(LOG_PLUGIN_NAME)
            self.store.close()
