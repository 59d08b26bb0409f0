"""The plain values chatcore's parts hand each other: a conversation's turns, a prompt's
messages, a rendered prompt.

A leaf module: it imports nothing from chatcore, so the hook specifications, the
conversation, the prompt formats and the engine can all use these types without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

Speaker = Literal["user", "bot"]
"""Who said a turn of a conversation."""

Role = Literal["system", "user", "assistant"]
"""The role of a message in a prompt."""

ROLES: tuple[Role, ...] = ("system", "user", "assistant")


@dataclass
class Turn:
    """One turn of a conversation: who said it, its text, when, and facts adapters record
    (``meta``: e.g. ``{"author_id": "123"}``, a reply's ``provenance``)."""

    role: Speaker
    text: str
    created: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    interrupted: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Message:
    """One message of a prompt: ``role`` is ``system``, ``user`` or ``assistant``."""

    role: Role
    text: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"`role` must be one of {', '.join(ROLES)}, got {self.role!r}")


@dataclass
class PromptPlan:
    """A rendered prompt and what truncation did to the conversation."""

    token_ids: list[int]
    turns_used: int = 0
    turns_dropped: int = 0
    truncated_tokens: int = 0  # tokens cut from the front of the oldest kept turn
    messages: list[Message] = field(default_factory=list)  # what was rendered, system first if any
