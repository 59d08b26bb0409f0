"""CoCon's training data: dialogues rendered in the model's prompt format, and the
windows (history, content, continuation) sampled from them."""

from __future__ import annotations

from typing import Any

import torch

from chatcore.api import ChatcoreError

# -- data ------------------------------------------------------------------------------


class WindowSampler:
    """Random windows of a token stream: (B, history + continuation) token ids."""

    def __init__(
        self,
        stream: torch.Tensor,
        eos: int,
        history: int,
        continuation: int,
        turn_start_share: float,
        turn_starts: torch.Tensor | None = None,
    ) -> None:
        """turn_starts: where replies start in ``stream``; default: after every ``eos``."""
        self.stream = stream
        self.history = history
        self.length = history + continuation
        if stream.numel() < self.length + 1:
            raise ChatcoreError(f"the corpus has {stream.numel()} tokens, too few for one window of {self.length}")
        # Turn starts that leave room for a whole window.
        starts = (stream == eos).nonzero().flatten() + 1 if turn_starts is None else turn_starts
        self.turn_starts = starts[(starts >= history) & (starts + continuation <= stream.numel())]
        self.turn_start_share = turn_start_share if self.turn_starts.numel() else 0.0

    def sample(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        at_turn = torch.rand(batch, generator=generator) < self.turn_start_share
        anywhere = torch.randint(
            self.history, self.stream.numel() - self.length + self.history + 1, (batch,), generator=generator
        )
        if self.turn_starts.numel():
            picks = self.turn_starts[torch.randint(0, self.turn_starts.numel(), (batch,), generator=generator)]
            split_points = torch.where(at_turn, picks, anywhere)
        else:
            split_points = anywhere
        offsets = torch.arange(-self.history, self.length - self.history)
        return self.stream[split_points[:, None] + offsets[None, :]]  # (B, history + continuation)


CONVERSATION_TURNS = 7  # a held-out chat context (chitchat_heldout: up to 6 turns) and its reply


def render_dialogues(dialogues: Any, prompt_format: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Dialogues as chat renders them: one token stream, and where each reply starts in it.

    Each dialogue is cut into conversations of up to ``CONVERSATION_TURNS`` turns whose
    last turn is the bot's (roles alternate back from it, as in a scripted context), each
    rendered by ``prompt_format`` (a chat template adds its headers and default system
    prompt). A reply starts where ``prompt_format.render`` of the turns before it ends, so
    a window's history is the prompt chat would give the model, and its continuation the
    reply and the format's end-of-turn token.
    """
    from chatcore.api import Message

    stream: list[int] = []
    starts: list[int] = []
    end = prompt_format.end_of_reply_id
    for dialogue in dialogues:
        turns = list(dialogue.turns)
        for first in range(0, len(turns) - 1, CONVERSATION_TURNS):
            chunk = turns[first : first + CONVERSATION_TURNS]
            if len(chunk) < 2:
                continue
            roles = ["assistant" if (len(chunk) - index) % 2 == 1 else "user" for index in range(len(chunk))]
            messages = [Message(role, text) for role, text in zip(roles, chunk)]  # type: ignore[arg-type]
            prompts = {
                index: prompt_format.render(messages[:index])
                for index, message in enumerate(messages)
                if message.role == "assistant" and index > 0
            }
            ids = prompts[len(messages) - 1] + prompt_format.encode_text(chunk[-1]) + [end]
            for prompt in prompts.values():
                # A template may render a turn differently once more turns follow it: only
                # a prompt that is a prefix of the whole conversation marks a reply start.
                if ids[: len(prompt)] == prompt:
                    starts.append(len(stream) + len(prompt))
            stream.extend(ids)
    return torch.tensor(stream, dtype=torch.long), torch.tensor(starts, dtype=torch.long)
