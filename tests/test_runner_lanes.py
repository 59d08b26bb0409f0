"""Replies alike in what shapes their choice (one row, no processors, a decoder whose rows are
chosen alone) are restricted and selected together, with one read of the chosen tokens per
step: each reply is still the one it would be alone."""

from __future__ import annotations

import pytest
import torch
from test_serving import alone

from chatcore.decoding import restrict_scores, within
from chatcore.engine import ReplyOptions
from chatcore.plugins.greedy import GreedyDecoder
from chatcore.prompting import Message
from chatcore.serving import Scheduler

PROMPTS = [
    "hi, how are you?",
    "what do you do for fun? i like to cook a lot and go hiking with my dog on weekends",
    "tell me about your dog",
    "ok",
    "do you like pizza or pasta more?",
    "where did you grow up?",
]


def batched(engine, prompts, options):
    with Scheduler(engine, max_batch=len(prompts)) as scheduler:
        handles = [scheduler.submit([Message("user", p)], o) for p, o in zip(prompts, options)]
        for handle in handles:
            assert handle.wait(60) and handle.error is None
    return [handle.token_ids for handle in handles]


@pytest.fixture
def selections(monkeypatch):
    """The row counts of every greedy select call."""
    rows: list[int] = []
    select = GreedyDecoder.select

    def counting(self, scores, generator):
        rows.append(scores.shape[0])
        return select(self, scores, generator)

    monkeypatch.setattr(GreedyDecoder, "select", counting)
    return rows


def test_alike_greedy_replies_are_chosen_together_and_equal_their_replies_alone(serving_engine, selections):
    options = [ReplyOptions(decoder="greedy", max_new_tokens=10) for _ in PROMPTS]
    expected = [alone(serving_engine, p, o) for p, o in zip(PROMPTS, options)]
    assert max(selections) == 1
    selections.clear()
    assert batched(serving_engine, PROMPTS, options) == expected
    assert max(selections) == len(PROMPTS)  # every reply's row in one call
    assert len(selections) < sum(len(reply) + 1 for reply in expected) / 2


def test_replies_that_differ_are_not_chosen_together(serving_engine, selections):
    """Another min_new_tokens (stops banned longer), a repetition penalty (a processor), a
    sampled reply: each keeps its own restriction, processors and generator."""
    options = [
        ReplyOptions(decoder="greedy", max_new_tokens=10),
        ReplyOptions(decoder="greedy", max_new_tokens=10),
        ReplyOptions(decoder="greedy", max_new_tokens=10, min_new_tokens=8),
        ReplyOptions(decoder="greedy", max_new_tokens=10, decoder_settings={"repetition_penalty": 1.4}),
        ReplyOptions(decoder="top-k", seed=4, max_new_tokens=10),
        ReplyOptions(decoder="greedy", max_new_tokens=10, logprobs=2),
    ]
    expected = [alone(serving_engine, p, o) for p, o in zip(PROMPTS, options)]
    selections.clear()
    assert batched(serving_engine, PROMPTS, options) == expected
    assert max(selections) == 2  # only the first two are alike


def test_within_keeps_the_ids_a_score_row_has():
    ids = within({7, 2, 9, 100, -1}, 10, "cpu")
    assert ids.tolist() == [2, 7, 9]
    scores = torch.zeros(2, 10)
    restricted = restrict_scores(scores, ids, within({3, 50}, 10, "cpu"), early=True)
    banned = restricted[0] == float("-inf")
    assert banned.nonzero().flatten().tolist() == [2, 3, 7, 9] and torch.equal(restricted[0], restricted[1])
    assert torch.equal(scores, torch.zeros(2, 10))  # the caller's scores are left as they were
    assert restrict_scores(scores, within((), 10, "cpu"), ids, early=False) is scores
