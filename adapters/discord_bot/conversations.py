"""The worker's side of the bot: the engine and one conversation per channel key.

A :class:`ChatRuntime` is created on, and used only from, the inference worker's
thread (see :mod:`chatcore.adapters.discord_bot.worker`): it holds the engine, the
conversations most recently used (the rest resume from the log when next needed) and
their persistence. The event loop never touches a Conversation.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chatcore.adapters.discord_bot.persistence import ConversationPersistence, LogPersistence, MemoryPersistence

if TYPE_CHECKING:
    from chatcore.adapters.discord_bot.config import DiscordSettings
    from chatcore.adapters.discord_bot.worker import JobControl
    from chatcore.conversation import Conversation
    from chatcore.engine import Engine, ReplyOptions
    from chatcore.plugin_manager import PluginHost

logger = logging.getLogger("chatcore.discord")


@dataclass
class ReplyResult:
    text: str
    conversation_id: str
    interrupted: bool = False
    stop_reason: str | None = None  # "shutdown", "timeout" or "cancelled" when interrupted
    provenance: dict[str, Any] = field(default_factory=dict)


class ChatRuntime:
    """The engine, the open conversations (least recently used dropped first) and their storage."""

    def __init__(self, engine: "Engine", persistence: ConversationPersistence | None = None,
                 max_conversations: int = 1000) -> None:
        self.engine = engine
        self.persistence: ConversationPersistence = persistence or MemoryPersistence()
        self.max_conversations = max_conversations
        self._open: OrderedDict[str, "Conversation"] = OrderedDict()

    # -- conversations --------------------------------------------------------------
    def conversation(self, key: str) -> "Conversation":
        """The current conversation of ``key``: open, resumed from storage, or new."""
        if key in self._open:
            self._open.move_to_end(key)
            return self._open[key]
        conversation = self.persistence.latest(self.engine, key)
        if conversation is not None:
            logger.info("resumed conversation %s of %s (%d turns)", conversation.id[:8], key,
                        len(conversation.turns))
        else:
            conversation = self.persistence.create(self.engine, key)
        self._remember(key, conversation)
        return conversation

    def reset(self, key: str) -> "Conversation":
        conversation = self.persistence.create(self.engine, key, replacing=True)
        self._remember(key, conversation)
        return conversation

    def _remember(self, key: str, conversation: "Conversation") -> None:
        self._open[key] = conversation
        self._open.move_to_end(key)
        while len(self._open) > self.max_conversations:
            self._open.popitem(last=False)

    def is_open(self, key: str) -> bool:
        return key in self._open

    # -- replies ------------------------------------------------------------------
    def reply(self, key: str, text: str, options: "ReplyOptions", control: "JobControl | None" = None,
              system: str | None = None, author_id: str | None = None) -> ReplyResult:
        """Add ``text`` as the user's turn (by ``author_id``, which the log keeps so that one
        person's messages can be exported or deleted) and generate the reply with the system
        prompt ``system`` (the one in effect for ``key`` now: a change applies from the next
        reply on), stopping early when ``control`` says so (the partial reply is kept,
        marked interrupted)."""
        conversation = self.conversation(key)
        conversation.system = system
        conversation.add_user(text, meta={"author_id": author_id} if author_id is not None else None)
        response = conversation.reply(options)
        stop_reason = None
        for _ in response:
            if control is not None and control.should_stop():
                stop_reason = control.stop_reason
                response.interrupt()
                break
        return ReplyResult(
            text=response.text(),
            conversation_id=conversation.id,
            interrupted=response.interrupted,
            stop_reason=stop_reason,
            provenance=dict(response.provenance),
        )

    def last_provenance(self, key: str) -> dict[str, Any] | None:
        """The provenance of the newest reply in ``key``'s conversation (resumed ones too)."""
        conversation = self.conversation(key)
        for turn in reversed(conversation.turns):
            if turn.role == "bot":
                provenance = turn.meta.get("provenance")
                return dict(provenance) if isinstance(provenance, Mapping) else None
        return None

    # -- plugins ------------------------------------------------------------------
    def check_decoder(self, name: str, settings: Mapping[str, Any]) -> None:
        self.engine.make_decoder(name, settings)

    def check_steerer(self, name: str, settings: Mapping[str, Any]) -> None:
        self.engine.make_steerer(name, settings)

    def check_system(self, text: str | None, max_new_tokens: int) -> None:
        """Fail if ``text`` as the system prompt leaves no room for a message and a reply."""
        from chatcore.prompting import check_system_fits

        check_system_fits(self.engine.prompt_format, text, self.engine.loaded.max_positions, max_new_tokens)

    @property
    def prompt_format(self) -> str:
        return self.engine.prompt_format.name

    def names(self) -> dict[str, list[str]]:
        registry = self.engine.registry
        return {"decoders": sorted(registry.decoders), "steerers": sorted(registry.steerers)}

    def close(self) -> None:
        self.persistence.close()


def open_runtime(settings: "DiscordSettings", host: "PluginHost | None" = None) -> ChatRuntime:
    """Load the model and open the log, as the settings say (runs on the worker thread)."""
    from chatcore.engine import Engine

    if settings.threads is not None:
        import torch

        torch.set_num_threads(settings.threads)
    engine = Engine(settings.model, device=settings.device, host=host, prompt_format=settings.prompt_format)
    persistence: ConversationPersistence = LogPersistence(engine, settings.db) if settings.log else MemoryPersistence()
    return ChatRuntime(engine, persistence, settings.max_conversations)
