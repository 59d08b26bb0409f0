"""Score processors: transformers' own logits processors, built with chatcore's checks.

A processor is called as ``processor(sequences, scores) -> scores``, where ``sequences``
is (B, T) every token so far (prompt included) and ``scores`` is (B, V) float32: the
call shape of ``transformers.LogitsProcessor``. Token decoders chain them in this
documented order, after the steerers have run, as one ``LogitsProcessorList``:

1. ``logit_bias``           adds a fixed bias to chosen token ids (OpenAI's ``logit_bias``)
2. ``repetition_penalty``   CTRL-style, on every token already in the sequence
3. ``occurrence_penalty``   OpenAI's presence and frequency penalties, on the reply's own tokens
4. ``no_repeat_ngram``      bans tokens that would repeat an n-gram
5. ``temperature``
6. ``top_k``
7. ``top_p``
8. ``min_p``                keeps tokens at least ``min_p`` times as likely as the best

Each range is written once, here, as a field type (:data:`Temperature`, :data:`TopP`,
...) that the decoders' settings declare their fields with; pydantic checks a setting
there. The builders are public API, called with or without settings, so they check their
argument against the same constants and raise ``ValueError`` naming it, then return
transformers' processor; transformers is imported
only when one is built. transformers has no presence or frequency penalty (its
repetition penalty is multiplicative and counts the prompt too), so
:class:`OccurrencePenalty` is chatcore's own, and so is :class:`TokenBias` (see there).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Protocol, cast

from pydantic import BeforeValidator, Field, NonNegativeInt

if TYPE_CHECKING:
    import torch


# Scores are float32, whose largest finite value is about 3.4e38, and a score that
# overflows to +inf makes the probabilities nan. A repetition penalty below 1 multiplies the
# seen tokens' positive scores by its inverse, and the temperature then multiplies every
# score by its own: with both at this bound a score grows at most 1e30-fold, so every score
# up to 3.4e8 in magnitude stays finite. Logits are far smaller (a float16 model's cannot
# pass 65504, and the built-in steerers add at most 100).
MIN_SCORE_DIVISOR = 1e-15
# A temperature beyond float32's largest value is infinite there, and a banned token's
# -inf score divided by it is nan.
MAX_TEMPERATURE = 1e38
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
MAX_LOGIT_BIAS = 100.0  # and for logit_bias values: [-100, 100]

# The ranges above as field types: the decoders' settings declare their fields with these,
# so a bound is written once, here, and the settings, their --help and JSON schema, and
# the builders below (public API, callable without settings) all read it.
Temperature = Annotated[float, Field(ge=MIN_SCORE_DIVISOR, le=MAX_TEMPERATURE)]
RepetitionPenalty = Annotated[float, Field(ge=MIN_SCORE_DIVISOR)]
OccurrencePenaltyValue = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
LogitBiasValue = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]


def is_token_id(key: Any) -> bool:
    """Whether ``key`` names a token id: a non-negative integer, or its digits (JSON's keys are text)."""
    if isinstance(key, bool):
        return False
    if isinstance(key, int):
        return key >= 0
    if isinstance(key, float):
        return key.is_integer() and key >= 0
    return isinstance(key, str) and key.strip().isascii() and key.strip().isdecimal()


def token_id_error(key: Any) -> ValueError:
    """A ``logit_bias`` key that is no token id, named as the key it is (the vocabulary size is
    the model's: the engine checks the upper bound against it)."""
    from chatcore.text import shown_value

    digits = key.strip().removeprefix("-") if isinstance(key, str) else ""
    shown = key.strip() if digits.isascii() and digits.isdecimal() else shown_value(key)
    return ValueError(f"`logit_bias` keys must be token ids in [0, vocab size), got {shown}")


def logit_bias_value_error(token_id: Any, value: float) -> ValueError:
    bounds = f"between {-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}"
    return ValueError(f"`logit_bias` values must be {bounds}, got {value:g} for token {token_id}")


def _checked_entries(bias: Any) -> Any:
    # Before pydantic reads them: its own message would show a key "-1" as the number -1.0,
    # and a key or a value out of bounds as an entry out of an unnamed range.
    if isinstance(bias, dict):
        for key, value in bias.items():
            if not is_token_id(key):
                raise token_id_error(key)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if number and not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise logit_bias_value_error(key, value)
    return bias


LogitBias = Annotated[dict[NonNegativeInt, LogitBiasValue], BeforeValidator(_checked_entries)]
TopP = Annotated[float, Field(gt=0, le=1)]


def _out_of_range(name: str, value: float, low: float, high: float | None = None) -> ValueError:
    from chatcore.options import range_phrase

    bounds = {"minimum": low} if high is None else {"minimum": low, "maximum": high}
    return ValueError(f"`{name}` must be {range_phrase(bounds, integer=False)}, got {value}")


class ScoreProcessor(Protocol):
    def __call__(self, sequences: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor": ...


def repetition_penalty(penalty: float) -> ScoreProcessor:
    """Divide positive scores (multiply negative ones) of already-seen tokens by ``penalty``."""
    from transformers import RepetitionPenaltyLogitsProcessor

    if not penalty >= MIN_SCORE_DIVISOR:
        raise _out_of_range("repetition_penalty", penalty, MIN_SCORE_DIVISOR)
    return RepetitionPenaltyLogitsProcessor(float(penalty))


class OccurrencePenalty:
    """OpenAI's presence and frequency penalties, as its API reference defines them:

        score[j] -= count[j] * frequency + (count[j] > 0) * presence

    where ``count[j]`` is how often token j was generated so far in this reply (the prompt
    does not count). The reply starts where the sequences ended at the first call, so one
    instance serves one reply (a decoder keeps its own; see ``TokenDecoder``).
    """

    def __init__(self, presence: float, frequency: float) -> None:
        for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"`{name}` must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, got {value}")
        self.presence = float(presence)
        self.frequency = float(frequency)
        self.reply_start: int | None = None

    def __call__(self, sequences: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor":
        import torch

        if self.reply_start is None:
            self.reply_start = sequences.shape[1]
        generated = sequences[:, self.reply_start :]  # (B, G)
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def occurrence_penalty(presence: float, frequency: float) -> OccurrencePenalty:
    return OccurrencePenalty(presence, frequency)


class TokenBias:
    """OpenAI's ``logit_bias``: ``bias[token_id]`` added to that token's score, in every row.

    chatcore's own: transformers' ``SequenceBiasLogitsProcessor`` matches sequences, which a
    bias on single tokens does not need, and the oldest transformers chatcore supports (5.15)
    refuses token id 0 there (its check asks for positive ids), which is the EOS of
    GPT-2-style vocabularies, the token a client most often biases.
    """

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = list(bias)
        self.values = [float(value) for value in bias.values()]

    def __call__(self, sequences: "torch.Tensor", scores: "torch.Tensor") -> "torch.Tensor":
        import torch

        kept = [(i, v) for i, v in zip(self.ids, self.values) if i < scores.shape[-1]]
        if not kept:
            return scores
        ids = torch.tensor([i for i, _ in kept], device=scores.device)
        values = torch.tensor([v for _, v in kept], dtype=scores.dtype, device=scores.device)
        biased = scores.clone()
        biased[:, ids] += values
        return biased


def logit_bias(bias: dict[int, float]) -> ScoreProcessor:
    """Add ``bias[token_id]`` to that token's score (-100 bans it in practice, 100 all but forces it)."""
    for token_id, value in bias.items():
        if not isinstance(token_id, int) or not is_token_id(token_id):
            raise token_id_error(token_id)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise logit_bias_value_error(token_id, value)
    return TokenBias(bias)


def no_repeat_ngram(size: int) -> ScoreProcessor:
    """Forbid any token that would complete an n-gram already present in the sequence."""
    from transformers import NoRepeatNGramLogitsProcessor

    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"`no_repeat_ngram_size` must be a positive integer, got {size!r}")
    return NoRepeatNGramLogitsProcessor(size)


def temperature(value: float) -> ScoreProcessor:
    from transformers import TemperatureLogitsWarper

    if not MIN_SCORE_DIVISOR <= value <= MAX_TEMPERATURE:
        raise _out_of_range("temperature", value, MIN_SCORE_DIVISOR, MAX_TEMPERATURE)
    return TemperatureLogitsWarper(float(value))


def top_k(k: int) -> ScoreProcessor:
    """Keep the ``k`` best scores of each row (ties with the k-th included)."""
    from transformers import TopKLogitsWarper

    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"`top_k` must be a positive integer, got {k!r}")
    return TopKLogitsWarper(k)


