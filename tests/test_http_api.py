"""``chatcore serve``'s API: the official openai client against a real uvicorn server on a tiny random GPT-2."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import openai
import pytest

from chatcore.engine import ReplyOptions
from chatcore.prompting import Message

API_KEY = "test-key-123"


@pytest.fixture
def serving(serving_engine):
    """A scheduler (2 rows at once, 2 waiting) and a server with an API key, on a free loopback port."""
    from chatcore.adapters.http_api.app import ServeConfig, build_app
    from chatcore.adapters.http_api.server import start_in_thread
    from chatcore.serving import Scheduler

    scheduler = Scheduler(serving_engine, max_batch=2, max_waiting=2)
    server = start_in_thread(build_app(scheduler, ServeConfig(api_key=API_KEY, max_body=20_000)))
    yield scheduler, server
    server.stop()
    scheduler.close()


@pytest.fixture
def client(serving) -> openai.OpenAI:
    return openai.OpenAI(base_url=serving[1].url, api_key=API_KEY, max_retries=0, timeout=60)


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@dataclass
class Reply:
    status_code: int
    headers: dict[str, str]
    text: str

    def json(self):
        return json.loads(self.text)


def call(url: str, data: bytes | None = None, headers: dict | None = None) -> Reply:
    """A plain HTTP request (the standard library's), for what the openai client would not send."""
    request = urllib.request.Request(url, data=data, headers=headers or {}, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return Reply(response.status, {k.lower(): v for k, v in response.headers.items()}, response.read().decode())
    except urllib.error.HTTPError as error:
        return Reply(error.code, {k.lower(): v for k, v in error.headers.items()}, error.read().decode())


def post(serving, body: bytes | str | dict) -> Reply:
    content = json.dumps(body) if isinstance(body, dict) else body
    content = content.encode() if isinstance(content, str) else content
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    return call(f"{serving[1].url}/chat/completions", content, headers)


def test_round_trip_matches_the_engine(engine, client):
    model = model_name(client)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi there"}],
        max_tokens=12,
        seed=4,
        temperature=0.7,
        top_p=0.9,
    )
    expected = engine.reply_to(
        ["hi there"],
        ReplyOptions(decoder="top-k", seed=4, max_new_tokens=12, decoder_settings={"temperature": 0.7, "top_p": 0.9}),
        system="Be kind.",
    )
    assert reply.choices[0].message.content == expected.text()
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == expected.provenance["prompt_tokens"]
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.model == model and reply.id.startswith("chatcmpl-")


def test_streaming_sends_the_same_reply_in_chunks_with_usage(client):
    model = model_name(client)
    messages = [{"role": "user", "content": "what do you do for fun?"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=16, seed=9)
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, seed=9, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_server_sent_events_end_with_done(serving, client):
    body = {
        "model": model_name(client),
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 4,
    }
    response = post(serving, body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_seeds_reproduce_and_steerers_steer(engine, client):
    model = model_name(client)
    messages = [{"role": "user", "content": "what should we eat tonight?"}]
    plain = [
        client.chat.completions.create(model=model, messages=messages, max_tokens=16, seed=s).choices[0].message.content
        for s in (1, 1, 2)
    ]
    assert plain[0] == plain[1]
    steered = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=16,
        seed=1,
        extra_body={"steer": ["bow-bias words=pizza strength=8"], "decoder": "top-k top_k=5"},
    )
    expected = engine.reply_to(
        ["what should we eat tonight?"],
        ReplyOptions(
            decoder="top-k",
            decoder_settings={"top_k": "5"},
            steerers=[("bow-bias", {"words": "pizza", "strength": "8"})],
            seed=1,
            max_new_tokens=16,
        ),
    )
    assert steered.choices[0].message.content == expected.text() != plain[0]
    assert steered.model_extra["chatcore"]["steerers"][0]["name"] == "bow-bias"
    # One steerer may be given as a string instead of a list of one.
    alone = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=16,
        seed=1,
        extra_body={"steer": "bow-bias words=pizza strength=8", "decoder": "top-k top_k=5"},
    )
    assert alone.choices[0].message.content == expected.text()
    greedy = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert greedy.model_extra["chatcore"]["decoder"]["name"] == "greedy"


def test_stop_strings_end_the_reply_before_them(client):
    model = model_name(client)
    messages = [{"role": "user", "content": "tell me about your day"}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=20, seed=3)
    full = full.choices[0].message.content
    assert len(full) > 6
    stop = full[3:6]
    cut = client.chat.completions.create(model=model, messages=messages, max_tokens=20, seed=3, stop=[stop])
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model=model, messages=messages, max_tokens=20, seed=3, stop=stop, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == full[: full.index(stop)]


def test_requests_without_the_key_get_401(serving):
    bad = openai.OpenAI(base_url=serving[1].url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.models.list()
    assert caught.value.status_code == 401 and "API key" in caught.value.message
    response = call(f"{serving[1].url}/models")
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_plugins_lists_decoders_and_steerers_with_the_schema_of_their_settings(serving, client):
    assert call(f"{serving[1].url}/plugins").status_code == 401
    listing = call(f"{serving[1].url}/plugins", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    cards = {(card["object"], card["id"]): card for card in listing["data"]}
    assert {("decoder", "greedy"), ("decoder", "top-k"), ("steerer", "bow-bias")} <= set(cards)
    top_k = cards["decoder", "top-k"]["settings"]["properties"]["top_k"]
    assert top_k["type"] == "integer" and top_k["default"] == 40 and top_k["exclusiveMinimum"] == 0
    assert top_k["description"] == "Sample from this many best tokens."
    assert cards["decoder", "top-k"]["settings"]["additionalProperties"] is False
    strength = cards["steerer", "bow-bias"]["settings"]["properties"]["strength"]
    assert (strength["minimum"], strength["maximum"]) == (-100, 100) and strength["description"]
    # What the schema describes is what a request may send: a value past its bound is refused by name.
    model = model_name(client)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], extra_body={"decoder": "top-k top_k=0"}
        )
    assert "`top_k` must be a positive integer, got 0" in caught.value.message


@pytest.mark.parametrize(
    "body, status, param",
    [
        ('{"model": ', 400, None),
        (b"\xff\xfe{}", 400, None),
        ("[1, 2]", 400, None),
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
        ({"MODEL": {}, "messages": []}, 400, "model"),
        ({"messages": [], "model": "M"}, 400, "messages"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "model": "M", "frequency_penalty": 2.5},
            400,
            "frequency_penalty",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "M", "temperature": "hot"}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "M", "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "M", "n": 9}, 400, "n"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "model": "M", "stream_options": {"include_usage": True}},
            400,
            "stream_options",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "model": "M"},
            400,
            "messages",
        ),
        ({"messages": [{"role": "robot", "content": "hi"}], "model": "M"}, 400, "messages.[0].role"),
        ({"messages": [{"role": "user", "content": "   "}], "model": "M"}, 400, "messages.[0].content"),
        ({"messages": [{"role": "user", "content": "hi\u0000there"}], "model": "M"}, 400, "messages.[0].content"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "M", "decoder": "beam-search"}, 400, "decoder"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "M", "steer": ["nope x=1"]}, 400, "steer"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "model": "M", "steer": ["bow-bias strength=500 words=a"]},
            400,
            "steer",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "M", "seed": -1}, 400, "seed"),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "model": "M",
                "temperature": 0.3,
                "decoder": "top-k temperature=1.5",
            },
            400,
            "temperature",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "model": "M", "top_p": 0.5, "decoder": "top-k top_p=0.9"},
            400,
            "top_p",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}, 404, "model"),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "model": "M",
                "max_tokens": 3,
                **{"max_completion_tokens": 6},
            },
            400,
            None,
        ),
        ('{"messages": [{"role": "user", "content": "hi"}], "model": "M", "temperature": NaN}', 400, "temperature"),
        ({"messages": [{"role": "user", "content": "x" * 30_000}], "model": "M"}, 413, None),
        ("[" * 5_000 + "]" * 5_000, 400, None),  # nested deeper than the parser goes
        ('{"a":' * 3_000 + "1" + "}" * 3_000, 400, None),
    ],
)
def test_bad_requests_get_openai_errors(serving, client, body, status, param):
    if isinstance(body, dict) and body.get("model") == "M":
        body["model"] = model_name(client)
    response = post(serving, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["param"] == param


def test_unknown_routes_and_methods_are_openai_errors(serving):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    missing = call(f"{serving[1].url}/embeddings", headers=headers)
    assert missing.status_code == 404 and "not found" in missing.json()["error"]["message"]
    wrong = call(f"{serving[1].url}/chat/completions", headers=headers)
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
    assert wrong.headers["allow"] == "POST"  # what the route takes, as HTTP asks of a 405


@pytest.mark.parametrize(
    "path, fields",
    [
        ("/v1/chat/completions", '"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '),
        ("/v1/completions", '"model": "M", "prompt": "hi", "seed": '),
        ("/tokenize", '"content": "hi", "add_special": '),
        ("/detokenize", '"tokens": '),
    ],
)
def test_an_integer_too_long_to_read_is_a_400_not_a_server_error(serving, caplog, path, fields):
    # Python reads integers of at most 4,300 digits; json.loads raises a bare ValueError past that.
    body = "{" + fields + "9" * 5_000 + "}"
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    with caplog.at_level(logging.INFO):
        response = call(f"http://{serving[1].host}:{serving[1].port}{path}", body.encode(), headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == "the request body holds an integer of more than 4,300 digits"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


def test_stop_strings_and_messages_must_be_text_without_control_characters(serving, client):
    model = model_name(client)
    hi = [{"role": "user", "content": "hi"}]
    refusals = [
        ({"messages": hi, "stop": "\u0000"}, "stop", "`stop` contains a control character (U+0000)"),
        (
            {"messages": hi, "stop": ["fine", "\ud800"]},
            "stop",
            "stop[1] contains a lone surrogate (U+D800), which is not valid Unicode text",
        ),
        (
            {"messages": [{"role": "user", "content": "hi \udfff"}]},
            "messages.[0].content",
            "messages[0] contains a lone surrogate (U+DFFF), which is not valid Unicode text",
        ),
        (
            {"messages": [{"role": "user", "content": "hi\u0007"}]},
            "messages.[0].content",
            "messages[0] contains a control character (U+0007)",
        ),
        ({"messages": hi, "user": "ann\ud800"}, "user", "`user` contains a lone surrogate (U+D800), which is not"),
        ({"messages": hi, "decoder": "greedy\u0000"}, "decoder", "`decoder` contains a control character (U+0000)"),
        ({"messages": hi, "steer": ["bow-bias topic=food\ud800"]}, "steer", "steer[0] contains a lone surrogate"),
    ]
    for fields, param, message in refusals:
        response = post(serving, {"model": model, "max_tokens": 2, **fields})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param and response.json()["error"]["message"].startswith(message)
    raw = call(
        f"{serving[1].url}/completions",
        json.dumps({"model": model, "prompt": "go \ud83d"}).encode(),
        {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert raw.status_code == 400 and raw.json()["error"]["message"] == (
        "`prompt` contains a lone surrogate (U+D83D), which is not valid Unicode text"
    )
    # A whole pair is one character (json.dumps sends this emoji as "\\ud83d\\ude00"); line breaks and tabs are text.
    fine = {"model": model, "messages": [{"role": "user", "content": "hi \U0001f600\n\tthere"}], "max_tokens": 2}
    reply = post(serving, {**fine, "stop": ["\n", "\U0001f600"]})
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_tokenize_refuses_control_characters_and_lone_surrogates_as_the_chat_endpoints_do(serving, caplog):
    url = f"http://{serving[1].host}:{serving[1].port}/tokenize"
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    refusals = [
        ("hi \ud800", "`content` contains a lone surrogate (U+D800), which is not valid Unicode text"),
        ("\udfff", "`content` contains a lone surrogate (U+DFFF), which is not valid Unicode text"),
        ("hi\u0000there", "`content` contains a control character (U+0000)"),
        ("bell \u0007", "`content` contains a control character (U+0007)"),
    ]
    with caplog.at_level(logging.INFO):
        for content, message in refusals:
            response = call(url, json.dumps({"content": content}).encode(), headers)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["message"] == message and response.json()["error"]["param"] == "content"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    # A whole pair is one character (json.dumps sends this emoji as "\\ud83d\\ude00"); line breaks and tabs are text.
    fine = call(url, json.dumps({"content": "hi \U0001f600\n\tthere"}).encode(), headers)
    assert fine.status_code == 200 and fine.json()["tokens"], fine.text


def slow_request(serving, name: str, stream: bool) -> socket.socket:
    """Start a slow request on a raw socket; a streaming one is read until its first chunk."""
    body = json.dumps(
        {
            "model": name,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": stream,
            "max_tokens": 100,
            "decoder": "greedy",
            "steer": ["slow seconds=0.05"],
        }
    )
    connection = socket.create_connection((serving[1].host, serving[1].port))
    connection.sendall(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        ).encode()
    )
    received = b""
    while stream and b'"role"' not in received:
        received += connection.recv(4096)
    return connection


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_slot(serving, client, stream):
    scheduler = serving[0]
    connection = slow_request(serving, model_name(client), stream)
    deadline = time.monotonic() + 600  # a hang guard: a loaded machine only makes it slower
    while not scheduler.in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    (handle,) = [job.sink for job in list(scheduler.runner.jobs)]
    connection.close()
    # Freed by the disconnect, not by its end: the reply ends cancelled, with its 100 slow steps not all taken.
    assert handle.wait(60) and handle.finish_reason == "cancelled" and len(handle.token_ids) < 100
    assert scheduler.in_flight() == 0


def test_a_busy_server_says_so(serving, client):
    scheduler = serving[0]
    slow = ReplyOptions(decoder="greedy", max_new_tokens=100, min_new_tokens=100, steerers=[("slow", {})])
    blockers = [scheduler.submit([Message("user", "hi")], slow) for _ in range(4)]  # 2 in flight, 2 waiting
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model=model_name(client), messages=[{"role": "user", "content": "hi"}])
        assert caught.value.status_code == 429 and "busy" in caught.value.message
    finally:
        for blocker in blockers:
            blocker.cancel()


@pytest.mark.slow
def test_many_concurrent_requests_are_each_answered_once(serving, client, engine):
    from chatcore.adapters.http_api.app import build_app
    from chatcore.adapters.http_api.server import start_in_thread
    from chatcore.serving import Scheduler

    name = model_name(client)
    with Scheduler(engine, max_batch=4, max_waiting=32) as scheduler:
        server = start_in_thread(build_app(scheduler))
        wide = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        try:

            def ask(seed: int) -> tuple[int, str, str]:
                messages = [{"role": "user", "content": f"tell me a story about the number {seed}"}]
                if seed % 2:
                    stream = wide.chat.completions.create(
                        model=name, messages=messages, max_tokens=12, seed=seed, stream=True
                    )
                    return seed, "".join(c.choices[0].delta.content or "" for c in stream), "stream"
                reply = wide.chat.completions.create(model=name, messages=messages, max_tokens=12, seed=seed)
                return seed, reply.choices[0].message.content, reply.id

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(ask, range(24)))
        finally:
            server.stop()
    assert sorted(seed for seed, _, _ in answers) == list(range(24))
    ids = [reply_id for _, _, reply_id in answers if reply_id != "stream"]
    assert len(set(ids)) == len(ids) == 12
    for seed, text, _ in answers[:6]:  # each equals the same request answered alone
        expected = engine.reply_to(
            [f"tell me a story about the number {seed}"], ReplyOptions(seed=seed, max_new_tokens=12)
        ).text()
        assert text == expected


def test_serve_refuses_bad_options_before_loading_the_model():
    from click.testing import CliRunner

    from chatcore.cli import build_cli

    runner = CliRunner()
    result = runner.invoke(build_cli(), ["serve", "--format", "no-such-format"])
    assert result.exit_code != 0 and "no-such-format" in result.output and "Traceback" not in result.output
    result = runner.invoke(build_cli(), ["serve", "--api-key", " "])
    assert result.exit_code != 0 and "--api-key" in result.output
    result = runner.invoke(build_cli(), ["serve", "--model", "nope"], env={"CHATCORE_API_KEY": ""})  # not "no key"
    assert result.exit_code != 0 and "CHATCORE_API_KEY is set but empty" in result.output
    result = runner.invoke(build_cli(), ["serve", "--temperature", "0"])  # greedy is a request's choice
    assert result.exit_code != 0 and "`--temperature 0` would be greedy decoding" in result.output
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # "nope" would fail to load: the port is refused first, before any model.
        result = runner.invoke(build_cli(), ["serve", "--port", str(port), "--model", "nope"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.output


@pytest.mark.slow
def test_chatcore_serve_answers_the_openai_client(tiny_model_dir, tmp_path):
    import os
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    system_file = tmp_path / "system.txt"
    system_file.write_text("You are a pirate.\n", encoding="utf-8")
    command = [
        sys.executable,
        "-m",
        "chatcore.cli",
        "serve",
        "--port",
        str(port),
        "--model",
        str(tiny_model_dir),
        "--api-key",
        API_KEY,
        "--system-file",
        str(system_file),
    ]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "CHATCORE_PLUGINS": ""}
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=30)
        deadline = time.monotonic() + 180
        while True:
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                # Its output is read only once it has exited: reading a live server's pipe waits for ever.
                assert server.poll() is None, server.stdout.read().decode()
                assert time.monotonic() < deadline, "chatcore serve did not listen within 180 s"
                time.sleep(0.2)
        assert model == tiny_model_dir.name
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, seed=1
        )
        assert 1 <= reply.usage.completion_tokens <= 5
        assert reply.model_extra["chatcore"]["seed"] == 1
        # The system prompt from the file is part of the prompt: more prompt tokens than "hi" alone.
        assert reply.usage.prompt_tokens > 5
    finally:
        server.terminate()
        server.wait(10)


