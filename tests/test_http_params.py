"""The OpenAI parameters clients send: ``logprobs``/``top_logprobs``, ``n``, ``POST /v1/completions``
and llama.cpp's ``/tokenize`` and ``/detokenize``; through the official openai client and plain HTTP,
against one real server on the tiny model."""

from __future__ import annotations

import http.client
import json
import math
from typing import Any

import openai
import pytest

API_KEY = "params-key"
HI = [{"role": "user", "content": "hi, how are you?"}]


@pytest.fixture
def server(serving_engine):
    """A scheduler (4 rows at once) and a server with an API key, on a free loopback port."""
    from chatcore.adapters.http_api.app import ServeConfig, build_app
    from chatcore.adapters.http_api.server import start_in_thread
    from chatcore.serving import Scheduler

    scheduler = Scheduler(serving_engine, max_batch=4, max_waiting=8)
    running = start_in_thread(build_app(scheduler, ServeConfig(api_key=API_KEY, max_n=4)))
    yield running
    running.stop()
    scheduler.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def model(client) -> str:
    return client.models.list().data[0].id


def post(server, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    connection.request("POST", path, json.dumps(body), headers)
    response = connection.getresponse()
    raw = response.read().decode()
    connection.close()
    if body.get("stream"):
        return response.status, [line[6:] for line in raw.split("\n\n") if line.startswith("data: ")]
    return response.status, json.loads(raw)


# -- min_tokens ----------------------------------------------------------------------------
def test_min_tokens_holds_the_stop_tokens_back_until_the_reply_has_that_many(client, model, serving_engine):
    ending = {str(serving_engine.eos_token_id): 100}  # the stop token as soon as it is allowed
    quick = client.chat.completions.create(model=model, messages=HI, max_tokens=20, temperature=0, logit_bias=ending)
    assert quick.usage.completion_tokens == 1 and quick.choices[0].finish_reason == "stop"
    asked = {"model": model, "messages": HI, "max_tokens": 20, "temperature": 0, "logit_bias": ending}
    held = client.chat.completions.create(**asked, extra_body={"min_tokens": 6})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        **asked, stream=True, stream_options={"include_usage": True}, extra_body={"min_tokens": 6}
    )
    chunks = list(streamed)
    assert chunks[-1].usage.completion_tokens == 6
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == held.choices[0].message.content


@pytest.mark.parametrize("fields", [{"max_tokens": 4, "min_tokens": 5}, {"min_tokens": -1}])
def test_min_tokens_out_of_range_is_400(server, model, fields):
    status, body = post(server, "/v1/chat/completions", {"model": model, "messages": HI, **fields})
    assert status == 400 and body["error"]["param"] == "min_tokens", body


# -- logprobs ------------------------------------------------------------------------------
def test_logprobs_are_the_scores_the_decoder_chose_from(client, model):
    greedy = client.chat.completions.create(
        model=model, messages=HI, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = greedy.choices[0].logprobs.content
    assert len(content) == greedy.usage.completion_tokens > 0
    for entry in content:
        # greedy takes the best token: it heads its own alternatives, best first
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == entry.top_logprobs[0].logprob
        assert [alt.logprob for alt in entry.top_logprobs] == sorted(
            (alt.logprob for alt in entry.top_logprobs), reverse=True
        )
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    assert b"".join(bytes(entry.bytes) for entry in content).decode() == greedy.choices[0].message.content

    # top-k 2: the third alternative was filtered out by the decoder, the two kept ones share all the mass
    sampled = client.chat.completions.create(
        model=model, messages=HI, max_tokens=6, seed=3, logprobs=True, top_logprobs=3,
        extra_body={"decoder": "top-k top_k=2 temperature=1"},
    )  # fmt: skip
    for entry in sampled.choices[0].logprobs.content:
        first, second, third = entry.top_logprobs
        assert third.logprob == -9999.0
        assert math.isclose(math.exp(first.logprob) + math.exp(second.logprob), 1.0, rel_tol=1e-4)
        assert entry.token in (first.token, second.token)


def test_streamed_logprobs_are_the_same_tokens(client, model):
    asked = dict(model=model, messages=HI, max_tokens=10, seed=5, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**asked)
    chunks = list(client.chat.completions.create(**asked, stream=True))
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    expected = whole.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in expected]
    # the second request starts from the prefix cache: the same numbers up to float rounding
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(streamed, expected))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    # each chunk lists the tokens of its own text (the text goes a whole word at a time, after its tokens)
    greedy = client.chat.completions.create(**{**asked, "temperature": 0, "max_tokens": 12}, stream=True)
    pieces = [c.choices[0] for c in greedy if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 2
    for piece in pieces:
        assert b"".join(bytes(e.bytes) for e in piece.logprobs.content).decode() == piece.delta.content
    plain = client.chat.completions.create(model=model, messages=HI, max_tokens=3)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    "fields, param",
    [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"n": 5}, "n")],
)
def test_logprobs_and_n_out_of_range_are_400(server, model, fields, param):
    status, body = post(server, "/v1/chat/completions", {"model": model, "messages": HI, **fields})
    assert status == 400 and body["error"]["param"] == param, body


