"""Sampling: the top-k sampler, and sampling several candidate replies in one batch.

The ``top-k`` decoder is registered by its built-in plugin; the candidate sampler is the
shared base of the decoders that sample N replies and choose one (``mmi`` reranks them
by a reverse model, ``rank`` by a bag of words), so those plugins need not import each
other.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from chatcore.decoding import Decoder, GenerationSession, RepetitionSettings, TokenDecoder
from chatcore.processors import ScoreProcessor, temperature, top_k, top_p
from chatcore.steering import Steerer
from chatcore.step import Step, StepOutput, StepState

if TYPE_CHECKING:
    import torch

    from chatcore.reranking import ContinuationScore


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
            processors.append(temperature(settings.temperature))
        processors.append(top_k(settings.top_k))
        if settings.top_p < 1.0:
            processors.append(top_p(settings.top_p))
        return processors

    def select(self, scores: "torch.Tensor", generator: "torch.Generator") -> "torch.Tensor":
        import torch

        probabilities = torch.softmax(scores, dim=-1)
        return torch.multinomial(probabilities, num_samples=1, generator=generator).squeeze(1)


# One batch holds every candidate: beyond this a reply would take minutes and
# gigabytes (each row keeps its own cache and scores over the whole vocabulary).
MAX_CANDIDATES = 512


@dataclass
class CandidateSettings(TopKSettings):
    """Sampling several candidates in one batch (the top-k settings, with 3-gram blocking on).

    candidates:            how many replies to sample (one batch).
    quorum:                stop sampling once this share of the candidates has ended at EOS; the
                           others are cut off there and win only if no candidate ended (1: wait
                           for every candidate, as the batch would otherwise run until its
                           longest reply ends).
    """

    # Rerankers reward what a loop repeats (the reverse model the source's words, a word
    # list its words), so much that a candidate stuck in a loop ("teleportation or
    # teleportation or ...") tends to win; blocking repeated 3-grams while sampling keeps
    # such candidates out of the pool.
    no_repeat_ngram_size: int = 3
    candidates: int = 8
    quorum: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            not isinstance(self.candidates, int)
            or isinstance(self.candidates, bool)
            or not 1 <= self.candidates <= MAX_CANDIDATES
        ):
            raise ValueError(f"`candidates` must be an integer from 1 to {MAX_CANDIDATES}, got {self.candidates!r}")
        if isinstance(self.quorum, bool) or not isinstance(self.quorum, (int, float)) or not 0 < self.quorum <= 1:
            raise ValueError(f"`quorum` must be a number in (0, 1], got {self.quorum!r}")

    def quorum_rows(self) -> int:
        """How many candidates must have ended before sampling stops."""
        return max(1, min(self.candidates, math.ceil(self.quorum * self.candidates - 1e-9)))


class CandidateDecoder(Decoder):
    """Base for decoders that sample ``candidates`` replies in one batch and choose one.

    Subclasses implement ``decode``: ``sample_candidates(session)`` gives the replies,
    their forward scores and whether each ended; ``session.candidates`` is where the
    choice and its scores are recorded for provenance.
    """

    Settings = CandidateSettings

    def sampler(self) -> TopKDecoder:
        """The top-k decoder that samples the candidates, with this decoder's sampling settings."""
        sampling = {f.name: getattr(self.settings, f.name) for f in fields(TopKSettings)}
        return TopKDecoder(TopKSettings(**sampling))

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

    def sample_candidates(
        self,
        session: GenerationSession,
    ) -> "tuple[list[list[int]], list[ContinuationScore], list[bool]]":
        """``candidates`` replies from one batched decoding pass, each cut at its own stop
        token (EOS, or any of the prompt format's, such as ``<|im_end|>``), with their
        forward log-probabilities taken from the same pass, and whether each ended (at a
        stop token) before the pass stopped: when ``quorum_rows()`` of them had ended,
        or at ``max_new_tokens``."""
        import torch

        from chatcore.reranking import ContinuationScore

        sampler = self.sampler()
        stops = session.stop_ids
        rows = self.settings.candidates
        recorder = StepLogProbabilities()
        # The recorder wraps outermost, so it sees the scores every steerer has made.
        candidate_session = dataclasses.replace(session, steerers=[*session.steerers, recorder])
        device = session.model.device
        steps: list[torch.Tensor] = []
        totals = torch.zeros(rows, dtype=torch.float64, device=device)
        counts = torch.zeros(rows, dtype=torch.long, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        quorum = self.settings.quorum_rows()
        stop_tensor = torch.tensor(sorted(stops), dtype=torch.long, device=device)
        for tokens in candidate_session.run(sampler.processors(), self.select, rows=rows):
            log_probs = recorder.log_probs
            assert log_probs is not None  # the step that picked ``tokens`` recorded them
            picked = log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)  # (B,)
            totals += torch.where(finished, torch.zeros_like(picked), picked).double()
            counts += (~finished).long()
            finished |= torch.isin(tokens, stop_tensor)
            steps.append(tokens)
            # An empty reply (EOS first, when min_new_tokens allows it) does not count.
            if int((finished & (counts > 1)).sum()) >= quorum:
                break  # closing the generator ends the batch here
        generated = torch.stack(steps, dim=1).tolist()  # (B, T)
        replies = [row[: next((i for i, t in enumerate(row) if t in stops), len(row))] for row in generated]
        forward = [ContinuationScore(float(t), int(c)) for t, c in zip(totals.tolist(), counts.tolist())]
        return replies, forward, finished.tolist()


class StepLogProbabilities(Steerer):
    """Not a user-facing steerer: keeps the log-probabilities of each step's final scores."""

    name = "mmi-forward-score"

    def __init__(self) -> None:
        super().__init__(settings=None)
        self.log_probs: "torch.Tensor | None" = None

    def wrap(self, step: Step) -> Step:
        import torch

        def recording(state: StepState) -> StepOutput:
            output = step(state)
            self.log_probs = torch.log_softmax(output.logits, dim=-1)  # (B, V)
            return output

        return recording