def test_failures_after_the_request_was_accepted_are_server_errors(serving, client, caplog):
    name = model_name(client)
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=name, messages=hi, extra_body={"steer": ["failing-shared at_step=0"]})
    assert caught.value.status_code == 500 and "failing-shared" in caught.value.message
    # A plugin's failure would come back the same: the official client, which retries server
    # errors, is told not to, and the server's console says what failed.
    sent: list[object] = []
    retrying = openai.OpenAI(
        base_url=serving[1].url,
        api_key=API_KEY,
        max_retries=2,
        http_client=openai.DefaultHttpxClient(event_hooks={"request": [sent.append]}),
    )
    with caplog.at_level(logging.WARNING, logger="chatcore.serve"):
        with pytest.raises(openai.InternalServerError) as caught:
            retrying.chat.completions.create(model=name, messages=hi, extra_body={"steer": ["failing-shared"]})
    assert caught.value.response.headers["x-should-retry"] == "false" and len(sent) == 1
    assert any("500: plugin 'test-serving'" in record.getMessage() for record in caplog.records)
    stream = client.chat.completions.create(
        model=name,
        messages=hi,
        stream=True,
        max_tokens=10,
        extra_body={"steer": ["failing-shared at_step=2"], "decoder": "greedy"},
    )
    with pytest.raises(openai.APIError, match="failing-shared"):
        for _ in stream:
            pass
    # A system prompt that leaves the reply no room is the request's fault.
    crowded = [{"role": "system", "content": "word " * 3000}] + hi
    response = post(serving, {"model": name, "messages": crowded})
    assert response.status_code == 400 and "system prompt" in response.json()["error"]["message"]


