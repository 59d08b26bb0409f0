"""What one terminal chat holds: the engine, the reply options, the conversation, the log."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from chatcore.conversation import Conversation, Turn
    from chatcore.engine import Engine, ReplyOptions
    from chatcore.log.plugin import ConversationLogPlugin
    from chatcore.log.store import ConversationStore
    from chatcore.response import Response
    from chatcore.serving import Scheduler

ADAPTER = "repl"
T = TypeVar("T")


LOG_PLUGIN_NAME = "conversation-log:repl"


@dataclass(frozen=True)
class Saved:
    """What a slash command may change, as it was before the command (see :meth:`ChatState.save`)."""

    options: "ReplyOptions"
    conversation: "Conversation"
    turns: list["Turn"]
    conversation_system: str | None
    conversation_format: str | None
    system: str | None
    prompt_format: str | None
    next_seed: int | None
    multiline: bool
    last_response: "Response | None"


@dataclass
class ChatState:
    """The REPL's state; slash commands read and change it, the terminal shows it.

    ``next_seed``: the seed of the next reply, or None for a random one. A fixed seed
    advances by one per reply, so a conversation replays exactly from the same
    inputs while ``/retry`` still gives a different reply.

    ``system`` and ``prompt_format`` (None: the engine's) carry over to the next
    conversation (``/new``) like the decoder does; a resumed conversation brings its
    own logged system prompt.

    ``sampling_shortcuts``: the command line's ``--temperature`` and ``--top-p``
    (``{"temperature": 0.9}``); they stay the defaults of the decoders chosen later in the
    chat (``/decoder``), for the settings a decoder has and its spec leaves out.
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
    sampling_shortcuts: dict[str, float] = field(default_factory=dict)
    # One loading at a time: a command given again after Ctrl-C waits for the loading it
    # cancelled to end (and then finds what it built), rather than loading it twice at once.
    _loading: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _loaders: list[threading.Thread] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.conversation is None:
            self.new_conversation()

    def background(self, work: Callable[[], T]) -> T:
        """``work()`` (building a decoder or steerer: loading a model, a head, vectors) on a thread
        of its own, waited for here: Ctrl-C during a command stops the wait and not the work, so
        torch's loading is never cut in the middle (see :mod:`~chatcore.adapters.repl.cancelling`)."""
        from chatcore.adapters.repl.cancelling import wait_for

        future: Future[T] = Future()

        def run() -> None:
            with self._loading:
                if not future.set_running_or_notify_cancel():
                    return  # cancelled while it waited for the loading before it
                try:
                    future.set_result(work())
                except BaseException as error:
                    future.set_exception(error)

        self._loaders = [thread for thread in self._loaders if thread.is_alive()]
        thread = threading.Thread(target=run, name="chat-loading", daemon=True)
        self._loaders.append(thread)
        thread.start()
        try:
            return wait_for(future)
        except KeyboardInterrupt:
            future.cancel()
            raise

    @property
    def loading(self) -> bool:
        """Whether loading that a cancelled command started is still going on."""
        return any(thread.is_alive() for thread in self._loaders)

    def finish_loading(self) -> None:
        """Wait for the loading a cancelled command left running: a program that ends while
        another thread is inside torch's loading code can crash on its way out."""
        for thread in self._loaders:
            thread.join()
        self._loaders = []

    def check_options(self, options: "ReplyOptions") -> None:
        """Refuse ``options`` now if a reply could not be made with them (the engine's check,
        which builds the decoder and steerers: see :meth:`background`)."""
        self.background(lambda: self.engine.check_options(options))

    def save(self) -> Saved:
        """What a slash command may change, to be put back with :meth:`restore`."""
        conversation = self.current
        return Saved(
            options=self.options.model_copy(deep=True),
            conversation=conversation,
            turns=list(conversation.turns),
            conversation_system=conversation.system,
            conversation_format=conversation.prompt_format,
            system=self.system,
            prompt_format=self.prompt_format,
            next_seed=self.next_seed,
            multiline=self.multiline,
            last_response=self.last_response,
        )

    def restore(self, saved: Saved) -> None:
        """Put back what :meth:`save` saved (a command that failed or was cancelled changes nothing)."""
        self.options = saved.options
        self.conversation = conversation = saved.conversation
        conversation.turns[:] = saved.turns
        conversation.system = saved.conversation_system
        conversation.prompt_format = saved.conversation_format
        self.system = saved.system
        self.prompt_format = saved.prompt_format
        self.next_seed = saved.next_seed
        self.multiline = saved.multiline
        self.last_response = saved.last_response

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
