"""``chatcore serve`` as an operator runs it: threads, /health, /metrics, bounded waits and shutdown.

Every wait is on an event: a ``blocking`` steerer (tests/serving_steerers.py) holds the
scheduler's thread until the test opens its gate, so a reply runs, or a request waits,
exactly as long as the test needs.
"""

from __future__ import annotations

import http.client
import json
import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest
from serving_steerers import step_gate

from chatcore.engine import ReplyOptions
from chatcore.errors import OptionError
from chatcore.fast_path_setting import FAST_PATH_ENV
from chatcore.prompting import Message
from chatcore.serving import Scheduler

API_KEY = "ops-key"
HI = [{"role": "user", "content": "hi"}]


@contextmanager
def running(engine, max_batch: int = 2, max_waiting: int = 2, grace: float = 30.0, **config: Any) -> Iterator[Any]:
    """A scheduler and a server on a free loopback port; yields (scheduler, server, client)."""
    from chatcore.adapters.http_api.app import ServeConfig, build_app
    from chatcore.adapters.http_api.server import start_in_thread
    from chatcore.serving import Scheduler

    scheduler = Scheduler(engine, max_batch=max_batch, max_waiting=max_waiting)
    server = start_in_thread(build_app(scheduler, ServeConfig(api_key=API_KEY, **config)), grace=grace)
    client = openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)
    try:
        yield scheduler, server, client
    finally:
        server.stop()
        scheduler.close()


@contextmanager
def held(name: str) -> Iterator[Any]:
    """The gate ``blocking gate=NAME`` waits on, opened when the block ends whatever happened."""
    held_gate = step_gate(name)
    try:
        yield held_gate
    finally:
        held_gate.release.set()


def blocked_reply(scheduler, name: str, at_step: int = 1):
    """Submit a reply that stops the scheduler's thread at ``at_step``; returns once it has."""
    options = ReplyOptions(
        decoder="greedy", max_new_tokens=20, steerers=[("blocking", {"gate": name, "at_step": at_step})]
    )
    handle = scheduler.submit([Message("user", "hi")], options)
    assert step_gate(name).entered.wait(60)
    return handle


def get(server, path: str, key: str | None = None) -> tuple[int, dict[str, str], str]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    connection.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    response = connection.getresponse()
    body = response.read().decode()
    connection.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, body