def top_p(p: float) -> ScoreProcessor:
    """Nucleus filtering: keep the smallest set of tokens whose probability reaches ``p``."""
    from transformers import TopPLogitsWarper

    if not 0.0 < p <= 1.0:
        raise ValueError(f"`top_p` must be in (0, 1], got {p}")
    return TopPLogitsWarper(float(p))


def min_p(p: float) -> ScoreProcessor:
    """Keep the tokens whose probability is at least ``p`` times the most likely one's."""
    from transformers import MinPLogitsWarper

    if not 0.0 < p <= 1.0:
        raise ValueError(f"`min_p` must be in (0, 1], got {p}")
    # transformers types the sequences as LongTensor.
    return cast(ScoreProcessor, MinPLogitsWarper(float(p)))


def rowwise_signature(processors: Sequence[ScoreProcessor]) -> tuple[Any, ...] | None:
    """A key that two processor lists share when they do the same to every score row, each row
    alone, reading no sequences (temperature, top-k, top-p, min-p): rows of several replies
    with that key may then be processed stacked. None when a processor may read the
    sequences or other rows (repetition and occurrence penalties, n-gram bans, a processor
    of a plugin's own)."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    rowwise = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)
    signature = []
    for processor in processors:
        if type(processor) not in rowwise:
            return None
        settings = tuple(sorted(vars(processor).items()))
        try:
            hash(settings)
        except TypeError:
            return None
        signature.append((type(processor), settings))
    return tuple(signature)


def chain(processors: Sequence[ScoreProcessor]) -> ScoreProcessor:
    """The processors as one transformers ``LogitsProcessorList``, applied in order."""
    from transformers import LogitsProcessorList

    # transformers types the sequences as LongTensor; chatcore passes long tensors.
    return cast(ScoreProcessor, _chain_type(LogitsProcessorList)(processors))


@functools.cache
def _chain_type(base: type) -> type:
    """transformers' list, called without the check its ``__call__`` makes on every call: it
    reads each processor's signature (``inspect.signature``, about 0.15 ms a processor) to
    find the extra keyword arguments some of its processors take. Every score processor is
    called as ``processor(sequences, scores)``, and a reply calls its chain once a step, so
    with 16 replies in a batch the check cost more than a tenth of the step."""

    class ProcessorChain(base):
        def __call__(self, input_ids: "torch.Tensor", scores: "torch.Tensor", **kwargs: object) -> "torch.Tensor":
            for processor in self:
                scores = processor(input_ids, scores)
            return scores

    return ProcessorChain