# -- n -------------------------------------------------------------------------------------
def test_n_choices_are_each_seeded_replies_streamed_by_index(client, model):
    three = client.chat.completions.create(model=model, messages=HI, max_tokens=8, seed=11, n=3)
    assert [choice.index for choice in three.choices] == [0, 1, 2]
    for index, choice in enumerate(three.choices):
        alone = client.chat.completions.create(model=model, messages=HI, max_tokens=8, seed=11 + index)
        assert choice.message.content == alone.choices[0].message.content
        assert choice.finish_reason == alone.choices[0].finish_reason
    stream = client.chat.completions.create(
        model=model, messages=HI, max_tokens=8, seed=11, n=3, stream=True, stream_options={"include_usage": True}
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in three.choices}
    assert finishes == {c.index: c.finish_reason for c in three.choices}
    assert usage.completion_tokens == three.usage.completion_tokens


# -- /v1/completions -----------------------------------------------------------------------
def test_completions_continue_the_raw_prompt(client, model, serving_engine):
    prompt = "i like to eat"
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    choice = reply.choices[0]
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    # no chat template, no turn markers: the prompt's own tokens
    assert reply.usage.prompt_tokens == len(serving_engine.tokenizer(prompt)["input_ids"])
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == reply.usage.completion_tokens
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.text_offset[0] == 0 and all(len(top) <= 2 for top in choice.logprobs.top_logprobs)

    streamed = client.completions.create(model=model, prompt=[prompt], max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    # streamed with log-probabilities: each chunk's tokens spell its text, their offsets in the whole reply
    chunks = [
        c.choices[0]
        for c in client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True, logprobs=0
        )
        if c.choices and c.choices[0].text
    ]
    assert len(chunks) > 2 and "".join(c.text for c in chunks) == choice.text
    offset = 0
    for chunk in chunks:
        assert "".join(chunk.logprobs.tokens) == chunk.text and chunk.logprobs.text_offset[0] == offset
        offset += len(chunk.text)
    echoed = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, echo=True, n=2)
    assert [c.text for c in echoed.choices] == [prompt + choice.text] * 2


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "a", "echo": True, "logprobs": 1}, "echo"),
        ({"prompt": "a", "suffix": "b"}, "suffix"),
        ({"prompt": "a", "best_of": 2}, "best_of"),
    ],
)
def test_completions_refuse_what_they_cannot_do(server, model, fields, param):
    status, body = post(server, "/v1/completions", {"model": model, **fields})
    assert status == 400 and body["error"]["param"] == param, body


# -- /tokenize and /detokenize --------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip(server, serving_engine):
    status, body = post(server, "/tokenize", {"content": "hello there, friend"})
    assert status == 200 and body["tokens"] == serving_engine.tokenizer("hello there, friend")["input_ids"]
    status, pieces = post(server, "/tokenize", {"content": "hello there", "with_pieces": True})
    assert "".join(p["piece"] for p in pieces["tokens"]) == "hello there"
    status, text = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and text == {"content": "hello there, friend"}
    size = len(serving_engine.tokenizer)
    for path, bad, param in [
        ("/detokenize", {"tokens": [1, size]}, "tokens.[1]"),
        ("/detokenize", {"tokens": ["a"]}, "tokens.[0]"),
        ("/tokenize", {"text": "hi"}, "content"),
    ]:
        status, error = post(server, path, bad)
        assert status == 400 and error["error"]["param"] == param, error


# -- store and metadata ---------------------------------------------------------------------
def test_store_and_metadata_are_accepted_and_change_nothing(client, model):
    plain = client.chat.completions.create(model=model, messages=HI, max_tokens=6, seed=3)
    tagged = client.chat.completions.create(
        model=model, messages=HI, max_tokens=6, seed=3, store=False, metadata={"team": "support", "run": "7"}
    )
    assert tagged.choices[0].message.content == plain.choices[0].message.content
    stored = client.chat.completions.create(model=model, messages=HI, max_tokens=6, seed=3, store=True)
    assert stored.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(
    "fields",
    [
        {"store": "yes"},
        {"metadata": {"k": 1}},
        {"metadata": {f"k{index}": "v" for index in range(17)}},
        {"metadata": {"k" * 65: "v"}},
        {"metadata": {"k": "v" * 513}},
    ],
)
def test_store_and_metadata_out_of_shape_are_400(server, model, fields):
    status, body = post(server, "/v1/chat/completions", {"model": model, "messages": HI, **fields})
    assert status == 400 and body["error"]["param"].split(".")[0] in fields, body
