"""Llama-family chat models (tiny, random, with a chat template): greedy equals transformers'
``generate`` on ``apply_chat_template``'s prompt, top-k is reproducible, bow-bias steers."""

from __future__ import annotations

import pytest
import torch

from chatcore.testing import make_engine

ARCHITECTURES = ["llama", "qwen2", "gemma", "mistral", "phi3"]
CONTEXTS = [
    ["hi"],
    ["hello there", "hey! how are you?", "pretty good, just got back from work"],
]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def template_engine(request, tiny_chat_model_dir):
    """An engine on a tiny chat model (chat template, rotary positions) of each architecture."""

    return make_engine(tiny_chat_model_dir(request.param), "chatcore.plugins.bow_bias")


def hf_greedy(engine, messages, max_new_tokens):
    chat = [{"role": m.role, "content": m.text} for m in messages]
    inputs = engine.tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    stops = sorted(engine.prompt_format.stop_token_ids)
    banned = [[i] for i in sorted(engine.prompt_format.banned_token_ids)]
    with torch.no_grad():
        output = engine.loaded.model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=stops,
            pad_token_id=stops[0],
            bad_words_ids=banned or None,
        )
    new = output[0, inputs["input_ids"].shape[1] :].tolist()
    for index, token in enumerate(new):
        if token in stops:
            return new[:index]
    return new


@pytest.mark.parametrize("system", [None, "You are terse."])
@pytest.mark.parametrize("turns", CONTEXTS)
def test_greedy_equals_generate_on_the_chat_template(template_engine, turns, system):
    conversation = template_engine.scripted(turns, system=system)
    expected = hf_greedy(template_engine, conversation.messages(), 12)
    response = template_engine.respond(conversation, decoder="greedy", max_new_tokens=12)
    response.text()
    assert template_engine.prompt_format.name == "chat-template"
    assert response.token_ids == expected


def test_top_k_is_reproducible_and_bow_bias_steers(template_engine):
    def sampled(seed):
        response = template_engine.reply_to(["hi there"], seed=seed, max_new_tokens=10)
        response.text()
        return response.token_ids

    assert sampled(5) == sampled(5) and sampled(5)
    assert sampled(5) != sampled(6)
    plain = template_engine.reply_to(["hi there"], seed=5, max_new_tokens=10, decoder="greedy").text()
    steered = template_engine.reply_to(
        ["hi there"],
        seed=5,
        max_new_tokens=10,
        decoder="greedy",
        steerers=[("bow-bias", {"words": "pizza", "strength": 50})],
    )
    # Random weights: the bias wins at every step, so every token starts, continues or is the word.
    assert steered.text() != plain
    pieces = [template_engine.tokenizer.decode([token]).strip().lower() for token in steered.token_ids]
    assert all(piece and piece in "pizza" for piece in pieces), pieces
