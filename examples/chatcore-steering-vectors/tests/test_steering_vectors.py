"""The activation-addition steerer, as its users see it."""

import pytest

from chatcore.api import OptionError
from chatcore.testing import compare_to_baseline, openers

FOOD = {
    "positive": "I love cooking dinner|let us talk about food|pizza and pasta are delicious"
    "|I am hungry, what should I eat?",
    "negative": "I love playing soccer|let us talk about movies|my job is boring|I am tired, what should I do?",
}


def test_the_package_registers_the_steerer(chatcore_engine):
    assert chatcore_engine.registry.steerers["activation-addition"].plugin == "chatcore_steering_vectors"


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"positive": ""}, "`positive` must give at least one prompt"),
        ({"negative": " | "}, "`negative` must give at least one prompt"),
        ({"strength": "1000"}, "`strength` must be between -100 and 100, got 1000.0"),
        ({"layer": "-1"}, "`layer` must be a non-negative integer, got -1"),
        ({"positions": "some"}, "`positions` must be one of all, new, got 'some'"),
        ({"colour": "red"}, "unknown setting for steerer 'activation-addition': 'colour'"),
    ],
)
def test_bad_settings_are_refused_by_name(chatcore_engine, settings, message):
    with pytest.raises(OptionError, match=message):
        chatcore_engine.make_steerer("activation-addition", {**FOOD, **settings})


@pytest.mark.parametrize("left_out", ["positive", "negative"])
def test_prompts_left_out_are_refused_where_the_steerer_is_configured(chatcore_engine, left_out):
    given = {name: value for name, value in FOOD.items() if name != left_out}
    with pytest.raises(OptionError, match=f"`{left_out}` must give at least one prompt"):
        chatcore_engine.make_steerer("activation-addition", given)


def test_a_layer_the_model_lacks_is_refused_before_generating(chatcore_engine, chatcore_conversation):
    conversation = chatcore_conversation("hi")
    with pytest.raises(OptionError, match="`layer` must be below the model's 2 layers, got 2"):
        chatcore_engine.respond(
            conversation, steerers=[("activation-addition", {**FOOD, "layer": 2})], max_new_tokens=3
        ).text()


def test_the_reply_records_the_layer_it_steered(chatcore_engine, chatcore_conversation):
    conversation = chatcore_conversation("hi", "hello! how are you?", "hungry. what is for dinner?")
    response = chatcore_engine.respond(
        conversation, decoder="greedy", steerers=[("activation-addition", FOOD)], max_new_tokens=4
    )
    response.text()
    details = response.provenance["details"]["activation-addition"]
    assert details["layer"] == 0  # a third of the tiny model's two layers, rounded down
    assert details["vector_norm"] > 0


def test_the_vector_is_computed_once_and_shared_by_every_reply(chatcore_engine, chatcore_conversation, monkeypatch):
    from chatcore_steering_vectors import steerer as steerer_module

    calls = []
    real = steerer_module.mean_block_output
    monkeypatch.setattr(steerer_module, "mean_block_output", lambda *a, **k: calls.append(1) or real(*a, **k))
    conversation = chatcore_conversation("hi")
    for _ in range(3):
        chatcore_engine.respond(
            conversation, decoder="greedy", steerers=[("activation-addition", FOOD)], max_new_tokens=2
        ).text()
        chatcore_engine.add_user(conversation, "and then?")
    assert len(calls) == 2  # positive and negative means, for the first reply only


@pytest.mark.slow
def test_steering_toward_food_makes_food_replies_more_common(chatcore_engine_factory, chatcore_bundled_model):
    engine = chatcore_engine_factory(model=chatcore_bundled_model)
    comparison = compare_to_baseline(
        engine,
        "activation-addition",
        {**FOOD, "layer": 3, "strength": 2},
        contexts=openers()[:12],
        seeds=[0],
        vocabulary="food",
        max_new_tokens=24,
    )
    assert comparison.steered.attribute_share >= comparison.baseline.attribute_share + 0.2
    assert comparison.perplexity_ratio < 10
