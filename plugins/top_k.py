"""The ``top-k`` decoder: sampling with temperature, top-k and top-p (nucleus) filtering."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import chatcore
from chatcore.decoding import RepetitionSettings, TokenDecoder
from chatcore.processors import ScoreProcessor, Temperature, TopK, TopP

if TYPE_CHECKING:
    import torch


@dataclass
class TopKSettings(RepetitionSettings):
    top_k: int = 40
    top_p: float = 1.0
    temperature: float = 0.8

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"`top_k` must be a positive integer, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"`top_p` must be in (0, 1], got {self.top_p}")
        if not self.temperature > 0:
            raise ValueError(f"`temperature` must be a positive number, got {self.temperature}")


class TopKDecoder(TokenDecoder):
    name = "top-k"
    description = "samples from the k best tokens (with temperature and top-p)"
    Settings = TopKSettings

    def processors(self) -> list[ScoreProcessor]:
        settings = self.settings
        processors = self.repetition_processors()
        if settings.temperature != 1.0:
            processors.append(Temperature(settings.temperature))
        processors.append(TopK(settings.top_k))
        if settings.top_p < 1.0:
            processors.append(TopP(settings.top_p))
        return processors

    def select(self, scores: "torch.Tensor", generator: "torch.Generator") -> "torch.Tensor":
        import torch

        probabilities = torch.softmax(scores, dim=-1)
        return torch.multinomial(probabilities, num_samples=1, generator=generator).squeeze(1)


@chatcore.hookimpl(trylast=True)
def register_decoders(register: Callable[[type], None]) -> None:
    register(TopKDecoder)
