"""The ``greedy`` decoder: always the highest-scoring token."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

import chatcore
from chatcore.decoding import RepetitionSettings, TokenDecoder
from chatcore.processors import MIN_SCORE_DIVISOR

if TYPE_CHECKING:
    import torch


class GreedySettings(RepetitionSettings):
    repetition_penalty: Annotated[float, Field(ge=MIN_SCORE_DIVISOR)] = 1.0
    """Penalise tokens already in the sequence by this factor, as transformers' repetition
    penalty does (1.0: off). Below 1e-15 the seen tokens' float32 scores could overflow to
    infinity, where the best of them can no longer be told apart (see chatcore.processors)."""


class GreedyDecoder(TokenDecoder):
    name = "greedy"
    description = "the most likely token at every step (deterministic)"
    Settings = GreedySettings

    def select(self, scores: "torch.Tensor", generator: "torch.Generator") -> "torch.Tensor":
        return scores.argmax(dim=-1)


@chatcore.hookimpl(trylast=True)
def register_decoders(register: Callable[[type], None]) -> None:
    register(GreedyDecoder)