def metrics(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The scrape as {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, headers, body = get(server, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def start_stream(server, body: dict[str, Any]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streaming request, read up to its first chunk (the reply has started)."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    payload = json.dumps({"stream": True, **body})
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    connection.request("POST", "/v1/chat/completions", payload, headers)
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    return connection, response


def rest_of_stream(response: http.client.HTTPResponse) -> list[str]:
    """The remaining server-sent events' data, up to the end of the stream."""
    # What start_stream left of the first event (its closing blank line) is stripped here.
    events = [block.strip() for block in response.read().decode().split("\n\n")]
    return [event[6:] for event in events if event.startswith("data: ")]


# -- 1. threads -----------------------------------------------------------------------------
def test_threads_is_one_option_on_every_command_that_decodes():
    from chatcore.cli import build_cli
    from chatcore.cli.options import threads_option

    cli = build_cli()
    options = {name: {p.name: p for p in cli.commands[name].params}["threads"] for name in DECODING_COMMANDS}
    reference = click_option_of(threads_option)
    for name, option in options.items():
        assert (option.opts, option.help, option.envvar, option.type) == (
            reference.opts,
            reference.help,
            reference.envvar,
            reference.type,
        ), name


DECODING_COMMANDS = ("serve", "chat", "generate", "eval", "discord")


def click_option_of(decorator: Any) -> Any:
    import click

    @click.command()
    @decorator
    def command(threads: int | None) -> None: ...

    return command.params[0]


def test_the_default_threads_are_half_the_cores_at_most_4_and_omp_num_threads_wins(monkeypatch):
    import torch

    import chatcore.cpu as cpu

    before = torch.get_num_threads()
    try:
        for cores, expected in ((1, 1), (2, 1), (8, 4), (64, 4)):
            monkeypatch.setattr(cpu, "available_cores", lambda cores=cores: cores)
            assert cpu.default_threads() == expected
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(cpu, "available_cores", lambda: 4)
        assert cpu.use_threads(None) == 2 == torch.get_num_threads()
        assert cpu.use_threads(3) == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert cpu.use_threads(None) == 3  # left to torch, which read OMP_NUM_THREADS at start
        with pytest.raises(ValueError, match="`threads` must be a positive integer, got 0"):
            cpu.use_threads(0)
    finally:
        torch.set_num_threads(before)


def test_a_bad_threads_value_is_refused_in_one_line():
    from click.testing import CliRunner

    from chatcore.cli import build_cli

    for name in DECODING_COMMANDS:
        result = CliRunner().invoke(build_cli(), [name, "--threads", "0"])
        assert result.exit_code == 2 and "--threads" in result.output and "Traceback" not in result.output, name


# -- 2. /health and /metrics -----------------------------------------------------------------
def test_health_needs_no_key_and_shows_the_queue(serving_engine):
    with running(serving_engine, max_batch=1) as (scheduler, server, client), held("health") as opened:
        status, _, body = get(server, "/health")
        health = json.loads(body)
        assert status == 200 and health["status"] == "ok" and health["model_loaded"] is True
        assert (health["queue_depth"], health["setting_up"], health["in_flight"], health["model"]) == (
            0,
            0,
            0,
            client.models.list().data[0].id,
        )
        blocked_reply(scheduler, "health")
        waiting = scheduler.submit([Message("user", "hello")], ReplyOptions(max_new_tokens=2))
        health = json.loads(get(server, "/health")[2])
        assert (health["queue_depth"], health["in_flight"], health["max_batch"]) == (1, 1, 1)
        opened.release.set()
        assert waiting.wait(60) and waiting.error is None


def test_metrics_match_what_the_clients_saw(serving_engine):
    with running(serving_engine) as (scheduler, server, client):
        model = client.models.list().data[0].id
        opening = [{"role": "user", "content": "hi there, how are you doing today?"}]
        first = client.chat.completions.create(model=model, messages=opening, max_tokens=6, seed=1)
        history = [*opening, {"role": "assistant", "content": first.choices[0].message.content or "ok"}]
        stream = client.chat.completions.create(
            model=model,
            messages=[*history, {"role": "user", "content": "and then?"}],
            max_tokens=6,
            seed=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        second = [chunk for chunk in stream][-1].usage
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=model, messages=HI, extra_body={"decoder": "beam-search"})
        crowded = [{"role": "system", "content": "word " * 3000}, *HI]  # the scheduler finds it leaves no room
        with pytest.raises(openai.BadRequestError, match="system prompt"):
            client.chat.completions.create(model=model, messages=crowded)
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model=model, messages=HI, extra_body={"steer": ["failing-shared at_step=0"]})
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
        client.models.retrieve(model)
        assert get(server, "/no/such/path")[0] == 404
        scrape = metrics(server)

    def value(name: str, **labels: str) -> float:
        return scrape.get((name, tuple(sorted(labels.items()))), 0.0)

    route = "/v1/chat/completions"
    assert value("chatcore_http_requests_total", route=route, status="200") == 2
    assert value("chatcore_http_requests_total", route=route, status="400") == 2
    assert value("chatcore_http_requests_total", route=route, status="500") == 1
    assert value("chatcore_http_requests_total", route="/v1/models", status="401") == 1
    assert value("chatcore_http_requests_total", route="/v1/models/{model}", status="200") == 1
    assert value("chatcore_http_requests_total", route="other", status="404") == 1
    usage = [first.usage, second]
    assert value("chatcore_completion_tokens_total") == sum(u.completion_tokens for u in usage)
    # The failed reply was admitted too: its prompt counts.
    assert value("chatcore_prompt_tokens_total") > sum(u.prompt_tokens for u in usage)
    finished = sum(value("chatcore_replies_total", outcome=reason) for reason in ("stop", "length"))
    assert finished == 2 and value("chatcore_replies_total", outcome="error") == 1
    assert value("chatcore_replies_total", outcome="refused") == 1  # the request's fault, not the server's
    assert value("chatcore_plugin_failures_total", plugin="test-serving") == 1
    assert value("chatcore_time_to_first_token_seconds_count") == 2
    assert value("chatcore_time_per_output_token_seconds_count") == sum(u.completion_tokens - 1 for u in usage)
    # The follow-up's prompt starts with the first request's prompt and reply: reused from the cache.
    assert value("chatcore_prefix_cache_hits_total") == 1 and value("chatcore_prefix_cached_tokens_total") > 0
    assert value("chatcore_queue_depth") == 0 and value("chatcore_batch_capacity") == 2
    assert value("chatcore_scheduler_steps_total") > 0


def test_every_route_the_app_serves_has_a_label_of_its_own(serving_engine):
    """Only unknown paths are counted as ``other``."""
    from starlette.routing import Route

    from chatcore.adapters.http_api.app import build_app
    from chatcore.adapters.http_api.metrics import route_of

    with Scheduler(serving_engine) as scheduler:
        paths = [route.path for route in build_app(scheduler).routes if isinstance(route, Route)]
    assert "/v1/completions" in paths and "/tokenize" in paths
    for path in paths:
        expected = "/v1/models/{model}" if path.startswith("/v1/models/") else path
        assert route_of(path.replace("{model:path}", "some-model")) == expected
    assert route_of("/no/such/path") == "other"


# -- 3. bounded waits ----------------------------------------------------------------------------
def test_a_request_that_waits_past_max_queue_wait_gets_503_and_leaves_the_queue(serving_engine):
    with running(serving_engine, max_batch=1, max_queue_wait=0.01) as (scheduler, server, client):
        model = client.models.list().data[0].id
        with held("queue-wait") as opened:
            blocked = blocked_reply(scheduler, "queue-wait")
            with pytest.raises(openai.InternalServerError) as caught:
                client.chat.completions.create(model=model, messages=HI)
            assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"] == "1"
            assert "waited 0.01 s for a free slot" in caught.value.message
            assert caught.value.code == "queue_timeout"
            assert len(scheduler.waiting) == 0  # cancelled, not left to be decoded for nobody
            opened.release.set()
            assert blocked.wait(60)
        # Admitted in time: the limit no longer applies.
        assert client.chat.completions.create(model=model, messages=HI, max_tokens=3).choices[0].finish_reason
        scrape = metrics(server)
    assert scrape[("chatcore_replies_total", (("outcome", "queue-wait"),))] == 1
    assert scrape[("chatcore_http_requests_total", (("route", "/v1/chat/completions"), ("status", "503")))] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_past_the_request_timeout_is_cut(serving_engine, stream, caplog):
    with (
        caplog.at_level(logging.WARNING, "chatcore.serve"),
        running(serving_engine, request_timeout=0.01) as (scheduler, server, client),
    ):
        model = client.models.list().data[0].id
        with held(f"timeout-{stream}"):
            steer = [f"blocking gate=timeout-{stream} at_step=0"]
            with pytest.raises(openai.APIStatusError) as caught:
                client.chat.completions.create(
                    model=model, messages=HI, stream=stream, extra_body={"steer": steer, "decoder": "greedy"}
                )
            assert caught.value.status_code == 504 and caught.value.code == "request_timeout"
            assert "longer than the server's limit of 0.01 s" in caught.value.message
            assert scheduler.in_flight() == 0  # cancelled: its slot is free before the gate opens
        scrape = metrics(server)
    assert scrape[("chatcore_replies_total", (("outcome", "timeout"),))] == 1
    # the operator sees it in one line of the server's log
    assert [r.getMessage() for r in caplog.records if "request_timeout" in r.getMessage()] == [
        "504 request_timeout: the reply took longer than the server's limit of 0.01 s"
    ]


# -- 4. shutdown ---------------------------------------------------------------------------------
def test_shutdown_lets_a_running_stream_finish_within_the_grace(serving_engine):
    with running(serving_engine, grace=600) as (scheduler, server, client):
        model = client.models.list().data[0].id
        with held("grace") as opened:
            connection, response = start_stream(
                server,
                {
                    "model": model,
                    "messages": HI,
                    "max_tokens": 4,
                    "decoder": "greedy",
                    "steer": ["blocking gate=grace"],
                },
            )
            assert opened.entered.wait(60)
            server.server.handle_exit(signal.SIGTERM, None)
            assert server.server.stopping.wait(60)
            assert refused(server, model)  # no new request is taken
            opened.release.set()
            events = rest_of_stream(response)
        connection.close()
        server.thread.join(60)
        assert not server.thread.is_alive()
    assert events[-1] == "[DONE]"
    finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes[-1] in ("stop", "length") and "error" not in events[-2]


def refused(server, model: str) -> bool:
    """A new request once the server drains: its listener is closed, or it answers 503 (and so does /health)."""
    try:
        status, headers, body = get(server, "/health")
    except ConnectionError:
        return True
    return (
        status == 503
        and json.loads(body)["status"] == "shutting down"
        and headers["content-type"] == "application/json"
    )


@pytest.mark.parametrize("signals, grace", [(1, 0.0), (2, 600.0)], ids=["grace-over", "second-signal"])
def test_shutdown_cuts_running_streams_with_an_error_event_and_done(serving_engine, caplog, signals, grace):
    caplog.set_level(logging.WARNING, logger="chatcore.serve")
    with running(serving_engine, grace=grace) as (scheduler, server, client):
        model = client.models.list().data[0].id
        with held(f"cut-{signals}") as opened:
            body = {"model": model, "messages": HI, "max_tokens": 20, "decoder": "greedy"}
            connection, response = start_stream(server, {**body, "steer": [f"blocking gate=cut-{signals}"]})
            assert opened.entered.wait(60)
            for _ in range(signals):
                server.server.handle_exit(signal.SIGTERM, None)
            events = rest_of_stream(response)
            connection.close()
            server.thread.join(60)
            assert not server.thread.is_alive()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutdown" and "shutting down" in error["message"]
    assert any("shutdown: cut reply chatcmpl-" in record.getMessage() for record in caplog.records)


@pytest.mark.slow
def test_sigterm_stops_chatcore_serve_with_exit_status_0(tiny_model_dir):
    import os
    import re
    import subprocess
    import sys

    # Port 0 takes a free port; the line that says the server is serving names the one it took.
    command = [sys.executable, "-m", "chatcore.cli", "serve", "--port", "0", "--model", str(tiny_model_dir)]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "CHATCORE_PLUGINS": ""}
    )
    try:
        assert server.stdout is not None
        for line in server.stdout:  # the server says it is serving once it listens
            if b"serving" in line:
                break
        served = re.search(rb"on http://127\.0\.0\.1:(\d+)/v1 ", line)
        assert served is not None and served[1] != b"0", line
        port = int(served[1])
        health = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        health.request("GET", "/health")
        assert health.getresponse().status == 200
        health.close()
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=60)[0].decode()
    finally:
        server.kill()
    assert server.returncode == 0, output
    assert "stopping" in output and "chatcore: stopped" in output


