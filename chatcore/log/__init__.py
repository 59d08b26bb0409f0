"""The conversation log: every turn of a chat kept in a database (SQLite by default).

- :class:`~chatcore.log.store.ConversationStore` opens a log
  by SQLAlchemy URL and has the whole database API (SQLAlchemy is imported only then);
- :class:`~chatcore.log.plugin.ConversationLogPlugin` writes
  turns through the ``on_user_message`` / ``on_response`` hooks; an adapter registers
  one holding its store (the REPL does unless ``--no-log``);
- this module, the registered entry point, adds the ``chatcore logs`` commands.

See docs/conversation-log.md.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import click

import chatcore
from chatcore.log.errors import LogError, UnknownConversationError
from chatcore.log.location import resolve_url
from chatcore.log.plugin import ConversationLogPlugin

if TYPE_CHECKING:
    from chatcore.log.store import ConversationStore

__all__ = [
    "ConversationLogPlugin",
    "ConversationStore",
    "LogError",
    "UnknownConversationError",
    "open_store",
    "resolve_url",
]


def open_store(url: str | os.PathLike[str] | None = None) -> "ConversationStore":
    """Open (creating if needed) the log at ``url`` (a URL or an SQLite file's path),
    ``$CHATCORE_DB`` or the default file."""
    from chatcore.log.store import ConversationStore
    from chatcore.text import shown_argument

    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if url is not None and not isinstance(url, str):
        raise LogError(f"a conversation log is named by a URL or a file's path, got {shown_argument(url)}")
    return ConversationStore(resolve_url(url))


def __getattr__(name: str) -> Any:
    if name == "ConversationStore":  # lazily: it imports SQLAlchemy
        from chatcore.log.store import ConversationStore

        return ConversationStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@chatcore.hookimpl(trylast=True)
def register_commands(cli: click.Group) -> None:
    from chatcore.log.commands import logs

    cli.add_command(logs)