def test_a_setting_that_does_not_fit_the_model_is_the_clients_error_whenever_it_is_found():
    """A PPLM head or CoCon block trained for another model is found once the reply starts
    (after admission): still a 400, as a bad setting, not a server failure."""
    from chatcore.adapters.http_api.completions import api_error
    from chatcore.errors import ChatcoreError
    from chatcore.plugins.cocon.store import BlockMismatchError
    from chatcore.plugins.pplm.attribute import DiscriminatorMismatchError
    from chatcore.serving.requests import Handle

    admitted = Handle()
    admitted.admitted = 1.0
    for error in (DiscriminatorMismatchError("does not fit"), BlockMismatchError("does not fit")):
        assert api_error(error, admitted).status == 400
    assert api_error(ChatcoreError("the model failed"), admitted).status == 500


def test_content_parts_developer_and_several_system_messages(engine, client):
    model = model_name(client)
    messages = [
        {"role": "developer", "content": "Be kind."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "hello!"},
        {"role": "user", "content": "how are you?"},
    ]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8, seed=2)
    expected = engine.reply_to(
        ["hi there", "hello!", "how are you?"], ReplyOptions(seed=2, max_new_tokens=8), system="Be kind.\nBe brief."
    )
    assert reply.choices[0].message.content == expected.text()
    assert reply.usage.prompt_tokens == expected.provenance["prompt_tokens"]


