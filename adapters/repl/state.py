"""What one terminal chat holds: the engine, the reply options, the conversation, the log."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatcore.conversation import Conversation
    from chatcore.engine import Engine, ReplyOptions
    from chatcore.log.plugin import ConversationLogPlugin
    from chatcore.log.store import ConversationStore
    from chatcore.response import Response
    from chatcore.serving import Scheduler

ADAPTER = "repl"


LOG_PLUGIN_NAME = "conversation-log:repl"


@dataclass
class ChatState:
    """The REPL's state; slash commands read and change it, the terminal shows it.

    ``next_seed``: the seed of the next reply, or None for a random one. A fixed seed
    advances by one per reply, so a conversation replays exactly from the same
    inputs while ``/retry`` still gives a different reply.

    ``system`` and ``prompt_format`` (None: the engine's) carry over to the next
    conversation (``/new``) like the decoder does; a resumed conversation brings its
    own logged system prompt.
    """

    engine: "Engine"
    options: "ReplyOptions"
    conversation: "Conversation | None" = None
    store: "ConversationStore | None" = None
    log_plugin: "ConversationLogPlugin | None" = None
    log_off_reason: str = "--no-log"
    next_seed: int | None = None
    last_response: "Response | None" = None
    multiline: bool = False
    system: str | None = None
    prompt_format: str | None = None
    notices: list[str] = field(default_factory=list)
    # Decodes the replies when set (the chat command sets one): the next turn then runs only
    # its new tokens, the earlier ones coming from the scheduler's prefix cache.
    scheduler: "Scheduler | None" = None

    def __post_init__(self) -> None:
        if self.conversation is None:
            self.new_conversation()

    @property
    def current(self) -> "Conversation":
        assert self.conversation is not None
        return self.conversation

    def new_conversation(self) -> "Conversation":
        self.conversation = self.engine.conversation(
            system=self.system, prompt_format=self.prompt_format, adapter=ADAPTER
        )
        self.last_response = None
        return self.conversation

    def switch_to(self, conversation: "Conversation") -> None:
        self.conversation = conversation
        self.system = conversation.system
        if conversation.prompt_format is None:
            conversation.prompt_format = self.prompt_format
        self.last_response = None

    def set_system(self, text: str | None) -> str | None:
        """Set (or with None clear) the system prompt; the next reply is rendered with it.

        One that leaves no room in the context for a message and a reply is refused now,
        before a message is sent that could not be answered."""
        from chatcore.prompting import check_system_fits, clean_system_prompt

        cleaned = clean_system_prompt(text)
        check_system_fits(
            self.engine.format_for(self.current), cleaned, self.engine.loaded.max_positions, self.options.max_new_tokens
        )
        self.current.system = self.system = cleaned
        return cleaned

    def set_format(self, name: str) -> str:
        """Switch the prompt format (``auto`` included); returns the name of the format chosen."""
        chosen = self.engine.make_prompt_format(name).name  # an unknown or unusable format fails here
        self.prompt_format = self.current.prompt_format = chosen
        return chosen

    @property
    def format_name(self) -> str:
        return self.engine.format_for(self.current).name

    def reply(self) -> "Response":
        """A lazy reply to the conversation so far, with the current options and seed."""
        options = self.options.replace(seed=self.next_seed)
        if self.scheduler is not None:
            response = self.scheduler.respond(self.current, options)
        else:
            response = self.engine.respond(self.current, options)
        if self.next_seed is not None:
            self.next_seed += 1
        self.last_response = response
        return response

    def send(self, text: Any) -> "Response":
        self.retry_log()
        self.engine.add_user(self.current, text)
        return self.reply()

    def retry_log(self) -> None:
        """Take up the log that could not be opened at the start, once its plugin has opened it
        (it journals every turn until then and writes them in order when it opens)."""
        plugin = self.log_plugin
        if self.store is not None or plugin is None or plugin.store is None:
            return
        self.store = plugin.store
        self.log_off_reason = ""
        self.notify(f"the conversation log {plugin.store.display_url} is open now: every turn since the start is in it")

    def attach_log(
        self,
        store: "ConversationStore | None",
        url: str | None = None,
        opener: "Callable[[], ConversationStore] | None" = None,
    ) -> "ConversationLogPlugin":
        """Log to ``store`` from now on (or, with ``store`` None, journal every turn until ``opener``
        opens the log at ``url``); returns the plugin that writes to it."""
        from chatcore.errors import ChatcoreError
        from chatcore.log.plugin import ConversationLogPlugin

        self.store = store
        self.log_plugin = plugin = ConversationLogPlugin(store, notify=self.notify, opener=opener, url=url)
        self.engine.host.unregister(LOG_PLUGIN_NAME)  # a previous chat in this process
        if not self.engine.host.register(plugin, LOG_PLUGIN_NAME):
            raise ChatcoreError("the conversation log plugin could not be registered")
        return plugin

    def notify(self, message: str) -> None:
        """Queue a message for the person (shown between turns, never mid-reply)."""
        self.notices.append(message)

    def take_notices(self) -> list[str]:
        notices, self.notices = self.notices, []
        return notices

    @property
    def log_status(self) -> str:
        if self.store is None and self.log_plugin is not None:
            return f"not open yet ({self.log_plugin.failing}), {self.log_plugin.pending} write(s) in its journal"
        if self.store is None:
            return f"off ({self.log_off_reason})"
        if self.log_plugin is not None and self.log_plugin.failing is not None:
            return f"failing, {self.log_plugin.pending} write(s) waiting"
        return "on"
