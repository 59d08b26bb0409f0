"""The bot's engine, its scheduler and one conversation per channel key.

A :class:`ChatRuntime` is created on the inference worker's thread (see
:mod:`chatcore.adapters.discord_bot.worker`), which owns the conversation log: resuming a
conversation from it, adding turns (the log writes each one) and recording replies run
there. The event loop submits each reply to the scheduler itself
(:meth:`ChatRuntime.submit_reply`: the conversation's messages as they are, plus the
user's turn) and awaits its end; the scheduler decodes it, many channels in one batch.
A conversation is plain data; one channel's replies come one after the other, so the
loop reads a conversation only while no job of the worker changes it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chatcore.adapters.discord_bot.persistence import ConversationPersistence, LogPersistence, MemoryPersistence

if TYPE_CHECKING:
    from concurrent.futures import Future

    from chatcore.adapters.discord_bot.config import DiscordSettings
    from chatcore.conversation import Conversation
    from chatcore.engine import Engine, ReplyOptions
    from chatcore.plugin_manager import PluginHost
    from chatcore.serving import Handle, Scheduler
    from chatcore.serving.requests import Event

logger = logging.getLogger("chatcore.discord")


@dataclass
class ReplyResult:
    text: str
    conversation_id: str
    interrupted: bool = False
    stop_reason: str | None = None  # "shutdown", "timeout" or "cancelled" when interrupted
    provenance: dict[str, Any] = field(default_factory=dict)


@dataclass
class PendingReply:
    """A reply the scheduler is decoding: its conversation (worker thread only) and handle."""

    key: str
    conversation: "Conversation" = field(repr=False)
    handle: "Handle" = field(repr=False)


class ChatRuntime:
    """The engine, its scheduler, the open conversations (least recently used dropped
    first) and their storage.

    ``max_batch`` replies are decoded at once and ``queue_size`` more may wait for a place.
    """

    def __init__(
        self,
        engine: "Engine",
        persistence: ConversationPersistence | None = None,
        max_conversations: int = 1000,
        *,
        max_batch: int = 8,
        queue_size: int = 8,
    ) -> None:
        from chatcore.serving import Scheduler

        self.engine = engine
        self.persistence: ConversationPersistence = persistence or MemoryPersistence()
        self.max_conversations = max_conversations
        self.scheduler: "Scheduler" = Scheduler(engine, max_batch=max_batch, max_waiting=queue_size)
        self._open: OrderedDict[str, "Conversation"] = OrderedDict()
        self._open_lock = threading.Lock()  # the event loop looks conversations up too

    # -- conversations --------------------------------------------------------------
    def open_conversation(self, key: str) -> "Conversation | None":
        """The current conversation of ``key`` if it is open (no storage is read: for the event loop)."""
        with self._open_lock:
            conversation = self._open.get(key)
            if conversation is not None:
                self._open.move_to_end(key)
            return conversation

    def conversation(self, key: str) -> "Conversation":
        """The current conversation of ``key``: open, resumed from storage, or new (worker thread)."""
        open_now = self.open_conversation(key)
        if open_now is not None:
            return open_now
        conversation = self.persistence.latest(self.engine, key)
        if conversation is not None:
            logger.info("resumed conversation %s of %s (%d turns)", conversation.id[:8], key, len(conversation.turns))
        else:
            conversation = self.persistence.create(self.engine, key)
        self._remember(key, conversation)
        return conversation

    def reset(self, key: str) -> "Conversation":
        conversation = self.persistence.create(self.engine, key, replacing=True)
        self._remember(key, conversation)
        return conversation

    def _remember(self, key: str, conversation: "Conversation") -> None:
        with self._open_lock:
            self._open[key] = conversation
            self._open.move_to_end(key)
            while len(self._open) > self.max_conversations:
                self._open.popitem(last=False)

    # -- replies ------------------------------------------------------------------
    def submit_reply(
        self,
        key: str,
        conversation: "Conversation",
        text: str,
        options: "ReplyOptions",
        system: str | None = None,
        listener: "Callable[[Event], None] | None" = None,
    ) -> tuple[PendingReply, str]:
        """Submit a reply to ``conversation`` (the current one of ``key``) and the user's
        ``text`` (with the system prompt ``system``: the one in effect for ``key`` now) to the
        scheduler; the event loop calls this. ``listener`` is called on the scheduler's
        thread with each event. Returns the pending reply and the text as cleaned, for
        :meth:`add_user` (the worker's job).

        Raises ServerBusy when the batch and its queue are full, the one busy check, before
        anything is added; ChatcoreError for a message that cannot be a turn."""
        from chatcore.text import clean_message
        from chatcore.values import Message

        text = clean_message(text)
        conversation.system = system
        messages = [*conversation.messages(), Message("user", text)]
        prompt_format = self.engine.format_for(conversation)
        handle = self.scheduler.submit(messages, options, listener=listener, prompt_format=prompt_format)
        return PendingReply(key, conversation, handle), text

    def add_user(self, pending: PendingReply, text: str, author_id: str | None = None) -> None:
        """Add the submitted reply's user turn (by ``author_id``, which the log keeps so that
        one person's messages can be exported or deleted); the log queues it on its own thread
        (the event loop calls this)."""
        meta = {"author_id": author_id} if author_id is not None else None
        self.engine.add_user(pending.conversation, text, meta=meta)

    def held(self, conversation_id: str) -> "Future[None] | None":
        """A future resolved once the conversation's newest turn is held by the log (None without one)."""
        return self.persistence.held(conversation_id)

    def start_reply(
        self,
        key: str,
        text: str,
        options: "ReplyOptions",
        system: str | None = None,
        author_id: str | None = None,
        listener: "Callable[[Event], None] | None" = None,
    ) -> PendingReply:
        """:meth:`submit_reply` and :meth:`add_user` at once, on the worker's thread (for
        scripts and tests; the bot submits from its event loop)."""
        pending, cleaned = self.submit_reply(key, self.conversation(key), text, options, system, listener)
        self.add_user(pending, cleaned, author_id)
        return pending

    def finish_reply(self, pending: PendingReply, stop_reason: str | None = None) -> ReplyResult:
        """Record the reply the scheduler ended, or the one cut short (``stop_reason`` is
        "timeout", "cancelled" or "shutdown"): what it had written is kept, cut back to its
        last whole word and marked interrupted; with no whole word, no reply is recorded and
        the text is empty. Called on the event loop once the reply has ended: it only reads
        what was decoded, and the log's hook queues the reply (await :meth:`held`)."""
        handle, conversation = pending.handle, pending.conversation

        def record(response: Any) -> None:
            if handle.admitted is None:
                return  # cut while it waited for a place: the model never saw it, no reply to keep
            self.engine.record(conversation, response)

        if stop_reason is not None:  # what it has written now, without waiting for its next step
            response = handle.cut(self.engine.tokenizer, finalize=record)
        else:
            response = handle.response(self.engine.tokenizer, finalize=record)
        text = response.text()
        return ReplyResult(
            text=text,
            conversation_id=conversation.id,
            interrupted=response.interrupted,
            stop_reason=stop_reason,
            provenance=dict(response.provenance),
        )

    def reply(
        self, key: str, text: str, options: "ReplyOptions", system: str | None = None, author_id: str | None = None
    ) -> ReplyResult:
        """Start a reply and wait for it (for scripts and tests; the bot awaits it instead)."""
        pending = self.start_reply(key, text, options, system, author_id)
        pending.handle.wait()
        result = self.finish_reply(pending)
        held = self.held(result.conversation_id)
        if held is not None:
            held.result()
        return result

    def last_provenance(self, key: str) -> dict[str, Any] | None:
        """The provenance of the newest reply in ``key``'s conversation (resumed ones too)."""
        conversation = self.conversation(key)
        for turn in reversed(conversation.turns):
            if turn.role == "bot":
                provenance = turn.meta.get("provenance")
                return dict(provenance) if isinstance(provenance, Mapping) else None
        return None

    # -- plugins ------------------------------------------------------------------
    def check_options(self, options: "ReplyOptions") -> None:
        """Refuse a decoder and steerers that could not make a reply (see Engine.check_options)."""
        self.engine.check_options(options)

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
        self.scheduler.close()
        self.persistence.close()


def open_runtime(settings: "DiscordSettings", host: "PluginHost | None" = None) -> ChatRuntime:
    """Load the model and open the log, as the settings say (runs on the worker thread)."""
    from chatcore.cli import plugin_problems_note
    from chatcore.cpu import use_threads
    from chatcore.engine import Engine
    from chatcore.serving.warm_up import warm_up

    use_threads(settings.threads)
    engine = Engine(settings.model, device=settings.device, host=host, prompt_format=settings.prompt_format)
    note = plugin_problems_note(engine.host)
    if note is not None:
        logger.warning("%s", note)
    persistence: ConversationPersistence = LogPersistence(engine, settings.db) if settings.log else MemoryPersistence()
    runtime = ChatRuntime(
        engine, persistence, settings.max_conversations, max_batch=settings.max_batch, queue_size=settings.queue_size
    )
    try:
        warm_up(runtime.scheduler, say=logger.info)  # before the bot connects: no message waits for it
    except BaseException:
        runtime.close()
        raise
    return runtime
