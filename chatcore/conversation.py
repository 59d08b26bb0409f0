"""Conversations: turns, DialoGPT-style prompts, and replies.

A prompt is the history's turns, oldest first, each followed by the EOS token. When it
does not fit the model's context (its positions minus the reply's token budget), the
oldest whole turns are dropped; if the newest turn alone is too long, only its most
recent tokens are kept. User text is never parsed for special tokens.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Literal

from chatcore.errors import ChatcoreError
from chatcore.text import clean_message, encode_text

if TYPE_CHECKING:
    from chatcore.engine import Engine, ReplyOptions
    from chatcore.response import Response

Role = Literal["user", "bot"]


@dataclass
class Turn:
    role: Role
    text: str
    created: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    interrupted: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptPlan:
    token_ids: list[int]
    turns_used: int
    turns_dropped: int
    truncated_tokens: int  # tokens cut from the front of the oldest kept turn


def build_prompt(turn_ids: Sequence[Sequence[int]], eos: int, budget: int) -> PromptPlan:
    """Join turns (oldest first) with EOS after each, dropping oldest whole turns to fit."""
    if budget < 2:
        raise ChatcoreError(f"the context budget is {budget} tokens: too small for any prompt")
    kept: list[Sequence[int]] = []
    used = 0
    for ids in reversed(turn_ids):
        if used + len(ids) + 1 > budget:
            break
        kept.append(ids)
        used += len(ids) + 1
    truncated = 0
    if not kept and turn_ids:
        newest = list(turn_ids[-1])
        keep = budget - 1
        truncated = len(newest) - keep
        kept = [newest[-keep:]]
    prompt: list[int] = []
    for ids in reversed(kept):
        prompt.extend(ids)
        prompt.append(eos)
    return PromptPlan(prompt, len(kept), len(turn_ids) - len(kept), truncated)


class Conversation:
    """The turns of one conversation and the engine that answers them."""

    def __init__(self, engine: "Engine", id: str | None = None, turns: Sequence[Turn] = (), **meta: Any) -> None:
        self.engine = engine
        self.id = id or uuid.uuid4().hex
        self.turns: list[Turn] = list(turns)
        self.meta: dict[str, Any] = dict(meta)
        self._token_cache: dict[str, list[int]] = {}

    def add_user(self, text: Any) -> Turn:
        """Append a user turn (validated and normalised) and fire ``on_user_message``."""
        turn = Turn("user", clean_message(text))
        self.turns.append(turn)
        self.engine.host.call_each("on_user_message", conversation=self, turn=turn)
        return turn

    def add_bot_text(self, text: str, interrupted: bool = False, meta: dict[str, Any] | None = None) -> Turn:
        turn = Turn("bot", text, interrupted=interrupted, meta=dict(meta or {}))
        self.turns.append(turn)
        return turn

    def _turn_ids(self, turn: Turn) -> list[int]:
        if turn.text not in self._token_cache:
            self._token_cache[turn.text] = encode_text(self.engine.tokenizer, turn.text)
        return self._token_cache[turn.text]

    def prompt(self, max_new_tokens: int) -> PromptPlan:
        # Empty replies (possible from a tiny model) add nothing but their EOS.
        turns = [t for t in self.turns if t.text or t.role == "bot"]
        if not turns:
            raise ChatcoreError("the conversation has no turns to reply to")
        budget = self.engine.loaded.max_positions - max_new_tokens
        return build_prompt([self._turn_ids(t) for t in turns], self.engine.eos_token_id, budget)

    def reply(self, options: "ReplyOptions | None" = None, **overrides: Any) -> "Response":
        """A lazy reply to the conversation so far (the last turn should be the user's)."""
        return self.engine.respond(self, options, **overrides)

    def send(self, text: Any, options: "ReplyOptions | None" = None, **overrides: Any) -> "Response":
        """``add_user(text)`` then ``reply()``."""
        self.add_user(text)
        return self.reply(options, **overrides)

    def _record(self, response: "Response") -> None:
        if response.error is not None and not response.token_ids:
            return  # a reply that failed before its first token is not a turn
        text = "".join(response._chunks)
        self.add_bot_text(text, interrupted=response.interrupted, meta={"provenance": response.provenance})
        self.engine.host.call_each("on_response", conversation=self, response=response)
