"""Replies alike in what shapes their scores (one row, row-wise processors, the same stop and
banned tokens) are restricted and processed together, greedy's rows selected in one call,
with one read of the chosen tokens per step: each reply is still the one it would be alone."""

from __future__ import annotations

import pytest
import torch
from test_serving import PROMPTS as SERVING_PROMPTS
from test_serving import alone

from chatcore.decoding import restrict_scores, within
from chatcore.engine import ReplyOptions
from chatcore.plugins.greedy import GreedyDecoder
from chatcore.prompting import Message
from chatcore.serving import Scheduler

PROMPTS = [*SERVING_PROMPTS, "where did you grow up?"]


def batched(engine, prompts, options):
    with Scheduler(engine, max_batch=len(prompts)) as scheduler:
        handles = [scheduler.submit([Message("user", p)], o) for p, o in zip(prompts, options)]
        for handle in handles:
            assert handle.wait(60) and handle.error is None
    return [handle.token_ids for handle in handles]


def rows_seen(monkeypatch, cls, name, position):
    """The row counts of the scores (positional argument ``position``) of every call of ``cls.name``."""
    rows: list[int] = []
    method = getattr(cls, name)

    def counting(self, *arguments):
        rows.append(arguments[position].shape[0])
        return method(self, *arguments)

    monkeypatch.setattr(cls, name, counting)
    return rows


@pytest.fixture
def selections(monkeypatch):
    """The row counts of every greedy select call."""
    return rows_seen(monkeypatch, GreedyDecoder, "select", 0)


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
    assert max(selections) == 2  # only the first two are alike (the sampled one selects alone)


def test_alike_sampled_replies_are_processed_together_and_draw_from_their_own_generators(serving_engine, monkeypatch):
    """Same sampling settings, different seeds: top-k and top-p run once on the stacked rows,
    each reply draws from its own seeded generator, and each equals its reply alone."""
    from transformers import TopKLogitsWarper

    rows = rows_seen(monkeypatch, TopKLogitsWarper, "__call__", 1)
    settings = {"top_k": 20, "temperature": 0.9, "top_p": 0.95}
    options = [
        ReplyOptions(decoder="top-k", seed=seed, max_new_tokens=10, decoder_settings=settings) for seed in range(5)
    ]
    options.append(ReplyOptions(decoder="top-k", seed=9, max_new_tokens=10, decoder_settings={"top_k": 7}))
    expected = [alone(serving_engine, p, o) for p, o in zip(PROMPTS, options)]
    assert len(set(map(tuple, expected))) == len(expected)  # the seeds make different replies
    rows.clear()
    assert batched(serving_engine, PROMPTS, options) == expected
    assert max(rows) == 5  # the five alike; the sixth (another top_k) is processed alone


def test_rowwise_signature_tells_row_wise_processors_apart():
    from chatcore.processors import min_p, no_repeat_ngram, repetition_penalty, rowwise_signature, temperature, top_k

    assert rowwise_signature([]) == ()
    assert rowwise_signature([temperature(0.8), top_k(40)]) == rowwise_signature([temperature(0.8), top_k(40)])
    assert rowwise_signature([temperature(0.8), top_k(40)]) != rowwise_signature([temperature(0.7), top_k(40)])
    assert rowwise_signature([top_k(40), min_p(0.1)]) != rowwise_signature([top_k(40)])
    assert rowwise_signature([top_k(40), repetition_penalty(1.3)]) is None  # it reads the sequences
    assert rowwise_signature([no_repeat_ngram(2)]) is None


def test_within_keeps_the_ids_a_score_row_has():
    ids = within({7, 2, 9, 100, -1}, 10, "cpu")
    assert ids.tolist() == [2, 7, 9]
    scores = torch.zeros(2, 10)
    restricted = restrict_scores(scores, ids, within({3, 50}, 10, "cpu"), early=True)
    banned = restricted[0] == float("-inf")
    assert banned.nonzero().flatten().tolist() == [2, 3, 7, 9] and torch.equal(restricted[0], restricted[1])
    assert torch.equal(scores, torch.zeros(2, 10))  # the caller's scores are left as they were
    assert restrict_scores(scores, within((), 10, "cpu"), ids, early=False) is scores
