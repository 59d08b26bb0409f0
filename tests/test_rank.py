"""The ``rank`` decoder: batched candidates, the most fluent one on topic wins."""

from __future__ import annotations

import pytest

from chatcore.engine import Engine, ReplyOptions
from chatcore.errors import OptionError
from chatcore.evaluation.metrics import contains_any, is_degenerate
from chatcore.plugins.rank import choose_on_topic
from chatcore.wordlists import WORDLIST_DIR, read_word_file


@pytest.fixture
def rank_host(host):
    host.load_modules(("chatcore.plugins.rank",))
    assert host.problems == []
    return host


def test_choose_prefers_on_topic_then_fluent():
    fluency = [-1.0, -3.0, -2.0, -0.5]
    assert choose_on_topic(fluency, [False, True, True, False], [True] * 4) == 2
    assert choose_on_topic(fluency, [False] * 4, [True] * 4) == 3  # nothing on topic: the most fluent
    assert choose_on_topic(fluency, [False, True, True, True], [True, True, True, False]) == 2  # unusable loses
    assert choose_on_topic(fluency, [True] * 4, [False] * 4) == 3  # nothing usable: the most fluent of all
    with pytest.raises(ValueError):
        choose_on_topic([], [], [])


def test_the_winner_is_the_most_fluent_usable_candidate_on_topic(bundled_model, rank_host):
    engine = Engine(bundled_model, host=rank_host)
    food = set(read_word_file(WORDLIST_DIR / "food.txt"))
    chosen_on_topic = 0
    for seed in range(4):
        # A logit steerer makes food words likely enough that some candidates carry one.
        options = ReplyOptions(
            decoder="rank",
            decoder_settings={"topic": "food", "candidates": 6, "quorum": 1},
            steerers=[("bow-bias", {"topic": "food", "strength": 3})],
            seed=seed,
            max_new_tokens=24,
        )
        response = engine.reply_to(["what did you do today?"], options)
        text = response.text()
        candidates = response.provenance["candidates"]
        assert len(candidates) == 6
        for candidate in candidates:  # the recorded flags are what the metrics say of the text
            assert candidate["scores"]["on_topic"] == float(contains_any(candidate["text"], food))
            ended = candidate["scores"]["ended"] == 1.0
            usable = bool(candidate["token_ids"]) and ended and not is_degenerate(candidate["text"])
            assert candidate["scores"]["usable"] == float(usable)
        (chosen,) = [c for c in candidates if c["chosen"]]
        assert chosen["text"] == text and chosen["token_ids"] == response.token_ids
        pool = [c for c in candidates if c["scores"]["usable"] and c["scores"]["on_topic"]]
        pool = pool or [c for c in candidates if c["scores"]["usable"]] or candidates
        assert chosen["scores"]["forward_mean"] == max(c["scores"]["forward_mean"] for c in pool)
        chosen_on_topic += bool(chosen["scores"]["on_topic"])
    assert chosen_on_topic >= 1


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({}, "topic"),
        ({"topic": "cooking-shows"}, "topic"),
        ({"words": "pizza", "candidates": 0}, "candidates"),
        ({"words": "pizza", "quorum": 2}, "quorum"),
    ],
)
def test_bad_settings_are_refused(settings, field, bundled_model, rank_host):
    with pytest.raises(OptionError, match=field):
        Engine(bundled_model, host=rank_host).make_decoder("rank", settings)