def test_chatcore_serve_warms_the_fast_path_up_before_it_listens(tiny_model_dir):
    """On the fast path the server runs its warm-up replies before it says it serves; they are
    nobody's: no reply counted, nothing in flight."""
    import os
    import re
    import subprocess
    import sys

    command = [sys.executable, "-m", "chatcore.cli", "serve", "--port", "0", "--model", str(tiny_model_dir)]
    environment = {**os.environ, "CHATCORE_PLUGINS": "", FAST_PATH_ENV: "on"}
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment)
    try:
        assert server.stdout is not None
        before = []
        for line in server.stdout:
            if b"serving" in line:
                break
            before.append(line.decode())
        assert any(text.startswith("chatcore: warming up the fast path for batches of up to 8 (") for text in before)
        assert any(text.startswith("chatcore: warmed up in ") for text in before), before
        served = re.search(rb"on http://127\.0\.0\.1:(\d+)/v1 ", line)
        assert served is not None
        connection = http.client.HTTPConnection("127.0.0.1", int(served[1]), timeout=30)
        connection.request("GET", "/health")
        health = json.loads(connection.getresponse().read())
        assert health["in_flight"] == 0 and health["queue_depth"] == 0
        connection.request("GET", "/metrics")
        metrics = connection.getresponse().read().decode()
        connection.close()
        assert not re.search(r"^chatcore_replies_total\{[^}]*\} [1-9]", metrics, re.MULTILINE), metrics
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=60)[0].decode()
    finally:
        server.kill()
    assert server.returncode == 0, output