# -- the conversation log -------------------------------------------------------------
@pytest.fixture
def logged(serving_engine, tmp_path):
    """A server whose answered requests go to an SQLite log."""
    from chatcore.adapters.http_api.app import ServeConfig, build_app
    from chatcore.adapters.http_api.request_log import RequestLog
    from chatcore.adapters.http_api.server import start_in_thread
    from chatcore.serving import Scheduler

    db = tmp_path / "log.sqlite3"
    request_log = RequestLog(str(db), engine=serving_engine)
    scheduler = Scheduler(serving_engine, max_batch=2, max_waiting=2)
    server = start_in_thread(build_app(scheduler, ServeConfig(api_key=API_KEY, log=request_log)))
    client = openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)
    yield client, request_log, db
    server.stop()
    scheduler.close()
    request_log.close()


def read_log(db) -> list:
    from chatcore.log.store import ConversationStore

    with ConversationStore(f"sqlite:///{db}") as store:
        return [store.get_conversation(summary.id) for summary in store.list_conversations(adapter="http")]


def test_answered_requests_are_logged_and_a_follow_up_continues_its_conversation(logged):
    client, request_log, db = logged
    model = model_name(client)
    first = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi there"}]
    reply = client.chat.completions.create(model=model, messages=first, max_tokens=6, seed=3)
    answer = reply.choices[0].message.content
    # The next turn, streamed, as a chat client sends it: the history, the reply, a new message.
    follow_up = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    stream = client.chat.completions.create(model=model, messages=follow_up, max_tokens=6, seed=4, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    # Another client's conversation, with a history the log has not seen: a conversation of its own.
    other = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hey"},
        {"role": "user", "content": "how are you?"},
    ]
    client.chat.completions.create(model=model, messages=other, max_tokens=4)
    request_log.close()  # writes what is queued
    assert db.stat().st_mode & 0o777 == 0o600  # the log is private: created readable by its owner only

    by_first_text = {c.messages[0].text: c for c in read_log(db)}
    assert set(by_first_text) == {"hi there", "hello"}
    continued = by_first_text["hi there"]
    assert continued.system == "You are terse."
    assert [(m.role, m.text) for m in continued.messages] == [
        ("user", "hi there"),
        ("bot", answer),
        ("user", "and then?"),
        ("bot", streamed),
    ]
    bot = continued.messages[3]
    assert bot.seed == 4 and bot.decoder and not bot.interrupted
    assert bot.provenance["usage"]["completion_tokens"] == bot.token_count >= 1
    # the message dated when the request came, the reply when it ended
    took = (bot.created - continued.messages[2].created).total_seconds()
    assert took == pytest.approx(bot.provenance["timings"]["total_s"], abs=0.002)
    assert continued.messages[1].created < continued.messages[2].created
    assert [(m.role, m.text) for m in by_first_text["hello"].messages][:3] == [
        ("user", "hello"),
        ("bot", "hey"),
        ("user", "how are you?"),
    ]


