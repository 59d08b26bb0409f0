"""Score processors on small hand-made logits, and against transformers' processors."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from chatcore.processors import NoRepeatNGram, RepetitionPenalty, Temperature, TopK, TopP

INF = float("inf")


def no_sequences(batch: int = 2) -> torch.Tensor:
    return torch.zeros((batch, 1), dtype=torch.long)


# -- exact outputs ------------------------------------------------------------------


def test_top_k_keeps_the_k_best_per_row():
    vocab = 10
    ramp = torch.arange(vocab, dtype=torch.float).unsqueeze(0).repeat(2, 1)
    ramp[1, : vocab // 2] += vocab  # row 1: the first half is best
    original = ramp.clone()
    out = TopK(3)(no_sequences(), ramp)
    assert torch.isinf(out[0]).tolist() == 7 * [True] + 3 * [False]
    assert torch.isinf(out[1]).tolist() == 2 * [True] + 3 * [False] + 5 * [True]
    assert (out[torch.isinf(out)] < 0).all()  # filtered to -inf
    assert torch.equal(out[~torch.isinf(out)], original[~torch.isinf(out)])  # kept scores untouched
    assert torch.equal(ramp, original)  # input not modified


def test_top_k_keeps_ties_and_handles_k_larger_than_vocab():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]])
    assert torch.isinf(TopK(1)(no_sequences(1), scores)).tolist() == [[True, False, False, True, True]]
    assert torch.equal(TopK(99)(no_sequences(1), scores), scores)


def test_top_p_keeps_the_smallest_nucleus():
    distribution = torch.log(torch.tensor([[0.3, 0.1, 0.1, 0.5], [0.15, 0.3, 0.3, 0.25]]))
    out = torch.exp(TopP(0.8)(no_sequences(), distribution))
    expected = torch.tensor([[0.3, 0.0, 0.0, 0.5], [0.0, 0.3, 0.3, 0.25]])
    torch.testing.assert_close(out, expected)


def test_top_p_always_keeps_the_best_token_and_one_is_identity():
    scores = torch.tensor([[10.0, 0.0, -1.0, -2.0]])
    out = TopP(0.01)(no_sequences(1), scores)
    assert torch.isinf(out).tolist() == [[False, True, True, True]]
    assert torch.equal(TopP(1.0)(no_sequences(1), scores), scores)


def test_temperature_divides_scores():
    scores = torch.tensor([[1.0, -2.0, 0.5], [0.0, 4.0, -0.25]])
    assert torch.equal(Temperature(0.5)(no_sequences(), scores), torch.tensor([[2.0, -4.0, 1.0], [0.0, 8.0, -0.5]]))
    assert torch.equal(Temperature(2.0)(no_sequences(), scores), scores / 2)
    # sharper below 1, flatter above 1
    p = scores[1].softmax(-1)
    assert Temperature(0.5)(no_sequences(), scores)[1].softmax(-1).max() > p.max()
    assert Temperature(2.0)(no_sequences(), scores)[1].softmax(-1).max() < p.max()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_scores():
    sequences = torch.tensor([[0, 2, 2], [1, 1, 3]])
    scores = torch.tensor([[-0.5, 1.0, 2.0, 3.0], [4.0, -1.0, 0.5, 6.0]])
    original = scores.clone()
    out = RepetitionPenalty(2.0)(sequences, scores)
    expected = torch.tensor([[-1.0, 1.0, 1.0, 3.0], [4.0, -2.0, 0.5, 3.0]])
    assert torch.equal(out, expected)  # a token seen twice is penalised once
    assert torch.equal(scores, original)


def test_repetition_penalty_below_one_encourages_repetition():
    sequences = torch.tensor([[1]])
    scores = torch.tensor([[1.0, 2.0, -4.0]])
    out = RepetitionPenalty(0.5)(sequences, scores)
    assert torch.equal(out, torch.tensor([[1.0, 4.0, -4.0]]))


def test_no_repeat_ngram_bans_completions_of_seen_ngrams():
    sequences = torch.tensor([[1, 1, 2, 1], [0, 1, 0, 1]])
    scores = torch.ones((2, 3)) / 3
    two = NoRepeatNGram(2)(sequences, scores)
    three = NoRepeatNGram(3)(sequences, scores)
    assert torch.isinf(two).tolist() == [[False, True, True], [True, False, False]]
    assert torch.isinf(three).tolist() == [[False, False, False], [True, False, False]]
    assert not torch.isinf(scores).any()  # input not modified


def test_no_repeat_ngram_size_one_bans_every_seen_token_and_short_sequences_ban_nothing():
    sequences = torch.tensor([[4, 2]])
    scores = torch.zeros((1, 6))
    assert torch.isinf(NoRepeatNGram(1)(sequences, scores)).tolist() == [[False, False, True, False, True, False]]
    assert torch.equal(NoRepeatNGram(4)(sequences, scores), scores)


# -- against transformers -------------------------------------------------------------


def random_case(seed: int, batch: int = 4, vocab: int = 40, length: int = 14, id_range: int = 7):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn((batch, vocab), generator=generator) * 3
    # a small id range makes repeated tokens and n-grams likely
    sequences = torch.randint(0, id_range, (batch, length), generator=generator)
    return sequences, scores


SEEDS = range(8)


@pytest.mark.parametrize("k", [1, 2, 5, 17, 40, 100])
def test_top_k_matches_transformers(k):
    for seed in SEEDS:
        sequences, scores = random_case(seed)
        torch.testing.assert_close(TopK(k)(sequences, scores), TopKLogitsWarper(k)(sequences, scores.clone()))


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9, 0.999, 1.0])
def test_top_p_matches_transformers(p):
    for seed in SEEDS:
        sequences, scores = random_case(seed)
        torch.testing.assert_close(TopP(p)(sequences, scores), TopPLogitsWarper(p)(sequences, scores.clone()))


@pytest.mark.parametrize("t", [0.1, 0.7, 1.0, 1.5, 10.0])
def test_temperature_matches_transformers(t):
    for seed in SEEDS:
        sequences, scores = random_case(seed)
        torch.testing.assert_close(
            Temperature(t)(sequences, scores), TemperatureLogitsWarper(t)(sequences, scores.clone())
        )


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.2, 2.0, 7.5])
def test_repetition_penalty_matches_transformers(penalty):
    for seed in SEEDS:
        sequences, scores = random_case(seed)
        torch.testing.assert_close(
            RepetitionPenalty(penalty)(sequences, scores),
            RepetitionPenaltyLogitsProcessor(penalty)(sequences, scores.clone()),
        )


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 2, 3, 14])
def test_no_repeat_ngram_matches_transformers(n, length):
    banned_something = False
    for seed in SEEDS:
        sequences, scores = random_case(seed, length=length, id_range=4)
        ours = NoRepeatNGram(n)(sequences, scores)
        theirs = NoRepeatNGramLogitsProcessor(n)(sequences, scores.clone())
        torch.testing.assert_close(ours, theirs)
        banned_something |= bool(torch.isinf(ours).any())
    if length >= n + 2:
        assert banned_something


def test_chain_in_documented_order_matches_transformers():
    sequences, scores = random_case(42)
    ours = scores
    for processor in (RepetitionPenalty(1.3), NoRepeatNGram(2), Temperature(0.7), TopK(10), TopP(0.9)):
        ours = processor(sequences, ours)
    theirs = scores.clone()
    for processor in (
        RepetitionPenaltyLogitsProcessor(1.3),
        NoRepeatNGramLogitsProcessor(2),
        TemperatureLogitsWarper(0.7),
        TopKLogitsWarper(10),
        TopPLogitsWarper(0.9),
    ):
        theirs = processor(sequences, theirs)
    torch.testing.assert_close(ours, theirs)


def test_top_k_decoder_builds_processors_in_documented_order():
    from chatcore.plugins.top_k import TopKDecoder

    decoder = TopKDecoder.from_options(
        {"top_k": "7", "top_p": "0.8", "temperature": "0.5", "repetition_penalty": "1.2", "no_repeat_ngram_size": "3"}
    )
    processors = decoder.processors()
    assert [type(p) for p in processors] == [RepetitionPenalty, NoRepeatNGram, Temperature, TopK, TopP]
    assert (processors[0].penalty, processors[1].size, processors[2].temperature, processors[3].k, processors[4].p) == (
        1.2,
        3,
        0.5,
        7,
        0.8,
    )
    # neutral settings add no processor
    plain = TopKDecoder.from_options({"top_k": 5, "temperature": 1.0})
    assert [type(p) for p in plain.processors()] == [TopK]


# -- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory, value, message",
    [
        (TopK, 0, "`top_k` must be a positive integer, got 0"),
        (TopK, -3, "`top_k` must be a positive integer, got -3"),
        (TopK, 2.5, "`top_k` must be a positive integer, got 2.5"),
        (TopP, 0.0, "`top_p` must be in (0, 1], got 0.0"),
        (TopP, 1.5, "`top_p` must be in (0, 1], got 1.5"),
        (TopP, -0.1, "`top_p` must be in (0, 1], got -0.1"),
        (TopP, math.nan, "`top_p` must be in (0, 1], got nan"),
        (Temperature, 0, "`temperature` must be a positive number, got 0"),
        (Temperature, -1, "`temperature` must be a positive number, got -1"),
        (RepetitionPenalty, 0, "`repetition_penalty` must be a positive number, got 0"),
        (RepetitionPenalty, -1.5, "`repetition_penalty` must be a positive number, got -1.5"),
        (NoRepeatNGram, 0, "`no_repeat_ngram_size` must be a positive integer, got 0"),
        (NoRepeatNGram, "2", "`no_repeat_ngram_size` must be a positive integer, got '2'"),
    ],
)
def test_constructors_name_the_argument_and_value(factory, value, message):
    with pytest.raises(ValueError) as excinfo:
        factory(value)
    assert str(excinfo.value) == message