# -- 5. the parameters clients send -----------------------------------------------------------
def test_penalties_and_logit_bias_match_the_engine(engine, serving_engine):
    with running(serving_engine) as (scheduler, server, client):
        model = client.models.list().data[0].id
        asked = "tell me about your favourite food"
        messages = [{"role": "user", "content": asked}]
        plain = client.chat.completions.create(model=model, messages=messages, max_tokens=12, seed=5)
        zeros = client.chat.completions.create(
            model=model, messages=messages, max_tokens=12, seed=5, presence_penalty=0, frequency_penalty=0
        )
        assert zeros.choices[0].message.content == plain.choices[0].message.content
        penalised = client.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0, presence_penalty=1.5, frequency_penalty=2
        )
        greedy = engine.reply_to([asked], ReplyOptions(decoder="greedy", max_new_tokens=12))
        greedy.text()
        first = greedy.token_ids[0]
        biased = client.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0, logit_bias={str(first): -100}
        )
    expected = engine.reply_to(
        [asked],
        ReplyOptions(
            decoder="greedy", max_new_tokens=12, decoder_settings={"presence_penalty": 1.5, "frequency_penalty": 2}
        ),
    )
    assert penalised.choices[0].message.content == expected.text() != greedy.text()
    assert len(set(expected.token_ids)) == len(expected.token_ids)  # a penalty of 2 per use: no token twice
    banned = engine.reply_to(
        [asked], ReplyOptions(decoder="greedy", max_new_tokens=12, decoder_settings={"logit_bias": {first: -100}})
    )
    assert biased.choices[0].message.content == banned.text()
    assert banned.token_ids[0] != first
    # A token id outside the vocabulary is refused in the engine too (chat's /set, generate, eval).
    vocabulary = len(engine.tokenizer)
    outside = ReplyOptions(decoder="greedy", decoder_settings={"logit_bias": {vocabulary + 5: -100, 3: 1}})
    with pytest.raises(
        OptionError,
        match=rf"^decoder 'greedy': `logit_bias` keys must be token ids below {vocabulary}, got {vocabulary + 5}$",
    ):
        engine.prepare_reply([Message("user", asked)], outside)


