"""Decoders: how each next token is chosen, and how one reply is picked from several rows.

Every reply is decoded by the one runner (:mod:`chatcore.serving.runner`), one step at a
time for all its rows together:

    step (the model, wrapped by the reply's steerers) -> restrict_scores (banned and
    early stop tokens) -> the decoder's processors -> its ``select`` -> append -> stop?

A decoder says how many rows a reply has (:meth:`Decoder.rows`: 1 for token decoders;
``candidates`` for the decoders that sample several replies and keep one), gives the
score processors and the ``select`` rule, may stop the rows early
(:meth:`Decoder.enough`, a quorum of candidates) and, with several rows, picks the reply
(:meth:`Decoder.choose`). A one-row reply streams its tokens as they are chosen; a reply
of several rows is sent whole once the decoder has chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import NonNegativeInt

from chatcore.options import Configurable, Settings
from chatcore.processors import (
    LogitBias,
    OccurrencePenaltyValue,
    RepetitionPenalty,
    ScoreProcessor,
    logit_bias,
    no_repeat_ngram,
    occurrence_penalty,
    repetition_penalty,
)

# The state of one reply and its candidates live beside the steerer interface (which takes
# them); they are re-exported here, where decoders have always imported them.
from chatcore.steering import Candidate as Candidate
from chatcore.steering import GenerationSession as GenerationSession

if TYPE_CHECKING:
    import torch


Select = Callable[["torch.Tensor", "torch.Generator"], "torch.Tensor"]


def restrict_scores(
    scores: "torch.Tensor", banned: "torch.Tensor", stops: "torch.Tensor", early: bool
) -> "torch.Tensor":
    """Ban the ``banned`` tokens, and the ``stops`` too while it is ``early`` (before min_new_tokens):
    too early to stop, as an empty reply helps no one. Both hold ids below the scores' width
    (:func:`within`), so nothing here waits for the device."""
    if early or banned.numel():
        scores = scores.clone()
        if banned.numel():
            scores.index_fill_(1, banned, float("-inf"))
        if early and stops.numel():
            scores.index_fill_(1, stops, float("-inf"))
    return scores


def within(ids: Iterable[int], width: int, device: Any) -> "torch.Tensor":
    """The ``ids`` below ``width`` (a score row's length: a tokenizer may know more tokens than
    the model scores), sorted, as a tensor on ``device``."""
    return to_device(sorted(i for i in ids if 0 <= i < width), device)


def to_device(values: list[int], device: Any) -> "torch.Tensor":
    """``values`` as a long tensor on ``device`` (or a tensor's device), copied without making the
    host wait for the device: on a GPU through pinned memory, so that a reply starting while a
    pass runs (chatcore.serving.ahead) does not wait for it."""
    import torch

    if isinstance(device, torch.Tensor):
        device = device.device
    tensor = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class Sampled:
    """One row of a several-row reply, as :meth:`Decoder.choose` sees it.

    token_ids:  the row's tokens, cut before its stop token.
    forward:    log P(tokens, stop token | prompt) summed over the row's tokens, from the
                scores the model and the reply's steerers gave (before the decoder's
                processors); a row cut at the budget or the quorum has no stop-token term.
    tokens:     how many tokens that sum covers.
    ended:      whether the row reached a stop token before the rows stopped.
    """

    token_ids: list[int]
    forward: float
    tokens: int
    ended: bool

    @property
    def forward_mean(self) -> float:
        return self.forward / self.tokens if self.tokens else 0.0


def selects_from_scores(select: Any) -> Any:
    """Marks a decoder's ``select`` as choosing, for every row, an index of the scores it is
    given (an argmax, a draw from them), as the built-in decoders do. The runner may then
    feed its tokens to the model's next pass before reading them (on a GPU, where that
    pass runs meanwhile); the tokens of an unmarked ``select`` are read and checked first.
    A subclass's own ``select`` is unmarked until it says so too."""
    setattr(select, SELECTS_FROM_SCORES, True)
    return select


SELECTS_FROM_SCORES = "selects_from_scores"


def marked_from_scores(decoder: Any) -> bool:
    """Whether ``decoder``'s own ``select`` is marked with :func:`selects_from_scores`."""
    return bool(getattr(type(decoder).select, SELECTS_FROM_SCORES, False))


