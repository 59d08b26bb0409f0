"""A request cannot make the server open a file or load a model of its choosing: decoder and
steerer settings marked ``OnThisMachine`` take only their bundled names over HTTP, unless the
operator started the server with ``--allow-local-files``."""

from __future__ import annotations

import openai
import pytest

from chatcore.api import ON_THIS_MACHINE, OnThisMachine, Settings
from chatcore.options import machine_settings

HI = [{"role": "user", "content": "hi, how are you?"}]
SECRET_WORDS = "zebracorn platypus hunter"


def chat_options(steer=(), decoder=None, allow=False):
    from chatcore.adapters.http_api.completions import to_options
    from chatcore.adapters.http_api.schema import ChatCompletionRequest
    from chatcore.registry import registry_of

    fields = {"model": "m", "messages": HI, "steer": list(steer)}
    if decoder is not None:
        fields["decoder"] = decoder
    return to_options(ChatCompletionRequest(**fields), registry_of(), machine_names=allow)


def refusal(**request) -> str:
    from chatcore.adapters.http_api.errors import ApiError

    with pytest.raises(ApiError) as raised:
        chat_options(**request)
    return str(raised.value)


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("\n".join(SECRET_WORDS.split()) + "\n", encoding="utf-8")  # a word file: one a line
    return path


@pytest.mark.parametrize(
    "request_fields",
    [
        {"steer": ["bow-bias file={path}"]},
        {"steer": ["pplm file={path}"]},
        {"steer": ["pplm discriminator={path} class_label=positive"]},
        {"steer": ["vector path={path}"]},
        {"steer": ["cocon block={path}"]},
        {"decoder": "rank file={path}"},
        {"decoder": "mmi reverse_model={path}"},
    ],
)
def test_a_request_naming_a_file_or_model_is_refused_alike_whether_it_exists_or_not(request_fields, secret, tmp_path):
    def fields(path):
        return {
            key: [spec.format(path=path) for spec in value] if isinstance(value, list) else value.format(path=path)
            for key, value in request_fields.items()
        }

    there = refusal(**fields(secret))
    missing = refusal(**fields(tmp_path / "missing.txt"))
    assert "on the machine that runs chatcore" in there and "--allow-local-files" in there
    # The answer says nothing of what is on the disk: the same words for a file there and one not.
    assert there == missing


def test_a_hub_model_is_refused_before_anything_loads():
    message = refusal(decoder="mmi reverse_model=facebook/opt-125m")
    assert "`reverse_model` names a model" in message and "auto, chatcore-tiny-reverse" in message


@pytest.mark.parametrize(
    "request_fields",
    [
        {"steer": ["pplm discriminator=sentiment class_label=positive"]},
        {"steer": ["bow-bias topic=food"]},
        {"decoder": "mmi reverse_model=auto"},
        {"decoder": "mmi reverse_model=chatcore-tiny-reverse"},
        {"steer": ["cocon content=pizza"]},
        {"steer": ["vector pairs=food"]},
        {"steer": ["bow-bias topic=food file=none"]},
    ],
)
def test_bundled_names_and_defaults_still_go(request_fields):
    chat_options(**request_fields)


def test_the_operator_may_allow_files(secret):
    options = chat_options(steer=[f"bow-bias file={secret}"], allow=True)
    assert options.steerers == [("bow-bias", {"file": str(secret)})]


def test_the_marker_is_read_from_a_plugin_settings_class():
    from typing import Annotated

    class Mine(Settings):
        model_file: Annotated[str | None, OnThisMachine("weights file")] = None
        folder: Annotated[str, ON_THIS_MACHINE] = "bundled"
        words: str = "a,b"

    marked = machine_settings(Mine)
    assert set(marked) == {"model_file", "folder"}
    assert marked["model_file"][0].what == "weights file" and marked["folder"][1] == "bundled"


def test_over_http_the_secret_stays_on_the_server(serving_engine, secret):
    """The official client gets a 400 naming the setting; the reply's scores never saw the file."""
    from chatcore.adapters.http_api.app import ServeConfig, build_app
    from chatcore.adapters.http_api.server import start_in_thread
    from chatcore.serving import Scheduler

    for allow in (False, True):
        scheduler = Scheduler(serving_engine, max_batch=2, max_waiting=4)
        running = start_in_thread(build_app(scheduler, ServeConfig(allow_local_files=allow)))
        try:
            client = openai.OpenAI(base_url=running.url, api_key="none", max_retries=0, timeout=60)
            model = client.models.list().data[0].id
            asked = dict(model=model, messages=HI, max_tokens=1, temperature=0, logprobs=True, top_logprobs=5)
            extra = {"steer": [f"bow-bias file={secret} strength=100"]}
            if not allow:
                with pytest.raises(openai.BadRequestError) as refused:
                    client.chat.completions.create(**asked, extra_body=extra)
                assert refused.value.status_code == 400 and "`file`" in refused.value.message
            else:
                reply = client.chat.completions.create(**asked, extra_body=extra)
                top = [entry.token.strip().lower() for entry in reply.choices[0].logprobs.content[0].top_logprobs]
                assert any(word.startswith(token) and token for token in top for word in SECRET_WORDS.split())
        finally:
            running.stop()
            scheduler.close()