@pytest.mark.parametrize(
    "fields, param, says",
    [
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "must be token ids below"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", "must be token ids below"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "between -100 and 100"),
        ({"decoder": "greedy", "temperature": 0.7}, "temperature", "does not apply to the greedy decoder"),
        ({"decoder": "greedy", "top_p": 0.5}, "top_p", "does not apply to the greedy decoder"),
        ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages.[0].name", "participant names"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
                ]
            },
            "messages.[0].content",
            "has a `image_url` part: this server's models take text only",
        ),
        ({"messages": [{"role": "user", "content": None}]}, "messages.[0].content", "has no content"),
    ],
)
def test_parameters_the_server_cannot_honour_are_refused_clearly(serving_engine, fields, param, says):
    with running(serving_engine) as (scheduler, server, client):
        body = {"model": client.models.list().data[0].id, "messages": HI, **fields}
        connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        connection.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        response = connection.getresponse()
        error = json.loads(response.read())["error"]
        connection.close()
    assert response.status == 400 and error["param"] == param and says in error["message"], error


def test_empty_assistant_turns_come_back_as_history(serving_engine):
    with running(serving_engine) as (scheduler, server, client):
        model = client.models.list().data[0].id
        for empty in ("", None):
            history = [*HI, {"role": "assistant", "content": empty}, {"role": "user", "content": "and then?"}]
            reply = client.chat.completions.create(model=model, messages=history, max_tokens=3)
            assert reply.choices[0].finish_reason in ("stop", "length")
        greedy = client.chat.completions.create(model=model, messages=HI, max_tokens=3, temperature=0)
        assert greedy.model_extra["chatcore"]["decoder"]["name"] == "greedy"


def test_served_model_names_are_aliases(serving_engine):
    with running(serving_engine, served_model_names=("chat", "gpt-4o-mini")) as (scheduler, server, client):
        assert [card.id for card in client.models.list().data] == ["chat", "gpt-4o-mini"]
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=2)
        assert reply.model == "gpt-4o-mini"
        assert client.models.retrieve("chat").id == "chat"
        with pytest.raises(openai.NotFoundError, match="serves 'chat' or 'gpt-4o-mini'"):
            client.chat.completions.create(model="other", messages=HI)


def preflight(server, origin: str) -> tuple[int, dict[str, str]]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    connection.request("OPTIONS", "/v1/chat/completions", headers=headers)
    response = connection.getresponse()
    response.read()
    connection.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}


def test_cors_is_off_unless_origins_are_given(serving_engine):
    site = "https://chat.example.com"
    with running(serving_engine) as (scheduler, server, client):
        status, headers = preflight(server, site)
        assert status == 405 and "access-control-allow-origin" not in headers
    with running(serving_engine, cors_origins=(site,)) as (scheduler, server, client):
        status, headers = preflight(server, site)
        assert status == 200 and headers["access-control-allow-origin"] == site
        assert "POST" in headers["access-control-allow-methods"]
        assert preflight(server, "https://elsewhere.example")[0] == 400


