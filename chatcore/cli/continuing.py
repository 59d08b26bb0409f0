"""``chatcore generate --continue`` / ``--cid ID``: one more turn of a logged conversation.

The message is added as a user turn to the logged conversation, its earlier turns are the
reply's context (its system prompt too, unless a new one is given), and both the message
and the reply are written to the log, as the terminal chat writes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from chatcore.errors import ChatcoreError, OptionError

if TYPE_CHECKING:
    from chatcore.conversation import Conversation
    from chatcore.engine import Engine
    from chatcore.log.store import ConversationStore

LOG_PLUGIN_NAME = "conversation-log:generate"


def check_continue_options(turns: tuple[str, ...], continue_last: bool, conversation_id: str | None) -> bool:
    """Whether a logged conversation is continued; refuses what cannot be done, before anything loads."""
    if conversation_id is not None and not conversation_id.strip():
        raise OptionError("`--cid` is empty: give a conversation id (`chatcore logs list` shows them)")
    if conversation_id is not None and continue_last:
        raise OptionError("give --cid ID or --continue, not both")
    continuing = continue_last or conversation_id is not None
    if continuing and len(turns) != 1:
        raise OptionError(
            f"--continue and --cid take one message (the conversation's earlier turns come from the log), "
            f"got {len(turns)}"
        )
    return continuing


def open_store(db_url: str | None) -> "ConversationStore":
    """The log to continue from and write to; one that does not exist yet is refused, not made."""
    from chatcore.log.errors import NotALogError
    from chatcore.log.location import resolve_url
    from chatcore.log.store import ConversationStore

    url = resolve_url(db_url)
    try:
        ConversationStore(url, create=False).close()  # nothing is created where there is no log
    except NotALogError as error:
        raise ChatcoreError(f"no logged conversation to continue: {error}") from None
    return ConversationStore(url)


def find_conversation_id(store: "ConversationStore", conversation_id: str | None) -> str:
    """The id given (any unique prefix), else the most recent logged conversation of any adapter."""
    if conversation_id is not None:
        return store.resolve_id(conversation_id)
    found = store.latest_conversation_id()
    if found is None:
        raise ChatcoreError(f"no logged conversation to continue in {store.display_url}")
    return found


@contextmanager
def logged_conversation(
    engine: "Engine",
    store: "ConversationStore",
    conversation_id: str,
    system: str | None,
    say: Callable[[str], None],
) -> Iterator["Conversation"]:
    """The logged conversation, live, with the log written for the turns added meanwhile."""
    from chatcore.log.plugin import ConversationLogPlugin

    conversation = store.resume(conversation_id)
    if system is not None:  # as in the terminal chat: a system prompt given replaces the logged one
        conversation.system = system
    plugin = ConversationLogPlugin(store, notify=lambda message: say(f"note: {message}"))
    engine.host.unregister(LOG_PLUGIN_NAME)
    if not engine.host.register(plugin, LOG_PLUGIN_NAME):
        raise ChatcoreError("the conversation log plugin could not be registered")
    try:
        yield conversation
    finally:
        engine.host.unregister(LOG_PLUGIN_NAME)
        journaled = plugin.close()  # what the log cannot take now waits in its journal
        if journaled:
            say(
                f"note: {journaled} write(s) could not be saved to the conversation log; they are kept in "
                f"{plugin.journal.folder} and written by the next command that logs there"
            )
