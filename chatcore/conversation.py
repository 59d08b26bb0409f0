"""Conversations: a system prompt, turns, and replies.

The engine's prompt format (chatcore.prompting) turns the system prompt and the turns
into the prompt's token ids. When they do not fit the model's context (its positions
minus the reply's token budget), the oldest whole turns are dropped, never the system
prompt; if the newest turn alone is too long, only its most recent tokens are kept.
User text is never parsed for special tokens.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Literal

from chatcore.errors import ChatcoreError
from chatcore.prompting import Message, PromptPlan, clean_system_prompt, prompt_budget
from chatcore.text import clean_message

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


def build_prompt(turn_ids: Sequence[Sequence[int]], eos: int, budget: int) -> PromptPlan:
    """Join token-id turns (oldest first) with EOS after each, dropping oldest whole turns to fit.

    The dialogpt format on ids, for training and scoring code that holds ids already.
    """
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
    """The turns of one conversation, its system prompt, and the engine that answers them.

    ``system``: the system prompt (persona), or None. ``prompt_format``: a format name
    for this conversation, or None for the engine's.
    """

    def __init__(
        self,
        engine: "Engine",
        id: str | None = None,
        turns: Sequence[Turn] = (),
        system: str | None = None,
        prompt_format: str | None = None,
        **meta: Any,
    ) -> None:
        self.engine = engine
        self.id = id or uuid.uuid4().hex
        self.turns: list[Turn] = list(turns)
        self.meta: dict[str, Any] = dict(meta)
        self.system = system
        self.prompt_format = prompt_format

    @property
    def system(self) -> str | None:
        return self._system

    @system.setter
    def system(self, text: str | None) -> None:
        self._system = clean_system_prompt(text)

    def add_user(self, text: Any, meta: dict[str, Any] | None = None) -> Turn:
        """Append a user turn (validated and normalised) and fire ``on_user_message``.

        ``meta``: facts about the turn that adapters record, e.g. ``{"author_id": "123"}``
        (the conversation log stores the author so that an operator can export or delete
        one person's messages).
        """
        turn = Turn("user", clean_message(text), meta=dict(meta or {}))
        self.turns.append(turn)
        self.engine.host.call_each("on_user_message", conversation=self, turn=turn)
        return turn

    def add_bot_text(self, text: str, interrupted: bool = False, meta: dict[str, Any] | None = None) -> Turn:
        turn = Turn("bot", text, interrupted=interrupted, meta=dict(meta or {}))
        self.turns.append(turn)
        return turn

    def messages(self) -> list[Message]:
        """The system prompt (if any) and the turns, as a prompt format takes them."""
        # Empty replies (possible from a tiny model) stay: they are turns of the dialogue.
        messages = [Message("system", self.system)] if self.system else []
        messages += [
            Message("user" if t.role == "user" else "assistant", t.text)
            for t in self.turns
            if t.text or t.role == "bot"
        ]
        return messages

    def prompt(self, max_new_tokens: int) -> PromptPlan:
        """The prompt's token ids, leaving room for a reply of ``max_new_tokens`` (see ``prompt_budget``)."""
        messages = self.messages()
        if not any(m.role != "system" for m in messages):
            raise ChatcoreError("the conversation has no turns to reply to")
        budget = prompt_budget(self.engine.loaded.max_positions, max_new_tokens)
        return self.engine.format_for(self).fit(messages, budget)

    def reply(self, options: "ReplyOptions | None" = None, **overrides: Any) -> "Response":
        """A lazy reply to the conversation so far (the last turn should be the user's)."""
        return self.engine.respond(self, options, **overrides)

    def send(self, text: Any, options: "ReplyOptions | None" = None, **overrides: Any) -> "Response":
        """``add_user(text)`` then ``reply()``.

        Options that cannot make a reply (an unknown name, a bad setting, steerers that
        cannot work together) are refused first, so the message is not added or logged.
        """
        options = self.engine.options_for(options, **overrides)
        self.engine.check_options(options)
        self.add_user(text)
        return self.reply(options)

    def _record(self, response: "Response") -> None:
        text = "".join(response._chunks)
        if not text and (response.error is not None or response.interrupted):
            # A reply that failed or was stopped before its first whole word (Ctrl-C while
            # MMI ranks its candidates, a timeout in the middle of the first word) is not a
            # turn: the user's message waits for one.
            return
        self.add_bot_text(text, interrupted=response.interrupted, meta={"provenance": response.provenance})
        self.engine.host.call_each("on_response", conversation=self, response=response)
