"""Serving many conversations at once: a scheduler that owns the engine on one thread.

See :mod:`chatcore.serving.scheduler` (the thread and its rules),
:mod:`chatcore.serving.batch` (continuous batching) and
:mod:`chatcore.serving.requests` (the handle a caller holds). docs/serving.md has the whole story.
"""

from chatcore.serving.requests import End, Event, Handle, ServerBusy, Token
from chatcore.serving.scheduler import Scheduler

__all__ = ["End", "Event", "Handle", "Scheduler", "ServerBusy", "Token"]