def test_a_history_that_repeats_a_message_is_logged_whole(logged):
    """Turns alike in role and text ("ok" twice) are turns of their own, each logged, in order."""
    client, request_log, db = logged
    history = [
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "sure"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "sure"},
        {"role": "user", "content": "ok"},
    ]
    reply = client.chat.completions.create(model=model_name(client), messages=history, max_tokens=4, seed=1)
    request_log.close()
    (conversation,) = read_log(db)
    assert [(m.role, m.text) for m in conversation.messages] == [
        *[("user" if turn["role"] == "user" else "bot", turn["content"]) for turn in history],
        ("bot", reply.choices[0].message.content),
    ]


def test_configurations_that_cannot_reply_get_400_and_nothing_is_logged(loaded, tmp_path):
    from refused_configurations import IMPOSSIBLE_STEERERS, NON_DECODABLE_DECODERS, PLUGIN_MODULES, REPEATED_STEERERS

    from chatcore.adapters.http_api.app import ServeConfig, build_app
    from chatcore.adapters.http_api.request_log import RequestLog
    from chatcore.adapters.http_api.server import start_in_thread
    from chatcore.engine import Engine
    from chatcore.plugin_manager import PluginHost
    from chatcore.serving import Scheduler

    host = PluginHost()
    host.load_modules(PLUGIN_MODULES + ("chatcore.plugins.prompt_formats",))
    engine = Engine(loaded, host=host)
    db = tmp_path / "log.sqlite3"
    request_log = RequestLog(str(db), engine=engine)
    scheduler = Scheduler(engine, max_batch=2, max_waiting=2)
    server = start_in_thread(build_app(scheduler, ServeConfig(api_key=API_KEY, log=request_log)))
    hi = [{"role": "user", "content": "hi"}]
    refused = [({"steer": list(specs)}, line, "steer") for specs, line in IMPOSSIBLE_STEERERS + REPEATED_STEERERS]
    refused += [({"decoder": spec}, line, "decoder") for spec, line in NON_DECODABLE_DECODERS]
    try:
        model = model_name(openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60))
        for fields, line, param in refused:
            response = post((scheduler, server), {"model": model, "messages": hi, **fields})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["message"] == line
            assert response.json()["error"]["param"] == param
    finally:
        server.stop()
        scheduler.close()
        request_log.close()
    assert read_log(db) == []


