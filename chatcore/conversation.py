"""Conversations: a system prompt, turns, and the name of a prompt format. Plain data.

A conversation holds no engine: the engine (:class:`chatcore.engine.Engine`) adds a user's
turn and fires ``on_user_message`` (``engine.add_user``), replies (``engine.respond``,
``engine.send``) and records each reply as a bot turn (``engine.record``). Its prompt
format renders the system prompt and the turns into the prompt's token ids; when they do
not fit the model's context (its positions minus the reply's token budget), the oldest
whole turns are dropped, never the system prompt; if the newest turn alone is too long,
only its most recent tokens are kept. User text is never parsed for special tokens.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from chatcore.errors import ChatcoreError
from chatcore.prompting import clean_system_prompt
from chatcore.values import Message, PromptPlan, Speaker, Turn

Role = Speaker  # the name this module has always given it

__all__ = ["Conversation", "PromptPlan", "Role", "Turn", "build_prompt"]


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
    """The turns of one conversation and its system prompt.

    ``system``: the system prompt (persona), or None. ``prompt_format``: a format name
    for this conversation, or None for the engine's. ``meta``: facts adapters keep with
    it (``adapter``, ``channel_key``, ``title`` ...). ``logged_up_to``: for one resumed
    from the conversation log, the id of the newest message the log held then (its writes
    take everything up to there as read: a retried reply supersedes a reply logged by an
    earlier chat instead of being taken for another chat writing), else 0.
    """

    def __init__(
        self,
        id: str | None = None,
        turns: Sequence[Turn] = (),
        system: str | None = None,
        prompt_format: str | None = None,
        **meta: Any,
    ) -> None:
        self.id = id or uuid.uuid4().hex
        self.turns: list[Turn] = list(turns)
        self.meta: dict[str, Any] = dict(meta)
        self.system = system
        self.prompt_format = prompt_format
        self.logged_up_to = 0

    @property
    def system(self) -> str | None:
        return self._system

    @system.setter
    def system(self, text: str | None) -> None:
        self._system = clean_system_prompt(text)

    def add_bot_text(self, text: str, interrupted: bool = False, meta: dict[str, Any] | None = None) -> Turn:
        """Append a bot turn (a scripted context's; the engine records real replies with
        ``engine.record``, which also fires ``on_response``)."""
        turn = Turn("bot", text, interrupted=interrupted, meta=dict(meta or {}))
        self.turns.append(turn)
        return turn

    def messages(self) -> list[Message]:
        """The system prompt (if any) and the turns, as a prompt format takes them."""
        # Empty replies (possible from a tiny model) stay: they are turns of the dialogue.
        messages = [Message("system", self.system)] if self.system else []
        for turn in self.turns:
            if not (turn.text or turn.role == "bot"):
                continue
            if turn.role == "user" and messages and messages[-1].role == "user":
                # A message whose reply failed waits for one (/retry); the next message joins it
                # as one user turn: templates that need turns to alternate (Mistral's, Gemma's)
                # would otherwise refuse every later reply.
                messages[-1] = Message("user", f"{messages[-1].text}\n\n{turn.text}")
                continue
            messages.append(Message("user" if turn.role == "user" else "assistant", turn.text))
        return messages
