"""Score processors (transformers' own, built with chatcore's checks) on small hand-made logits."""

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

from chatcore.processors import (
    MAX_TEMPERATURE,
    MIN_SCORE_DIVISOR,
    chain,
    logit_bias,
    min_p,
    no_repeat_ngram,
    occurrence_penalty,
    repetition_penalty,
    temperature,
    top_k,
    top_p,
)

INF = float("inf")


def no_sequences(batch: int = 2) -> torch.Tensor:
    return torch.zeros((batch, 1), dtype=torch.long)


# -- exact outputs ------------------------------------------------------------------


def test_top_k_keeps_the_k_best_per_row():
    vocab = 10
    ramp = torch.arange(vocab, dtype=torch.float).unsqueeze(0).repeat(2, 1)
    ramp[1, : vocab // 2] += vocab  # row 1: the first half is best
    original = ramp.clone()
    out = top_k(3)(no_sequences(), ramp)
    assert torch.isinf(out[0]).tolist() == 7 * [True] + 3 * [False]
    assert torch.isinf(out[1]).tolist() == 2 * [True] + 3 * [False] + 5 * [True]
    assert (out[torch.isinf(out)] < 0).all()  # filtered to -inf
    assert torch.equal(out[~torch.isinf(out)], original[~torch.isinf(out)])  # kept scores untouched
    assert torch.equal(ramp, original)  # input not modified


def test_top_k_keeps_ties_and_handles_k_larger_than_vocab():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]])
    assert torch.isinf(top_k(1)(no_sequences(1), scores)).tolist() == [[True, False, False, True, True]]
    assert torch.equal(top_k(99)(no_sequences(1), scores), scores)


def test_top_p_keeps_the_smallest_nucleus():
    distribution = torch.log(torch.tensor([[0.3, 0.1, 0.1, 0.5], [0.15, 0.3, 0.3, 0.25]]))
    out = torch.exp(top_p(0.8)(no_sequences(), distribution))
    expected = torch.tensor([[0.3, 0.0, 0.0, 0.5], [0.0, 0.3, 0.3, 0.25]])
    torch.testing.assert_close(out, expected)


def test_min_p_keeps_tokens_at_least_that_share_as_likely_as_the_best():
    distribution = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    out = torch.exp(min_p(0.35)(no_sequences(), distribution))  # keeps p >= 0.35 * best
    assert (out > 0).tolist() == [[True, True, False, False], [True, True, True, True]]
    with pytest.raises(ValueError, match="`min_p` must be in"):
        min_p(0.0)


def test_top_p_always_keeps_the_best_token_and_one_is_identity():
    scores = torch.tensor([[10.0, 0.0, -1.0, -2.0]])
    out = top_p(0.01)(no_sequences(1), scores)
    assert torch.isinf(out).tolist() == [[False, True, True, True]]
    assert torch.equal(top_p(1.0)(no_sequences(1), scores), scores)


def test_temperature_divides_scores():
    scores = torch.tensor([[1.0, -2.0, 0.5], [0.0, 4.0, -0.25]])
    assert torch.equal(temperature(0.5)(no_sequences(), scores), torch.tensor([[2.0, -4.0, 1.0], [0.0, 8.0, -0.5]]))
    assert torch.equal(temperature(2.0)(no_sequences(), scores), scores / 2)
    # sharper below 1, flatter above 1
    p = scores[1].softmax(-1)
    assert temperature(0.5)(no_sequences(), scores)[1].softmax(-1).max() > p.max()
    assert temperature(2.0)(no_sequences(), scores)[1].softmax(-1).max() < p.max()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_scores():
    sequences = torch.tensor([[0, 2, 2], [1, 1, 3]])
    scores = torch.tensor([[-0.5, 1.0, 2.0, 3.0], [4.0, -1.0, 0.5, 6.0]])
    original = scores.clone()
    out = repetition_penalty(2.0)(sequences, scores)
    expected = torch.tensor([[-1.0, 1.0, 1.0, 3.0], [4.0, -2.0, 0.5, 3.0]])
    assert torch.equal(out, expected)  # a token seen twice is penalised once
    assert torch.equal(scores, original)


def test_repetition_penalty_below_one_encourages_repetition():
    sequences = torch.tensor([[1]])
    scores = torch.tensor([[1.0, 2.0, -4.0]])
    out = repetition_penalty(0.5)(sequences, scores)
    assert torch.equal(out, torch.tensor([[1.0, 4.0, -4.0]]))