def test_serve_refuses_a_log_it_cannot_open_before_loading_the_model(tmp_path):
    from click.testing import CliRunner

    from chatcore.cli import build_cli

    runner = CliRunner()
    result = runner.invoke(build_cli(), ["serve", "--port", "0", "--db", "x.db", "--no-log"])
    assert result.exit_code != 0 and "give --db or --no-log, not both" in result.output
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    # "nope" would fail to load: the log is refused first, in one line.
    result = runner.invoke(build_cli(), ["serve", "--port", "0", "--model", "nope", "--db", str(blocked / "log.db")])
    assert result.exit_code != 0 and "Traceback" not in result.output and "nope" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_a_reply_with_a_control_character_comes_back_as_history_and_continues_its_conversation():
    from chatcore.adapters.http_api.completions import to_messages
    from chatcore.adapters.http_api.errors import ApiError
    from chatcore.adapters.http_api.request_log import _assistant, thread_key
    from chatcore.adapters.http_api.schema import ChatCompletionRequest

    def parsed(*messages):
        return ChatCompletionRequest.model_validate({"model": "m", "messages": list(messages)})

    first = [{"role": "user", "content": "hi"}]
    reply = "well\x05 hello"  # a small model can write a control character
    follow_up = parsed(*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "and?"})
    messages = to_messages(follow_up, None)  # the server's own reply is not refused
    assert messages[1].text == "well hello"
    sent_first = to_messages(parsed(*first), None)
    assert thread_key(messages[:-1]) == thread_key([*sent_first, _assistant(reply)])
    with pytest.raises(ApiError, match="contains a control character"):
        to_messages(parsed({"role": "user", "content": "bad\x05"}), None)


def test_requests_answered_with_an_error_leave_nothing_in_the_log(logged):
    """A request refused or failed before its reply showed anything (at its start, or midway in
    a JSON reply the client never gets) is not logged: no empty reply a follow-up would continue."""
    client, request_log, db = logged
    model = model_name(client)
    hi = [{"role": "user", "content": "hi"}]
    for at_step in (0, 3):
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(
                model=model,
                messages=hi,
                max_tokens=10,
                extra_body={"steer": [f"failing-shared at_step={at_step}"], "decoder": "greedy"},
            )
    crowded = [{"role": "system", "content": "word " * 3000}] + hi  # refused when the reply starts
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=crowded)
    reply = client.chat.completions.create(model=model, messages=hi, max_tokens=4, seed=1)
    request_log.close()  # waits for the queued writes
    conversations = read_log(db)
    assert len(conversations) == 1, [[(m.role, m.text) for m in c.messages] for c in conversations]
    assert [(message.role, message.text) for message in conversations[0].messages] == [
        ("user", "hi"),
        ("bot", reply.choices[0].message.content),
    ]


