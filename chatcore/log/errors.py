"""Errors of the conversation log, with messages meant for the person reading them."""

from __future__ import annotations

from chatcore.errors import ChatcoreError


class LogError(ChatcoreError):
    """The conversation log cannot be opened, read or written."""


class NotALogError(LogError):
    """What the URL names holds no chatcore conversation log: nothing there, memory, or another program's file."""


class UnknownConversationError(LogError, KeyError):
    """No conversation in the log has the given id (or id prefix)."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the sentence.
        return str(self.args[0]) if self.args else ""


class LogUnavailableError(LogError):
    """The log cannot be reached or written just now (locked, read-only, full, disconnected); a retry may work."""


class ConversationTakenError(LogError):
    """Another chat has written into the conversation since this one last read or wrote it."""


class AwaitingReplyError(ConversationTakenError):
    """The conversation ends with another chat's message still waiting for its reply: that chat may
    be replying to it (or end without a reply: then it gives the message up, see ``release``)."""


class ConversationDeletedError(LogError):
    """The conversation this chat has written into is no longer in the log (``chatcore logs delete``)."""


def folder_refused(path: object) -> str:
    """What a log location that names a folder is told, wherever it is given."""
    return f"{path} is a folder, not a conversation log file (name the file in it)"