def test_serve_refuses_bad_limits_and_names_before_loading_the_model():
    from click.testing import CliRunner

    from chatcore.cli import build_cli

    runner = CliRunner()
    for option, value in (("--max-queue-wait", "0"), ("--request-timeout", "-1"), ("--shutdown-grace", "-2")):
        result = runner.invoke(build_cli(), ["serve", "--model", "nope", option, value])
        assert result.exit_code == 2 and option in result.output and "Traceback" not in result.output, option
    # NaN passes every comparison, so a range alone let it through: every request then timed out.
    for option in ("--max-queue-wait", "--request-timeout", "--shutdown-grace"):
        for value in ("nan", "inf", "-inf", "NaN"):
            result = runner.invoke(build_cli(), ["serve", "--model", "nope", option, value])
            assert result.exit_code == 2 and "nope" not in result.output, (option, value, result.output)
            assert f"Invalid value for '{option}'" in result.output and "Traceback" not in result.output
            assert result.output.count("Error") == 1, result.output
    result = runner.invoke(build_cli(), ["serve", "--model", "nope", "--request-timeout", "nan"])
    assert "'nan' is not a finite number of seconds" in result.output
    result = runner.invoke(build_cli(), ["serve", "--model", "nope", "--served-model-name", " "])
    assert result.exit_code == 1 and "`--served-model-name` is empty" in result.output


def test_n_above_what_the_scheduler_holds_is_a_400_naming_the_limit(serving_engine):
    """Each choice is a reply the scheduler holds: asking for more than it can ever hold at
    once (--max-batch + --max-waiting) would be 429 for ever, even on an idle server."""
    with running(serving_engine, max_batch=2, max_waiting=1) as (scheduler, server, client):  # --max-n: 8
        model = client.models.list().data[0].id
        for n in (4, 9):  # under --max-n and over it: the smaller limit is named
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(model=model, messages=HI, max_tokens=2, n=n)
            error = caught.value.body
            assert error["param"] == "n" and error["message"] == (
                f"`n` must be at most 3 on this server, which holds 2 replies decoding and 1 waiting "
                f"(--max-batch, --max-waiting), got {n}"
            )
        assert len(client.chat.completions.create(model=model, messages=HI, max_tokens=2, n=3).choices) == 3
    with running(serving_engine, max_batch=2, max_waiting=8, max_n=2) as (scheduler, server, client):
        with pytest.raises(openai.BadRequestError, match=r"at most 2 on this server \(--max-n\), got 3"):
            client.chat.completions.create(model=client.models.list().data[0].id, messages=HI, max_tokens=2, n=3)


def test_serve_refuses_a_max_n_its_queue_cannot_hold_before_loading_the_model():
    from click.testing import CliRunner

    from chatcore.cli import build_cli

    runner = CliRunner()
    small = ["serve", "--port", "0", "--model", "nope", "--max-batch", "2", "--max-waiting", "1"]
    result = runner.invoke(build_cli(), [*small, "--max-n", "4"])
    assert result.exit_code == 1 and "nope" not in result.output and "Traceback" not in result.output
    assert result.output.strip() == (
        "Error: `--max-n 4` is more replies than the server holds at once: --max-batch 2 + --max-waiting 1 = 3; "
        "give --max-n 3 or less, or raise those"
    )
    # The default --max-n (8) is no refusal: requests above 3 get a 400 instead (above). "nope" then
    # fails to load, which shows the options passed; so do the defaults (8 decoding, 64 waiting).
    for options in (small, small[:5], [*small[:5], "--max-n", "64"]):
        result = runner.invoke(build_cli(), options)
        assert result.exit_code == 1 and "model 'nope'" in result.output and "--max-n" not in result.output


def test_serve_refuses_cors_origins_that_are_not_origins():
    from click.testing import CliRunner

    from chatcore.adapters.http_api.command import browser_origin
    from chatcore.cli import build_cli

    runner = CliRunner()
    for value in ("not an origin", "chat.example.com", "https://chat.example.com/", "https://x.com/app",
                  "https://user@x.com", "https://x.com:99999", "https://", "**"):  # fmt: skip
        result = runner.invoke(build_cli(), ["serve", "--model", "nope", "--cors-origin", value])
        assert result.exit_code == 2 and "nope" not in result.output, (value, result.output)
        assert f"Invalid value for '--cors-origin': {value!r} is not an origin" in result.output
    # As a browser's Origin header spells it, which is what the middleware compares.
    assert browser_origin("HTTPS://Chat.Example.com:443") == "https://chat.example.com"
    assert browser_origin("http://localhost:3000") == "http://localhost:3000"
    assert browser_origin("http://[::1]:80") == "http://[::1]"
    origins = ["--cors-origin", "*", "--cors-origin", "http://a.b"]
    result = runner.invoke(build_cli(), ["serve", "--port", "0", "--model", "nope", *origins])
    assert result.exit_code == 1 and "model 'nope'" in result.output


