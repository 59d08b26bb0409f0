"""The ``greedy`` decoder: always the highest-scoring token."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import chatcore
from chatcore.api import RepetitionSettings, TokenDecoder, selects_from_scores

if TYPE_CHECKING:
    import torch


class GreedySettings(RepetitionSettings):
    pass


class GreedyDecoder(TokenDecoder):
    name = "greedy"
    description = "the most likely token at every step (deterministic)"
    Settings = GreedySettings
    selects_rows_alone = True

    @selects_from_scores
    def select(self, scores: "torch.Tensor", generator: "torch.Generator") -> "torch.Tensor":
        return scores.argmax(dim=-1)


@chatcore.hookimpl(trylast=True)
def register_decoders(register: Callable[[type], None]) -> None:
    register(GreedyDecoder)