def test_occurrence_penalty_is_openais_definition_on_the_replys_tokens_only():
    penalty = occurrence_penalty(presence=0.5, frequency=1.0)
    scores = torch.zeros(1, 6)
    prompt = torch.tensor([[1, 2]])
    assert torch.equal(penalty(prompt, scores.clone()), scores)  # the prompt does not count
    generated = torch.tensor([[1, 2, 4, 4, 5]])
    # count 2 for token 4, 1 for token 5: 2 * 1.0 + 0.5 and 1 * 1.0 + 0.5
    assert penalty(generated, scores.clone()).tolist() == [[0, 0, 0, 0, -2.5, -1.5]]
    with pytest.raises(ValueError, match="`presence_penalty` must be between -2 and 2, got 3"):
        occurrence_penalty(presence=3, frequency=0)


def test_logit_bias_adds_to_the_chosen_tokens_and_checks_its_values():
    scores = torch.zeros(1, 6)
    assert logit_bias({3: 5.0, 1: -100})(torch.tensor([[1, 2]]), scores).tolist() == [[0, -100, 0, 5, 0, 0]]
    # token 0 (GPT-2's EOS) too, in every row; ids past the vocabulary change nothing
    rows = torch.zeros((2, 6))
    assert logit_bias({0: 100.0, 9: 1.0})(torch.tensor([[1], [2]]), rows).tolist() == [[100, 0, 0, 0, 0, 0]] * 2
    with pytest.raises(ValueError, match="`logit_bias` values must be between -100 and 100, got 101"):
        logit_bias({3: 101})
    with pytest.raises(ValueError, match=r"^`logit_bias` keys must be token ids in \[0, vocab size\), got -1$"):
        logit_bias({-1: 1.0})


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"-1": 1}, "`logit_bias` keys must be token ids in [0, vocab size), got -1"),
        ({-2: 1}, "`logit_bias` keys must be token ids in [0, vocab size), got -2"),
        ({"1.5": 1}, "`logit_bias` keys must be token ids in [0, vocab size), got '1.5'"),
        ({"abc": 1}, "`logit_bias` keys must be token ids in [0, vocab size), got 'abc'"),
        ({"5": 1000}, "`logit_bias` values must be between -100 and 100, got 1000 for token 5"),
    ],
)
def test_logit_bias_settings_name_a_bad_key_as_a_key_and_a_bad_value_with_its_range(bias, message):
    from chatcore.decoding import RepetitionSettings
    from chatcore.errors import OptionError

    with pytest.raises(OptionError) as caught:
        RepetitionSettings(logit_bias=bias)
    assert str(caught.value) == message
    assert RepetitionSettings(logit_bias={"5": -100, 7: 2.5}).logit_bias == {5: -100.0, 7: 2.5}


def test_no_repeat_ngram_bans_completions_of_seen_ngrams():
    sequences = torch.tensor([[1, 1, 2, 1], [0, 1, 0, 1]])
    scores = torch.ones((2, 3)) / 3
    two = no_repeat_ngram(2)(sequences, scores)
    three = no_repeat_ngram(3)(sequences, scores)
    assert torch.isinf(two).tolist() == [[False, True, True], [True, False, False]]
    assert torch.isinf(three).tolist() == [[False, False, False], [True, False, False]]
    assert not torch.isinf(scores).any()  # input not modified


def test_no_repeat_ngram_size_one_bans_every_seen_token_and_short_sequences_ban_nothing():
    sequences = torch.tensor([[4, 2]])
    scores = torch.zeros((1, 6))
    assert torch.isinf(no_repeat_ngram(1)(sequences, scores)).tolist() == [[False, False, True, False, True, False]]
    assert torch.equal(no_repeat_ngram(4)(sequences, scores), scores)


# -- transformers' processors, in the documented order -------------------------------


def test_the_builders_give_transformers_own_processors_and_chain_is_a_logits_processor_list():
    from transformers import LogitsProcessorList

    built = [repetition_penalty(1.3), no_repeat_ngram(2), temperature(0.7), top_k(10), top_p(0.9)]
    assert [type(p) for p in built] == [
        RepetitionPenaltyLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    ]
    chained = chain(built)
    assert isinstance(chained, LogitsProcessorList)
    sequences = torch.tensor([[1, 2, 1, 3]])
    scores = torch.randn((1, 12), generator=torch.Generator().manual_seed(0))
    expected = scores
    for processor in built:
        expected = processor(sequences, expected)
    torch.testing.assert_close(chained(sequences, scores.clone()), expected)