def test_the_serving_line_names_the_port_bound():
    from chatcore.adapters.http_api.command import bind_listener, listening_url

    with bind_listener("127.0.0.1", 0) as listener:
        port = listener.getsockname()[1]
        assert port != 0 and listening_url("127.0.0.1", listener) == f"http://127.0.0.1:{port}/v1"
        assert listening_url("::1", listener) == f"http://[::1]:{port}/v1"  # IPv6 as URLs write it


def test_a_client_gone_in_the_middle_of_its_body_leaves_no_traceback(serving_engine, caplog):
    """A request whose client hangs up before its body ended is answered (to nobody) like any
    bad request: one counted 400, nothing in the server's log."""
    import socket
    import threading

    with running(serving_engine) as (scheduler, server, client):
        metrics = server.server.config.app.state.metrics
        answered = threading.Event()
        record_status = metrics.record_status

        def record_and_tell(path: str, status: int) -> None:
            record_status(path, status)
            if path.endswith("/chat/completions"):
                answered.set()

        metrics.record_status = record_and_tell
        with caplog.at_level(logging.INFO):
            connection = socket.create_connection((server.host, server.port))
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            connection.sendall(head.encode() + b"Content-Length: 100\r\n\r\n{")
            connection.close()
            assert answered.wait(60)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
        assert b'route="/v1/chat/completions",status="400"' in metrics.exposition()


@pytest.mark.parametrize("logging", [False, True])
def test_plugins_hooks_see_each_request_as_a_turn_and_a_continuation_as_the_same_conversation(
    serving_engine, tmp_path, logging
):
    """``on_user_message`` and ``on_response`` fire for HTTP requests as for every other entry
    point: the request's last user message, then the reply as the client got it; the next
    turn of a conversation (same messages, that reply, a new message, same ``user``) keeps its id,
    which, where the server logs, is the log's."""
    import threading

    import chatcore
    from chatcore.adapters.http_api.request_log import RequestLog

    request_log = RequestLog(str(tmp_path / "log.sqlite3"), engine=serving_engine) if logging else None

    seen: list[tuple[str, str | None, str, str]] = []
    twice = threading.Event()

    class Listener:
        @chatcore.hookimpl
        def on_user_message(self, conversation, turn):
            seen.append(("user", conversation.id, turn.text, conversation.turns[-1].text))

        @chatcore.hookimpl
        def on_response(self, conversation, response):
            assert response.done and conversation.turns[-1].text == response.text()
            seen.append(("reply", conversation.id, response.text(), str(len(response.token_ids))))
            if sum(kind == "reply" for kind, *_ in seen) == 2:
                twice.set()

    serving_engine.host.register(Listener(), "listener")
    try:
        with running(serving_engine, log=request_log) as (scheduler, server, client):
            model = client.models.list().data[0].id
            opening = [{"role": "user", "content": "hi there, how are you?"}]
            first = client.chat.completions.create(model=model, messages=opening, max_tokens=6, user="ann")
            said = first.choices[0].message.content
            following = [*opening, {"role": "assistant", "content": said}, {"role": "user", "content": "and then?"}]
            second = client.chat.completions.create(model=model, messages=following, max_tokens=6, user="ann")
            assert twice.wait(60)
    finally:
        serving_engine.host.pm.unregister(name="listener")
        if request_log is not None:
            request_log.close()
    (_, first_id, asked, last), (_, reply_id, text, tokens) = seen[0], seen[1]
    if request_log is not None:
        assert request_log.store is not None
        with request_log.store as store:
            assert [summary.id for summary in store.list_conversations()] == [first_id]
    assert (asked, last, text) == ("hi there, how are you?", "hi there, how are you?", said) and first_id == reply_id
    assert int(tokens) == first.usage.completion_tokens
    assert seen[2][:3] == ("user", first_id, "and then?")
    assert seen[3][:3] == ("reply", first_id, second.choices[0].message.content)


STAINLESS_HEADERS = (
    "authorization,content-type,x-stainless-os,x-stainless-lang,x-stainless-arch,x-stainless-runtime,"
    "x-stainless-runtime-version,x-stainless-package-version,x-stainless-timeout,x-stainless-retry-count,"
    "x-stainless-helper-method"
)


