"""What reading the conversation log gives back: conversations, their messages and
search hits, as plain dataclasses (nothing of the database session leaks out)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from chatcore.log.models import MessageRow


@dataclass
class MessageRecord:
    id: int
    conversation_id: str
    role: str
    text: str
    created: datetime
    author_id: str | None = None
    token_count: int | None = None
    prompt_tokens: int | None = None
    latency_s: float | None = None
    first_token_s: float | None = None
    decoder: dict[str, Any] | None = None
    steerers: list[Any] | None = None
    candidates: list[Any] | None = None
    seed: int | None = None
    interrupted: bool = False
    superseded: bool = False
    provenance: dict[str, Any] | None = None

    @classmethod
    def from_row(cls, row: MessageRow) -> "MessageRecord":
        return cls(
            id=row.id,
            conversation_id=row.conversation_id,
            role=row.role,
            text=row.text,
            created=row.created,
            author_id=row.author_id,
            token_count=row.token_count,
            prompt_tokens=row.prompt_tokens,
            latency_s=row.latency_s,
            first_token_s=row.first_token_s,
            decoder=row.decoder,
            steerers=row.steerers,
            candidates=row.candidates,
            seed=row.seed,
            interrupted=bool(row.interrupted),
            superseded=bool(row.superseded),
            provenance=row.provenance,
        )

    def full_provenance(self) -> dict[str, Any]:
        """The reply's provenance as the engine gave it (candidates included)."""
        provenance = dict(self.provenance or {})
        if self.candidates:
            provenance["candidates"] = self.candidates
        return provenance

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["created"] = self.created.isoformat()
        return data


@dataclass
class ConversationSummary:
    id: str
    created: datetime
    updated: datetime
    adapter: str | None
    channel_key: str | None
    model: str | None
    title: str | None
    message_count: int

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["created"] = self.created.isoformat()
        data["updated"] = self.updated.isoformat()
        return data


@dataclass
class ConversationRecord(ConversationSummary):
    system: str | None = None
    prompt_format: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[MessageRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["messages"] = [message.to_dict() for message in self.messages]
        return data


@dataclass
class SearchHit:
    conversation_id: str
    title: str | None
    message: MessageRecord

    def to_dict(self) -> dict[str, Any]:
        return {"conversation_id": self.conversation_id, "title": self.title, "message": self.message.to_dict()}