class Decoder(Configurable):
    """Base class for decoders: a ``name``, a ``Settings`` model, and the rules below.

    The runner calls them; a decoder never runs the model or a loop of its own.
    ``prepare`` once per reply, then each step ``processors`` (built once per reply) and
    ``select`` on the reply's rows, ``enough`` after each step, and ``choose`` at the end
    of a reply of several rows.
    """

    kind: ClassVar[str] = "decoder"
    # True when ``select`` reads neither the generator nor other rows (each row's token follows
    # from its own scores alone, as greedy's argmax): the runner may then select the rows of
    # several one-row replies in one call, on their scores stacked.
    selects_rows_alone: ClassVar[bool] = False

    def rows(self) -> int:
        """How many rows the reply decodes together (1: the reply itself, streamed)."""
        return 1

    def prepare(self, session: GenerationSession) -> None:
        """Called once per reply before its first step (load what the decoder needs,
        so a reply fails before any token is spent on it)."""

    def processors(self) -> list[ScoreProcessor]:
        """Score processors applied to each step's (rows, V) scores, in order."""
        return []

    def select(self, scores: "torch.Tensor", generator: "torch.Generator") -> "torch.Tensor":
        """Each row's next token (rows,) from its processed scores (rows, V), drawing
        from ``generator`` (the reply's seeded generator) if it samples."""
        raise NotImplementedError

    def enough(self, ended: Sequence[bool], lengths: Sequence[int]) -> bool:
        """Whether the rows may stop now, before every row has ended: ``ended[i]`` says
        whether row i has reached a stop token, ``lengths[i]`` how many tokens it has
        written, the stop token included. Default: wait for every row."""
        return False

    def choose(self, session: GenerationSession, rows: Sequence[Sampled]) -> int:
        """The index of the row that is the reply (several-row decoders implement it and
        may record the rows in ``session.candidates`` and notes in ``session.details``)."""
        raise NotImplementedError(f"decoder {self.name!r} decodes {self.rows()} rows but does not choose one")


class TokenDecoder(Decoder):
    """A decoder of one row that chooses each next token from processed scores."""

    def repetition_processors(self) -> list[ScoreProcessor]:
        processors: list[ScoreProcessor] = []
        bias = getattr(self.settings, "logit_bias", None)
        if bias:
            processors.append(logit_bias(bias))
        penalty = getattr(self.settings, "repetition_penalty", 1.0)
        if penalty != 1.0:
            processors.append(repetition_penalty(penalty))
        presence = getattr(self.settings, "presence_penalty", 0.0)
        frequency = getattr(self.settings, "frequency_penalty", 0.0)
        if presence or frequency:
            # The runner builds a reply's processors once, before its prompt step: the penalty
            # counts the reply's own tokens from the length of the first sequences it sees.
            processors.append(occurrence_penalty(presence, frequency))
        ngram = getattr(self.settings, "no_repeat_ngram_size", 0)
        if ngram:
            processors.append(no_repeat_ngram(ngram))
        return processors

    def processors(self) -> list[ScoreProcessor]:
        return self.repetition_processors()


class RepetitionSettings(Settings):
    """Repetition controls shared by the token decoders (0 / 1.0 switch them off)."""

    no_repeat_ngram_size: NonNegativeInt = 0
    """Never repeat an n-gram of this many tokens (0: off)."""
    repetition_penalty: RepetitionPenalty = 1.0
    """Penalise tokens already in the sequence by this factor, as transformers' repetition
    penalty does (1.0: off). Below 1e-15 the seen tokens' float32 scores could overflow to
    infinity, where they can no longer be told apart and no probability can be computed
    (see chatcore.processors)."""
    presence_penalty: OccurrencePenaltyValue = 0.0
    """Subtract this from the score of every token the reply already holds (OpenAI's; 0: off)."""
    frequency_penalty: OccurrencePenaltyValue = 0.0
    """Subtract this times its count in the reply from each token's score (OpenAI's; 0: off)."""
    logit_bias: LogitBias = {}
    """Token id -> a bias added to its score, as OpenAI's ``logit_bias`` (-100 bans the token)."""
