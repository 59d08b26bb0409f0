"""Sampling: the top-k sampler, and sampling several candidate replies in one batch.

The ``top-k`` decoder is registered by its built-in plugin; the candidate sampler is the
shared base of the decoders that sample N replies and choose one (``mmi`` reranks them
by a reverse model, ``rank`` by a bag of words), so those plugins need not import each
other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from pydantic import Field, NonNegativeInt, PositiveInt

from chatcore.decoding import Decoder, RepetitionSettings, Sampled, TokenDecoder, selects_from_scores
from chatcore.processors import ScoreProcessor, Temperature, TopP, min_p, temperature, top_k, top_p

if TYPE_CHECKING:
    import torch


class TopKSettings(RepetitionSettings):
    top_k: PositiveInt = 40
    """Sample from this many best tokens."""
    top_p: TopP = 1.0
    """Nucleus sampling: keep the best tokens whose probabilities add up to this share (1.0: off)."""
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    """Keep only the tokens at least this share as likely as the best one (0.0: off)."""
    temperature: Temperature = 0.8
    """Divide the scores by this before sampling (lower: more predictable). Below 1e-15 the
    float32 scores divided by it could overflow, above 1e38 it is infinite in float32, and
    either way no probability could be computed (see chatcore.processors)."""


class TopKDecoder(TokenDecoder):
    name = "top-k"
    description = "samples from the k best tokens (with temperature and top-p)"
    Settings = TopKSettings

    def processors(self) -> list[ScoreProcessor]:
        settings = self.settings
        processors = self.repetition_processors()
        if settings.temperature != 1.0:
            processors.append(temperature(settings.temperature))
        processors.append(top_k(settings.top_k))
        if settings.top_p < 1.0:
            processors.append(top_p(settings.top_p))
        if settings.min_p > 0.0:
            processors.append(min_p(settings.min_p))
        return processors

    @selects_from_scores
    def select(self, scores: "torch.Tensor", generator: "torch.Generator") -> "torch.Tensor":
        import torch

        probabilities = torch.softmax(scores, dim=-1)
        return torch.multinomial(probabilities, num_samples=1, generator=generator).squeeze(1)


@dataclass
class ContinuationScore:
    """Log-probability of a target given a prefix: the sum over target tokens and their count."""

    total: float
    tokens: int

    @property
    def mean(self) -> float:
        return self.total / self.tokens if self.tokens else 0.0


# One batch holds every candidate: beyond this a reply would take minutes and
# gigabytes (each row keeps its own cache and scores over the whole vocabulary).
MAX_CANDIDATES = 512


class CandidateSettings(TopKSettings):
    """Sampling several candidates in one batch (the top-k settings, with 3-gram blocking on)."""

    # Rerankers reward what a loop repeats (the reverse model the source's words, a word
    # list its words), so much that a candidate stuck in a loop ("teleportation or
    # teleportation or ...") tends to win; blocking repeated 3-grams while sampling keeps
    # such candidates out of the pool.
    no_repeat_ngram_size: NonNegativeInt = 3
    """Never repeat an n-gram of this many tokens (0: off)."""
    candidates: Annotated[int, Field(ge=1, le=MAX_CANDIDATES)] = 8
    """How many replies to sample (one batch)."""
    quorum: Annotated[float, Field(gt=0, le=1)] = 0.5
    """Stop sampling once this share of the candidates has ended at EOS; the others are cut
    off there and win only if no candidate ended (1: wait for every candidate)."""

    def quorum_rows(self) -> int:
        """How many candidates must have ended before sampling stops."""
        return max(1, min(self.candidates, math.ceil(self.quorum * self.candidates - 1e-9)))


class CandidateDecoder(Decoder):
    """Base for decoders that sample ``candidates`` replies as rows of one batch and choose one.

    The runner samples the rows (top-k with this decoder's sampling settings), stops them
    once ``quorum_rows()`` have ended (or at the budget), sums each row's forward
    log-probability from the same pass, and calls :meth:`choose` with them; subclasses
    implement ``choose`` and record the rows in ``session.candidates`` for provenance.
    """

    Settings = CandidateSettings

    def rows(self) -> int:
        return int(self.settings.candidates)

    def sampler(self) -> TopKDecoder:
        """The top-k decoder that samples the candidates, with this decoder's sampling settings."""
        sampling = {name: getattr(self.settings, name) for name in TopKSettings.model_fields}
        return TopKDecoder(TopKSettings(**sampling))

    def processors(self) -> list[ScoreProcessor]:
        return self.sampler().processors()

    @selects_from_scores
    def select(self, scores: "torch.Tensor", generator: "torch.Generator") -> "torch.Tensor":
        """Draw each row's next token from softmax(scores), as the top-k decoder does, but
        only over the row's ``top_k`` best scores. After the top-k processor every other
        score is -inf, so the distribution is the same; the draw needs ``top_k`` random
        numbers per row instead of one per vocabulary entry, which on a CPU is a sizeable
        share of a batched step (8 rows x 8192 tokens)."""
        import torch

        k = min(self.settings.top_k, scores.size(-1))
        best, indices = torch.topk(scores, k, dim=-1)  # (B, k)
        draw = torch.multinomial(torch.softmax(best, dim=-1), num_samples=1, generator=generator)  # (B, 1)
        return indices.gather(1, draw).squeeze(1)

    def enough(self, ended: Sequence[bool], lengths: Sequence[int]) -> bool:
        # An empty reply (a stop token first, when min_new_tokens allows it) does not count.
        return sum(done and length > 1 for done, length in zip(ended, lengths)) >= self.settings.quorum_rows()

    @staticmethod
    def forward_scores(rows: Sequence[Sampled]) -> list[ContinuationScore]:
        """Each row's forward log-probability as a :class:`ContinuationScore`."""
        return [ContinuationScore(row.forward, row.tokens) for row in rows]