def logged_as_recorded(request_log):
    """An event set once the server has handed an exchange to the log."""
    import threading

    recorded = threading.Event()
    record = request_log.record

    def record_and_tell(exchange) -> None:
        record(exchange)
        recorded.set()

    request_log.record = record_and_tell
    return recorded


def test_a_client_gone_mid_word_is_logged_with_the_whole_words_it_was_sent_marked_interrupted(logged, gate):
    client, request_log, db = logged
    recorded = logged_as_recorded(request_log)
    stream = client.chat.completions.create(
        model=model_name(client),
        messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=40,
        stream=True,
        extra_body={"decoder": "gated-text"},
    )
    received = ""
    for chunk in stream:  # the reply waits after "Hello there, my frie"; "frie" is never sent
        received += chunk.choices[0].delta.content or ""
        if received == "Hello there, my":
            break
    stream.close()  # the client goes away in the middle of "friend"
    assert recorded.wait(60)
    gate.release.set()
    request_log.close()
    (conversation,) = read_log(db)
    bot = conversation.messages[-1]
    assert (bot.role, bot.text, bot.interrupted) == ("bot", "Hello there, my", True)


def test_a_stop_string_the_client_asked_for_is_a_normal_end_not_an_interruption(logged, gate):
    client, request_log, db = logged
    reply = client.chat.completions.create(
        model=model_name(client),
        messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=40,
        stop=["my"],
        extra_body={"decoder": "gated-text"},
    )
    # Ended before the stop string, while the decoder still waits: everything before it is sent.
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("Hello there, ", "stop")
    gate.release.set()
    request_log.close()
    (conversation,) = read_log(db)
    bot = conversation.messages[-1]
    assert (bot.text, bot.interrupted, bot.provenance["finish_reason"]) == ("Hello there, ", False, "stop")


def test_two_end_users_with_the_same_words_keep_their_own_conversations(logged):
    """A follow-up continues the conversation of the `user` who sends it, never another one's
    that began with the same words; the user is each message's author."""
    from chatcore.log.store import ConversationStore

    client, request_log, db = logged
    model = model_name(client)
    first = [{"role": "user", "content": "kilo: hello there"}]
    asked = dict(model=model, messages=first, max_tokens=4, temperature=0)
    alice = client.chat.completions.create(**asked, user="alice").choices[0].message.content
    bob = client.chat.completions.create(**asked, user="bob").choices[0].message.content
    assert alice == bob  # greedy: the same words get the same reply
    secret = {"role": "user", "content": "kilo: my pin is 9999"}
    after = [*first, {"role": "assistant", "content": alice}, secret]
    client.chat.completions.create(model=model, messages=after, max_tokens=4, temperature=0, user="alice")
    request_log.flush()
    conversations = read_log(db)
    by_length = sorted(conversations, key=lambda c: len(c.messages))
    assert [len(c.messages) for c in by_length] == [2, 4]
    assert {m.author_id for m in by_length[0].messages if m.role == "user"} == {"bob"}
    assert [m.author_id for m in by_length[1].messages if m.role == "user"] == ["alice", "alice"]
    with ConversationStore(f"sqlite:///{db}") as store:
        assert store.delete_author("alice") == 2
    assert "9999" not in str([[m.text for m in c.messages] for c in read_log(db)])


def test_end_users_whose_long_ids_share_a_prefix_are_exported_and_deleted_apart(logged):
    """`user` ids longer than the author column: cut to it, two users merged, and `logs delete
    --author` given the full id deleted nothing."""
    from click.testing import CliRunner

    import chatcore.plugin_manager as plugin_manager
    from chatcore.cli import build_cli

    client, request_log, db = logged
    model = model_name(client)
    shared = "org-7/" + "u" * 70
    alice, bob = shared + "/alice", shared + "/bob"
    for user, text in ((alice, "lima: alice asks"), (bob, "lima: bob asks")):
        messages = [{"role": "user", "content": text}]
        client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0, user=user)
    request_log.flush()

    host = plugin_manager.PluginHost()
    host.load_modules(("chatcore.log",))
    plugin_manager.set_plugin_host(host)

    def logs(*args: str):
        return CliRunner().invoke(build_cli(), ["logs", *args, "--db", str(db)], catch_exceptions=False)

    assert logs("export", "--author", shared[:64]).stdout == ""  # the prefix is no one's id
    (exported,) = logs("export", "--author", alice).stdout.splitlines()
    assert [m["text"] for m in json.loads(exported)["messages"]] == ["lima: alice asks"]
    deleted = logs("delete", "--author", alice, "--yes")
    assert deleted.exit_code == 0 and "deleted 1 message(s)" in deleted.stdout
    users = [(m.text, m.author_id) for c in read_log(db) for m in c.messages if m.role == "user"]
    assert [text for text, _ in users] == ["lima: bob asks"] and users[0][1].startswith("sha256:")


