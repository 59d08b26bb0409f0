"""Errors that chatcore reports to people rather than as tracebacks.

Adapters (the CLI, the REPL, the Discord bot) catch :class:`ChatcoreError` and show
its message; anything else is a bug and is re-raised when ``CHATCORE_DEBUG`` is set.
"""

from __future__ import annotations


class ChatcoreError(Exception):
    """Base class for every error that has a message meant for the user."""


class OptionError(ChatcoreError, ValueError):
    """An option or setting has an unknown name or an invalid value."""


class UnknownNameError(ChatcoreError, KeyError):
    """A decoder, steerer or model name that nothing registered."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the sentence.
        return str(self.args[0]) if self.args else ""


class ModelLoadError(ChatcoreError):
    """A model or tokenizer could not be loaded."""


class CorpusError(ChatcoreError):
    """A training or evaluation corpus is missing or malformed."""


class PluginError(ChatcoreError):
    """A plugin failed to load or raised inside a hook."""

    def __init__(self, plugin: str, message: str) -> None:
        super().__init__(f"plugin {plugin!r}: {message}")
        self.plugin = plugin
