"""Every hook is documented with its exact signature, and every hook has a test here."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import chatcore
from chatcore import hookspecs
from chatcore.decoding import Decoder
from chatcore.evaluation.prompts import EvalContext
from chatcore.registry import Registry

DOCS = Path(__file__).resolve().parents[1] / "docs" / "hooks.md"


def hook_names() -> list[str]:
    return sorted(
        name
        for name, function in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(function, "chatcore_spec")
    )


def signature_text(name: str) -> str:
    signature = inspect.signature(getattr(hookspecs, name))
    parameters = ", ".join(f"{p.name}: {p.annotation}" for p in signature.parameters.values())
    return f"def {name}({parameters}) -> {signature.return_annotation}"


def test_there_are_hooks() -> None:
    assert {"register_decoders", "register_steerers", "register_commands", "on_user_message", "on_response"} <= set(
        hook_names()
    )


@pytest.mark.parametrize("name", hook_names())
def test_hook_is_documented_with_exact_signature(name: str) -> None:
    text = DOCS.read_text(encoding="utf-8")
    assert f"## {name}\n" in text, f"docs/hooks.md has no section for {name}"
    section = text.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
    assert signature_text(name) in section, f"docs/hooks.md shows another signature for {name}"
    assert getattr(hookspecs, name).__doc__, f"hookspec {name} has no docstring"


def test_docs_have_no_stale_hooks() -> None:
    documented = re.findall(r"^## (\w+)$", DOCS.read_text(encoding="utf-8"), flags=re.M)
    assert sorted(documented) == hook_names()


@pytest.mark.parametrize("name", hook_names())
def test_every_hook_has_a_test(name: str) -> None:
    assert hasattr(sys.modules[__name__], f"test_hook_{name}"), f"no test_hook_{name} in {__file__}"


class EchoDecoder(Decoder):
    name = "echo-test"

    def decode(self, session):  # pragma: no cover - only registered
        yield from ()


def test_hook_register_decoders(host) -> None:
    class Plugin:
        @chatcore.hookimpl
        def register_decoders(self, register):
            register(EchoDecoder)

    host.register(Plugin(), "echo")
    registry = Registry.build(host)
    assert registry.decoder("echo-test") is EchoDecoder
    assert registry.decoders["echo-test"].plugin == "echo"


def test_hook_register_steerers(host) -> None:
    from chatcore.steering import Steerer

    class Nudge(Steerer):
        name = "nudge-test"

        def wrap(self, step):
            return step

    class Plugin:
        @chatcore.hookimpl
        def register_steerers(self, register):
            register(Nudge)

    host.register(Plugin(), "nudge")
    assert Registry.build(host).steerer("nudge-test") is Nudge


def test_hook_register_commands(host) -> None:
    group = click.Group("chatcore")

    class Plugin:
        @chatcore.hookimpl
        def register_commands(self, cli):
            @cli.command()
            def hello() -> None:
                click.echo("hello from a plugin")

    host.register(Plugin(), "hello")
    host.call_each("register_commands", cli=group)
    result = CliRunner().invoke(group, ["hello"])
    assert result.exit_code == 0 and "hello from a plugin" in result.output


def test_hook_register_prompt_formats(host, loaded) -> None:
    from chatcore.engine import Engine
    from chatcore.prompting import PromptFormat

    class ShoutFormat(PromptFormat):
        """Every message upper-cased, then EOS; the reply ends at EOS or a full stop."""

        name = "shout-test"
        history_may_start_with_assistant = True

        def render(self, messages):
            ids = []
            for message in messages:
                ids += self.encode_text(message.text.upper()) + [self.tokenizer.eos_token_id]
            return ids

        def end_of_turn_ids(self):
            return {self.encode_text(".")[0]}

    class Plugin:
        @chatcore.hookimpl
        def register_prompt_formats(self, register):
            register(ShoutFormat)

    host.register(Plugin(), "shout")
    engine = Engine(loaded, host=host, prompt_format="shout-test")
    assert Registry.build(host).prompt_formats["shout-test"].plugin == "shout"
    assert engine.prompt_format.name == "shout-test"
    conversation = engine.conversation(system="be loud")
    engine.add_user(conversation, "hello there")
    tokenizer, eos = loaded.tokenizer, loaded.tokenizer.eos_token_id
    expected = tokenizer("BE LOUD")["input_ids"] + [eos] + tokenizer("HELLO THERE")["input_ids"] + [eos]
    assert engine.prompt(conversation, 16).token_ids == expected
    full_stop = tokenizer(".")["input_ids"][0]
    assert engine.prompt_format.stop_token_ids == {eos, full_stop}
    response = engine.respond(conversation, decoder="greedy", seed=0, max_new_tokens=30)
    response.text()
    assert full_stop not in response.token_ids and eos not in response.token_ids


def test_hook_register_prompt_sets(host) -> None:
    class Plugin:
        @chatcore.hookimpl
        def register_prompt_sets(self, register):
            register("greetings-test", lambda: [EvalContext(["hi"]), EvalContext(["hello"], "hey")])

    host.register(Plugin(), "greetings")
    contexts = Registry.build(host).prompt_set("greetings-test")()
    assert [c.turns for c in contexts] == [["hi"], ["hello"]]


def test_a_prompt_set_whose_loader_is_not_callable_is_refused_naming_the_plugin(host) -> None:
    class Plugin:
        @chatcore.hookimpl
        def register_prompt_sets(self, register):
            register("bad-set", "not callable")
            register("good-set", lambda: [EvalContext(["hi"])])

    host.register(Plugin(), "careless")
    registry = Registry.build(host)
    assert "bad-set" not in registry.prompt_sets and "good-set" in registry.prompt_sets
    assert [str(p) for p in host.problems] == [
        "plugin 'careless' failed at hook register_prompt_sets: TypeError: register_prompt_sets: 'bad-set': "
        "the loader must be a function returning the set's contexts, got 'not callable'"
    ]


def test_hook_on_user_message(engine) -> None:
    seen = []

    class Plugin:
        @chatcore.hookimpl
        def on_user_message(self, conversation, turn, model):
            seen.append((conversation.id, turn.role, turn.text, len(conversation.turns), model))

    engine.host.register(Plugin(), "listener")
    conversation = engine.conversation()
    engine.add_user(conversation, "hello\tthere")
    assert seen == [(conversation.id, "user", "hello\tthere", 1, engine.loaded)]


def test_hook_warm_up_steerers(engine, monkeypatch) -> None:
    """A server's warm-up asks plugins for steerers to warm up and runs one reply with each,
    after the batch's own replies (here on the CPU's eager fast path, where nothing compiles)."""
    from chatcore.serving import Scheduler, static_step
    from chatcore.serving.warm_up import warm_up

    asked = []

    class Plugin:
        @chatcore.hookimpl
        def warm_up_steerers(self, model):
            asked.append(model)
            return [("bow-bias", {"topic": "food"})]

    engine.host.register(Plugin(), "warmer")
    monkeypatch.setenv(static_step.FAST_PATH_ENV, "on")
    submitted = []
    submit = Scheduler.submit

    def spy(self, messages, options=None, *rest, **keywords):
        submitted.append(options.steerers)
        return submit(self, messages, options, *rest, **keywords)

    monkeypatch.setattr(Scheduler, "submit", spy)
    with Scheduler(engine, max_batch=1) as scheduler:
        assert warm_up(scheduler) is not None
    assert asked == [engine.loaded]
    assert submitted[-1] == [("bow-bias", {"topic": "food"})] and all(not s for s in submitted[:-1])


def test_hook_on_response(engine) -> None:
    seen = []

    class Plugin:
        @chatcore.hookimpl
        def on_response(self, conversation, response):
            seen.append((response.text(), conversation.turns[-1].text, response.provenance["decoder"]["name"]))

    engine.host.register(Plugin(), "listener")
    conversation = engine.conversation()
    text = engine.send(conversation, "hi", decoder="greedy", max_new_tokens=5).text()
    assert seen == [(text, text, "greedy")]
