"""Pieces the benchmark scripts share (``python bench/NAME.py`` puts this folder on the path)."""

from __future__ import annotations

from typing import Any

LINES = ("i went hiking with my friends last weekend and it was a lot of fun",
         "that sounds great, where did you go? i love the mountains in the fall")


def long_conversation(engine: Any, history_tokens: int, reply_tokens: int) -> Any:
    """A conversation of alternating user and bot turns whose prompt, leaving room for
    ``reply_tokens``, has at least ``history_tokens`` tokens (or all the model's context
    allows)."""
    conversation = engine.conversation()
    conversation.add_user(LINES[0])
    while True:
        before = len(conversation.prompt(reply_tokens).token_ids)
        if before >= history_tokens:
            return conversation
        if len(conversation.turns) % 2:
            conversation.add_bot_text(LINES[1])
        else:
            conversation.add_user(LINES[0])
        if len(conversation.prompt(reply_tokens).token_ids) <= before:
            return conversation  # the model's context is full