def test_top_k_decoder_builds_processors_in_documented_order():
    from chatcore.plugins.top_k import TopKDecoder

    decoder = TopKDecoder.from_options(
        {"top_k": "7", "top_p": "0.8", "temperature": "0.5", "repetition_penalty": "1.2", "no_repeat_ngram_size": "3"}
    )
    processors = decoder.processors()
    assert [type(p) for p in processors] == [
        RepetitionPenaltyLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    ]
    settings = (
        processors[0].penalty,
        processors[1].ngram_size,
        processors[2].temperature,
        processors[3].top_k,
        processors[4].top_p,
    )
    assert settings == (1.2, 3, 0.5, 7, 0.8)
    # neutral settings add no processor
    plain = TopKDecoder.from_options({"top_k": 5, "temperature": 1.0})
    assert [type(p) for p in plain.processors()] == [TopKLogitsWarper]


# -- validation -------------------------------------------------------------------------


def test_scores_stay_finite_at_the_temperature_and_penalty_bounds():
    # A seen token scoring 3.4e8 (far above any logit), divided by the smallest penalty and
    # the smallest temperature: still finite. A banned token's -inf divided by the largest
    # temperature: still -inf, not nan.
    sequences = torch.tensor([[0]])
    scores = torch.tensor([[3.4e8, -3.4e8, 1.0, -math.inf]])
    smallest = chain([repetition_penalty(MIN_SCORE_DIVISOR), temperature(MIN_SCORE_DIVISOR)])(sequences, scores)
    assert torch.isfinite(smallest[0, :3]).all() and smallest[0, 0] > 3e38
    assert torch.softmax(smallest, dim=-1).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    largest = temperature(MAX_TEMPERATURE)(sequences, scores)
    assert largest[0, 3] == -math.inf and not torch.isnan(torch.softmax(largest, dim=-1)).any()
    # Past them the probabilities are nan: a score ten times larger, or an infinite temperature.
    past = chain([repetition_penalty(MIN_SCORE_DIVISOR), temperature(MIN_SCORE_DIVISOR)])(sequences, scores * 10)
    assert torch.isnan(torch.softmax(past, dim=-1)).any()
    assert torch.isnan(scores / torch.tensor(MAX_TEMPERATURE * 10, dtype=torch.float32)).any()


@pytest.mark.parametrize(
    "factory, value, message",
    [
        (top_k, 0, "`top_k` must be a positive integer, got 0"),
        (top_k, -3, "`top_k` must be a positive integer, got -3"),
        (top_k, 2.5, "`top_k` must be a positive integer, got 2.5"),
        (top_p, 0.0, "`top_p` must be in (0, 1], got 0.0"),
        (top_p, 1.5, "`top_p` must be in (0, 1], got 1.5"),
        (top_p, -0.1, "`top_p` must be in (0, 1], got -0.1"),
        (top_p, math.nan, "`top_p` must be in (0, 1], got nan"),
        (temperature, 0, "`temperature` must be between 1e-15 and 1e+38, got 0"),
        (temperature, -1, "`temperature` must be between 1e-15 and 1e+38, got -1"),
        (temperature, 1e-300, "`temperature` must be between 1e-15 and 1e+38, got 1e-300"),
        (temperature, 1e300, "`temperature` must be between 1e-15 and 1e+38, got 1e+300"),
        (repetition_penalty, 0, "`repetition_penalty` must be a number of at least 1e-15, got 0"),
        (repetition_penalty, -1.5, "`repetition_penalty` must be a number of at least 1e-15, got -1.5"),
        (repetition_penalty, 1e-300, "`repetition_penalty` must be a number of at least 1e-15, got 1e-300"),
        (no_repeat_ngram, 0, "`no_repeat_ngram_size` must be a positive integer, got 0"),
        (no_repeat_ngram, "2", "`no_repeat_ngram_size` must be a positive integer, got '2'"),
    ],
)
def test_constructors_name_the_argument_and_value(factory, value, message):
    with pytest.raises(ValueError) as excinfo:
        factory(value)
    assert str(excinfo.value) == message