def test_a_conversation_deleted_while_served_stays_deleted(logged):
    """The client's next turn still carries the deleted messages: it starts a new conversation
    that holds only that turn and its reply, titled by it."""
    from chatcore.log.store import ConversationStore

    client, request_log, db = logged
    model = model_name(client)
    first = [{"role": "user", "content": "sierra: my number is 123-45-6789"}]
    answer = client.chat.completions.create(model=model, messages=first, max_tokens=4, seed=1)
    request_log.flush()
    (logged_first,) = read_log(db)
    with ConversationStore(f"sqlite:///{db}") as store:
        store.delete_conversation(logged_first.id)
    after = [*first, {"role": "assistant", "content": answer.choices[0].message.content}]
    after.append({"role": "user", "content": "sierra: please forget that"})
    reply = client.chat.completions.create(model=model, messages=after, max_tokens=4, seed=2)
    request_log.flush()
    (kept,) = read_log(db)
    assert kept.id != logged_first.id and kept.title == "sierra: please forget that"
    assert [(m.role, m.text) for m in kept.messages] == [
        ("user", "sierra: please forget that"),
        ("bot", reply.choices[0].message.content),
    ]
    # and the turn after goes on in that new conversation
    after += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "ok"}]
    client.chat.completions.create(model=model, messages=after, max_tokens=4, seed=3)
    request_log.flush()
    (kept,) = read_log(db)
    assert [m.text for m in kept.messages][2] == "ok" and len(kept.messages) == 4


def test_raw_completions_are_logged_with_the_raw_format(logged):
    client, request_log, db = logged
    client.completions.create(model=model_name(client), prompt="Once upon a time", max_tokens=3, seed=1)
    request_log.flush()
    (conversation,) = read_log(db)
    assert conversation.prompt_format == "raw" and conversation.messages[0].text == "Once upon a time"


def test_a_json_reply_whose_client_left_is_not_logged(logged, gate, monkeypatch):
    """The client of a JSON reply never got any of it: the log keeps nothing of the request
    (its retry would otherwise follow an empty turn), as for a reply refused at its start."""
    import threading

    from chatcore.adapters.http_api.completions import Completion
    from chatcore.adapters.http_api.metrics import ServeMetrics

    client, request_log, db = logged
    gone, ended = threading.Event(), threading.Event()
    exchange, cancel = Completion.exchange, Completion.cancel

    def exchange_and_tell(self, *arguments, **keywords):
        try:
            return exchange(self, *arguments, **keywords)
        finally:
            ended.set()

    def cancel_and_tell(self):
        cancel(self)
        gone.set()

    answered = threading.Event()
    record_status = ServeMetrics.record_status

    def record_and_tell(self, path, status):
        record_status(self, path, status)
        if path == "/v1/chat/completions":
            answered.set()

    monkeypatch.setattr(Completion, "exchange", exchange_and_tell)
    monkeypatch.setattr(Completion, "cancel", cancel_and_tell)
    monkeypatch.setattr(ServeMetrics, "record_status", record_and_tell)
    body = json.dumps(
        {"model": model_name(client), "messages": [{"role": "user", "content": "tell me"}], "decoder": "gated-text"}
    )
    url = client.base_url
    connection = socket.create_connection((url.host, url.port))
    connection.sendall(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        ).encode()
    )
    assert gate.written.wait(60)  # "Hello there, my frie" decoded; the JSON body waits for the end
    connection.close()
    assert gone.wait(60)  # the server saw the client leave while the reply was still running
    gate.release.set()
    assert ended.wait(60)
    request_log.flush()
    assert read_log(db) == []
    # Counted as the client closing the request (499), not as a 200 nobody received.
    assert answered.wait(60)  # counted as its answer starts, after the reply ended
    counted = re.compile(r'^chatcore_http_requests_total\{route="/v1/chat/completions",status="(\d+)"\} 1\.0$', re.M)
    metrics = urllib.request.urlopen(f"http://{url.host}:{url.port}/metrics", timeout=30).read().decode()
    assert counted.findall(metrics) == ["499"]


def test_serving_md_documents_the_message_limits_and_what_user_does():
    """The request-field table and the 400 row give the limits the server applies, and the
    `user` row says what the server does with it (the log's author, conversations kept apart)."""
    from pathlib import Path

    from chatcore.prompting import MAX_SYSTEM_CHARS
    from chatcore.text import MAX_MESSAGE_CHARS

    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    for row in (rows["`messages`"], rows["400"]):
        assert f"{MAX_MESSAGE_CHARS:,} characters" in row and f"{MAX_SYSTEM_CHARS:,}" in row, row
    assert "ignored" not in rows["`user`"] and "author" in rows["`user`"]
    assert "logs delete --author" in rows["`user`"] and "conversation" in rows["`user`"]