@pytest.mark.parametrize("allowed", ["https://chat.example.com", "*"])
def test_cors_preflight_accepts_the_headers_the_openai_npm_client_sends(serving_engine, allowed):
    """The JS client adds X-Stainless-* headers to every request; its browser's preflight asks
    for them and must get them, while origins stay as the operator set them."""
    site = "https://chat.example.com"

    def ask(origin: str) -> tuple[int, dict[str, str]]:
        connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
        headers = {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": STAINLESS_HEADERS,
        }
        connection.request("OPTIONS", "/v1/chat/completions", headers=headers)
        response = connection.getresponse()
        response.read()
        connection.close()
        return response.status, {k.lower(): v for k, v in response.getheaders()}

    with running(serving_engine, cors_origins=(allowed,)) as (scheduler, server, client):
        status, headers = ask(site)
        assert status == 200, headers
        assert headers["access-control-allow-origin"] == ("*" if allowed == "*" else site)
        granted = {name.strip().lower() for name in headers["access-control-allow-headers"].split(",")}
        assert granted >= set(STAINLESS_HEADERS.split(","))
        if allowed != "*":
            assert ask("https://elsewhere.example")[0] == 400


def test_a_reply_cut_by_max_tokens_in_a_character_never_ends_in_a_broken_one(serving_engine, tmp_path):
    """max_tokens that ends a reply after half an emoji's bytes: the text, streamed or not, and
    the log end on the last whole character; usage still counts every token."""
    import threading

    from fixed_text import FixedTextPlugin

    import chatcore
    from chatcore.adapters.http_api.request_log import RequestLog
    from chatcore.text import encode_text

    ids = encode_text(serving_engine.tokenizer, "ok😀")
    budget = len(ids) - 1  # the emoji's last byte is not said
    logged: list[str] = []
    both = threading.Event()

    class Listener:
        @chatcore.hookimpl
        def on_response(self, conversation, response):
            logged.append(response.text())
            if len(logged) == 2:
                both.set()

    serving_engine.host.register(FixedTextPlugin(), "fixed-text-test")
    serving_engine.host.register(Listener(), "listener")
    request_log = RequestLog(str(tmp_path / "log.sqlite3"), engine=serving_engine)
    try:
        with running(serving_engine, log=request_log) as (scheduler, server, client):
            asked = dict(model=client.models.list().data[0].id, messages=HI, max_tokens=budget)
            extra = {"decoder": "fixed-text text=ok😀"}
            reply = client.chat.completions.create(**asked, extra_body=extra)
            assert reply.choices[0].message.content == "ok" and reply.choices[0].finish_reason == "length"
            assert reply.usage.completion_tokens == budget
            chunks = list(client.chat.completions.create(**asked, extra_body=extra, stream=True))
            streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
            assert streamed == "ok" and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
            assert both.wait(60)
        assert request_log.store is not None
        with request_log.store as store:
            replies = [
                turn.text
                for summary in store.list_conversations()
                for turn in store.load_turns(summary.id)
                if turn.role == "bot"
            ]
    finally:
        serving_engine.host.pm.unregister(name="listener")
        serving_engine.host.pm.unregister(name="fixed-text-test")
        request_log.close()
    assert logged == ["ok", "ok"] and replies == ["ok", "ok"]


def test_a_message_over_the_length_limit_is_a_400_naming_the_limit(serving_engine):
    from chatcore.prompting import MAX_SYSTEM_CHARS
    from chatcore.text import MAX_MESSAGE_CHARS

    too_long = "a" * (MAX_MESSAGE_CHARS + 1)
    cases = [
        ([{"role": "user", "content": too_long}], 0, f"the message is {MAX_MESSAGE_CHARS + 1:,} characters long"),
        (
            [*HI, {"role": "assistant", "content": too_long}, {"role": "user", "content": "and?"}],
            1,
            f"the message is {MAX_MESSAGE_CHARS + 1:,} characters long",
        ),
        (
            [{"role": "system", "content": "s" * (MAX_SYSTEM_CHARS + 1)}, *HI],
            0,
            f"the system prompt is {MAX_SYSTEM_CHARS + 1:,} characters long",
        ),
    ]
    with running(serving_engine) as (scheduler, server, client):
        model = client.models.list().data[0].id
        for messages, index, says in cases:
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(model=model, messages=messages, max_tokens=2)
            limit = MAX_SYSTEM_CHARS if messages[index]["role"] == "system" else MAX_MESSAGE_CHARS
            error = caught.value.body
            assert error["message"] == f"messages[{index}]: {says}; the limit is {limit:,}"
            assert error["param"] == f"messages.[{index}].content"
