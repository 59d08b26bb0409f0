"""Our KV-cached decoding loop against transformers' own ``generate``.

Greedy decoding (plain, with a repetition penalty, with an n-gram ban) must give
exactly the token ids ``model.generate`` gives, and top-k/top-p sampling with a seeded
``torch.Generator`` must draw exactly what ``generate`` draws from the global RNG
seeded with the same number. Our decoders stop at EOS and do not return it, so
``generate``'s output is compared up to its first EOS.
"""

from __future__ import annotations

import pytest
import torch

from chatcore.engine import ReplyOptions

MESSAGES = [
    "hi",
    "how are you doing today?",
    "i like pizza and movies, what about you?",
    "what's up",
    "Tell me something about the weather in Paris!",
]

CONTEXTS = [
    ["hi"],
    ["hello there", "hey! how are you?", "pretty good, just got back from work"],
    ["do you like music?", "yes, mostly jazz", "cool", "and you?", "I listen to rock a lot"],
]


def conversation_for(engine, turns):
    """A conversation whose turns alternate and end with the user's."""
    conversation = engine.conversation()
    for index, text in enumerate(turns):
        if (len(turns) - index) % 2 == 1:
            engine.add_user(conversation, text)
        else:
            conversation.add_bot_text(text)
    return conversation


def hf_generate(loaded, prompt_ids, max_new_tokens, min_new_tokens=0, **kwargs):
    model = loaded.model
    eos = loaded.eos_token_id
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.no_grad():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            pad_token_id=eos,
            **kwargs,
        )
    new = output[0, len(prompt_ids) :].tolist()
    if eos in new:
        new = new[: new.index(eos)]
    return new


def ours(engine, turns, options):
    conversation = conversation_for(engine, turns)
    prompt = engine.prompt(conversation, options.max_new_tokens).token_ids
    response = engine.respond(conversation, options)
    response.text()
    assert response.done and not response.interrupted
    return prompt, response.token_ids


def all_contexts():
    return [[m] for m in MESSAGES] + CONTEXTS


@pytest.mark.parametrize("min_new_tokens", [0, 5, 24])
def test_greedy_matches_generate(engine, loaded, min_new_tokens):
    max_new = 24
    compared_nonempty = 0
    for turns in all_contexts():
        options = ReplyOptions(decoder="greedy", min_new_tokens=min_new_tokens, max_new_tokens=max_new, seed=0)
        prompt, got = ours(engine, turns, options)
        expected = hf_generate(loaded, prompt, max_new, min_new_tokens, do_sample=False)
        assert got == expected, turns
        assert loaded.eos_token_id not in got
        compared_nonempty += bool(got)
        if min_new_tokens == max_new:
            assert len(got) == max_new
    assert compared_nonempty >= 4


def test_greedy_prompt_is_dialogpt_formatted(engine, loaded):
    conversation = conversation_for(engine, ["hello there", "hey!", "how are you?"])
    ids = engine.prompt(conversation, 16).token_ids
    eos = loaded.eos_token_id
    assert ids[-1] == eos
    assert ids.count(eos) == 3


@pytest.mark.parametrize(
    "settings, hf_kwargs",
    [
        ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
        ({"repetition_penalty": "0.7"}, {"repetition_penalty": 0.7}),
        ({"no_repeat_ngram_size": 2}, {"no_repeat_ngram_size": 2}),
        ({"no_repeat_ngram_size": 1}, {"no_repeat_ngram_size": 1}),
        (
            {"no_repeat_ngram_size": 3, "repetition_penalty": 1.5},
            {"no_repeat_ngram_size": 3, "repetition_penalty": 1.5},
        ),
    ],
)
def test_greedy_with_repetition_controls_matches_generate(engine, loaded, settings, hf_kwargs):
    max_new = 20
    plain_differs = False
    for turns in all_contexts()[:5]:
        options = ReplyOptions(
            decoder="greedy", decoder_settings=settings, min_new_tokens=max_new, max_new_tokens=max_new, seed=0
        )
        prompt, got = ours(engine, turns, options)
        expected = hf_generate(loaded, prompt, max_new, max_new, do_sample=False, **hf_kwargs)
        assert got == expected, turns
        plain = hf_generate(loaded, prompt, max_new, max_new, do_sample=False)
        plain_differs |= plain != expected
    # The random model repeats itself, so the controls must actually have changed something.
    assert plain_differs


@pytest.mark.parametrize(
    "top_k, temperature, top_p",
    [(20, 0.7, 0.9), (5, 1.0, 1.0), (400, 1.3, 0.5), (50, 0.8, 1.0)],
)
def test_top_k_sampling_matches_generate(engine, loaded, top_k, temperature, top_p):
    max_new = 16
    settings = {"top_k": top_k, "temperature": temperature, "top_p": top_p}
    for seed, turns in enumerate(all_contexts()[:4]):
        options = ReplyOptions(
            decoder="top-k", decoder_settings=settings, seed=seed, min_new_tokens=max_new, max_new_tokens=max_new
        )
        prompt, got = ours(engine, turns, options)
        torch.manual_seed(seed)
        expected = hf_generate(
            loaded, prompt, max_new, max_new, do_sample=True, top_k=top_k, temperature=temperature, top_p=top_p
        )
        assert got == expected, (seed, turns)
        assert len(got) == max_new


def test_top_k_sampling_with_repetition_penalty_matches_generate(engine, loaded):
    max_new = 16
    settings = {"top_k": 10, "temperature": 0.5, "repetition_penalty": 1.4, "no_repeat_ngram_size": 2}
    for seed in (3, 11):
        options = ReplyOptions(
            decoder="top-k", decoder_settings=settings, seed=seed, min_new_tokens=max_new, max_new_tokens=max_new
        )
        prompt, got = ours(engine, ["i like pizza and movies, what about you?"], options)
        torch.manual_seed(seed)
        expected = hf_generate(
            loaded,
            prompt,
            max_new,
            max_new,
            do_sample=True,
            top_k=10,
            temperature=0.5,
            top_p=1.0,
            repetition_penalty=1.4,
            no_repeat_ngram_size=2,
        )
        assert got == expected


def test_seeded_generator_draws_like_the_global_rng():
    probabilities = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), dim=-1)
    for seed in (0, 1, 12345):
        generator = torch.Generator().manual_seed(seed)
        ours_draws = [torch.multinomial(probabilities, 1, generator=generator) for _ in range(5)]
        torch.manual_seed(seed)
        global_draws = [torch.multinomial(probabilities, 1) for _ in range(5)]
        assert all(torch.equal(a, b) for a, b in zip(ours_draws, global_draws))


def test_sampling_does_not_touch_the_global_rng(engine):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    engine.reply_to(["hi"], ReplyOptions(decoder="top-k", seed=5, min_new_tokens=8, max_new_tokens=8)).text()
    assert torch.equal(torch.rand(4), expected)


def test_max_new_tokens_is_respected(engine):
    for decoder in ("greedy", "top-k"):
        response = engine.reply_to(["hi"], ReplyOptions(decoder=decoder, seed=1, min_new_tokens=7, max_new_tokens=7))
        response.text()
        assert len(response.token_ids) == 7
        assert response.provenance["timings"]["new_tokens"] == 7
