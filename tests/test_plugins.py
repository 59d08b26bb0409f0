"""Plugin isolation, registration rules, name lookup, settings and entry points."""

from __future__ import annotations

import logging
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import chatcore
from chatcore.decoding import Decoder
from chatcore.engine import Engine, ReplyOptions
from chatcore.errors import ChatcoreError, OptionError, PluginError, UnknownNameError
from chatcore.plugin_manager import PluginHost, get_plugin_host, set_plugin_host
from chatcore.plugins.greedy import GreedyDecoder
from chatcore.registry import Registry
from chatcore.steering import Steerer


def problems_of(host, plugin=None):
    return [(p.plugin, p.stage) for p in host.problems if plugin is None or p.plugin == plugin]


# -- small plugins ----------------------------------------------------------------------------


class EchoDecoder(GreedyDecoder):
    name = "echo"


class OtherGreedy(GreedyDecoder):
    name = "greedy"  # clashes with the built-in


class RaisingRegistration:
    @chatcore.hookimpl
    def register_decoders(self, register):
        raise RuntimeError("cannot register today")


class EchoPlugin:
    @chatcore.hookimpl
    def register_decoders(self, register):
        register(EchoDecoder)


class Misspelled:
    @chatcore.hookimpl
    def register_decoderz(self, register):  # not a hook
        register(EchoDecoder)


class NotADecoderPlugin:
    @chatcore.hookimpl
    def register_decoders(self, register):
        register(dict)


class InstancePlugin:
    @chatcore.hookimpl
    def register_decoders(self, register):
        register(EchoDecoder())  # an instance, not a class


# -- isolation -------------------------------------------------------------------------------


def test_a_raising_hook_is_reported_by_name_and_others_still_register(host):
    assert host.register(RaisingRegistration(), "raiser")
    assert host.register(EchoPlugin(), "echo-plugin")
    registry = Registry.build(host)
    assert problems_of(host) == [("raiser", "hook register_decoders")]
    assert "cannot register today" in host.problems[0].message
    assert "raiser" in str(host.problems[0])
    assert set(registry.decoders) == {"greedy", "top-k", "echo"}
    assert registry.decoders["echo"].plugin == "echo-plugin"
    assert registry.decoders["greedy"].plugin == "chatcore.plugins.greedy"
    assert set(registry.steerers) == {"bow-bias"}


def test_engine_works_next_to_a_broken_plugin(loaded, host):
    host.register(RaisingRegistration(), "raiser")
    engine = Engine(loaded, host=host)
    response = engine.send(
        engine.conversation(), "hi", ReplyOptions(decoder="greedy", max_new_tokens=3, min_new_tokens=3)
    )
    assert response.text()
    assert len(response.token_ids) == 3
    assert problems_of(host) == [("raiser", "hook register_decoders")]


def test_a_module_that_fails_to_import_is_reported_not_raised():
    host = PluginHost()
    host.load_modules(("chatcore.plugins.does_not_exist", "chatcore.plugins.greedy"))
    assert problems_of(host) == [("chatcore.plugins.does_not_exist", "import")]
    assert "ModuleNotFoundError" in host.problems[0].message
    assert set(Registry.build(host).decoders) == {"greedy"}


def test_a_module_that_raises_on_import_is_reported(tmp_path, monkeypatch):
    (tmp_path / "chatcore_test_exploding_plugin.py").write_text("raise RuntimeError('bad plugin module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    host = PluginHost()
    host.load_modules(("chatcore_test_exploding_plugin", "chatcore.plugins.top_k"))
    assert problems_of(host) == [("chatcore_test_exploding_plugin", "import")]
    assert "bad plugin module" in host.problems[0].message
    assert set(Registry.build(host).decoders) == {"top-k"}


def test_a_misspelled_hookimpl_is_reported_and_unregistered(host):
    assert host.register(Misspelled(), "typo-plugin")
    host.check_pending()
    assert problems_of(host) == [("typo-plugin", "validate")]
    assert "register_decoderz" in host.problems[0].message
    assert host.pm.get_plugin("typo-plugin") is None
    assert "typo-plugin" not in host.infos
    assert set(Registry.build(host).decoders) == {"greedy", "top-k"}


def test_a_misspelled_hookimpl_in_a_module_is_caught_by_load_modules(tmp_path, monkeypatch):
    (tmp_path / "chatcore_test_typo_plugin.py").write_text(
        textwrap.dedent("""
        import chatcore

        @chatcore.hookimpl
        def on_respons(conversation, response):
            pass
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    host = PluginHost()
    host.load_modules(("chatcore.plugins.greedy", "chatcore_test_typo_plugin"))
    assert problems_of(host) == [("chatcore_test_typo_plugin", "validate")]
    assert "on_respons" in host.problems[0].message
    assert [info.name for info in host.plugins()] == ["chatcore.plugins.greedy"]


def test_a_hookimpl_with_wrong_arguments_is_refused_at_registration(host):
    class WrongArguments:
        @chatcore.hookimpl
        def register_decoders(self, register, extra):
            pass

    assert host.register(WrongArguments(), "wrong-args") is False
    assert problems_of(host) == [("wrong-args", "register")]
    assert host.pm.get_plugin("wrong-args") is None
    # pluggy's reason, on the lines after its first, is kept, on one line
    message = host.problems[0].message
    assert "Argument(s) {'extra'} are declared in the hookimpl but can not be found in the hookspec" in message
    assert "\n" not in message


def test_registering_the_same_name_twice_is_reported(host):
    assert host.register(EchoPlugin(), "echo-plugin")
    assert host.register(EchoPlugin(), "echo-plugin") is False
    assert problems_of(host) == [("echo-plugin", "register")]


# -- registration rules ------------------------------------------------------------------------


def test_a_plugin_registering_one_name_twice_keeps_the_first(host):
    class Twice:
        @chatcore.hookimpl
        def register_decoders(self, register):
            register(EchoDecoder)
            register(type("EchoAgain", (GreedyDecoder,), {"name": "echo"}))

    host.register(Twice(), "twice")
    registry = Registry.build(host)
    assert registry.decoders["echo"].value is EchoDecoder
    assert problems_of(host) == [("twice", "hook register_decoders")]
    assert "'echo' is registered twice by this plugin" in host.problems[0].message


def test_built_in_names_are_reserved_and_the_plugin_taking_one_is_named(host):
    class Shadow:
        @chatcore.hookimpl(tryfirst=True)
        def register_decoders(self, register):
            register(OtherGreedy)

    host.register(Shadow(), "shadow")
    registry = Registry.build(host)
    assert registry.decoder("greedy") is not OtherGreedy
    assert registry.decoders["greedy"].plugin == "chatcore.plugins.greedy"
    # The culprit is the plugin that took the name, not the built-in.
    assert problems_of(host) == [("shadow", "hook register_decoders")]
    assert "'greedy' is a built-in name" in host.problems[0].message


def test_a_host_has_one_registry_rebuilt_only_when_its_plugins_change(host):
    from chatcore.registry import registry_of

    first = registry_of(host)
    assert registry_of(host) is first  # built once

    class Shadow:
        @chatcore.hookimpl
        def register_decoders(self, register):
            register(OtherGreedy)

    host.register(Shadow(), "shadow")
    second = registry_of(host)
    assert second is not first and registry_of(host) is second
    host.register(object(), "bystander")  # another rebuild finds the same clash: still one problem
    assert registry_of(host) is not second
    assert problems_of(host) == [("shadow", "hook register_decoders")]
    host.unregister("shadow")
    assert registry_of(host).decoders["greedy"].plugin == "chatcore.plugins.greedy"
    assert problems_of(host) == []  # the clash went with the plugin


@pytest.mark.parametrize("order", [("first", "second"), ("second", "first")])
def test_a_name_two_plugins_register_is_neither_plugins_and_both_are_reachable_qualified(host, order):
    classes = {
        "first": type("FirstEcho", (GreedyDecoder,), {"name": "echo"}),
        "second": EchoDecoder,
    }

    def plugin_for(decoder):
        class Plugin:
            @chatcore.hookimpl
            def register_decoders(self, register):
                register(decoder)

        return Plugin()

    for name in order:  # discovery order must not matter
        host.register(plugin_for(classes[name]), name)
    registry = Registry.build(host)
    assert "echo" not in registry.decoders
    assert registry.decoder("first/echo") is classes["first"]
    assert registry.decoder("second/echo") is classes["second"]
    with pytest.raises(UnknownNameError, match="registered by several plugins: name one, first/echo or second/echo"):
        registry.decoder("echo")
    assert problems_of(host) == [("first", "hook register_decoders"), ("second", "hook register_decoders")]
    assert str(host.problems[0]) == (
        "plugin 'first' failed at hook register_decoders: 'echo' is registered by 'second' too, so by none: "
        "use first/echo or second/echo"
    )
    # a script that followed the advice keeps working once the clash is gone
    host.unregister(order[0])
    alone = Registry.build(host)
    assert alone.decoder("echo") is classes[order[1]] and alone.decoder(f"{order[1]}/echo") is classes[order[1]]
    with pytest.raises(UnknownNameError):
        alone.decoder(f"{order[0]}/echo")


def test_a_refused_registration_leaves_the_hooks_other_registrations(host):
    """One bad ``register(...)`` call is reported alone: what the hook registers after it stays."""

    class Mixed:
        @chatcore.hookimpl
        def register_decoders(self, register):
            register(type("Slashed", (GreedyDecoder,), {"name": "has/slash"}))
            register(type("Spaced", (GreedyDecoder,), {"name": "Upper Name"}))
            register("not a class")
            register(EchoDecoder)

    host.register(Mixed(), "mixed")
    registry = Registry.build(host)
    assert registry.decoder("echo") is EchoDecoder
    messages = [problem.message for problem in host.problems if problem.plugin == "mixed"]
    assert messages == [
        "TypeError: register_decoders: 'has/slash': names cannot contain '/'",
        "TypeError: register_decoders: 'Upper Name': names cannot contain spaces, '=' or quotes",
        "TypeError: register_decoders: expected a Decoder subclass, got 'not a class'",
    ]


def test_a_problem_is_reported_in_one_line():
    from chatcore.plugin_manager import PluginHost

    host = PluginHost()
    host.report("wordy", "import", ValueError("Unable to generate a schema\n\nIf you got this error ...\n"))
    assert str(host.problems[0]) == "plugin 'wordy' failed at import: ValueError: Unable to generate a schema"


def test_an_unknown_name_mentions_plugins_that_failed_to_load(host):
    host.load_modules(("chatcore.plugins.does_not_exist",))
    registry = Registry.build(host)
    with pytest.raises(UnknownNameError, match="does_not_exist failed to load or register: `chatcore plugins`"):
        registry.steerer("vectors")


def test_an_unknown_name_mentions_plugins_whose_registration_hook_raised(host):
    class Raising:
        @chatcore.hookimpl
        def register_steerers(self, register):
            raise RuntimeError("no steerers today")

    host.register(Raising(), "raising-steerers")
    with pytest.raises(UnknownNameError, match="raising-steerers failed to load or register: `chatcore plugins`"):
        Registry.build(host).steerer("its-steerer")


@pytest.mark.parametrize("plugin", [NotADecoderPlugin(), InstancePlugin()])
def test_registering_something_that_is_not_a_decoder_class_is_reported(host, plugin):
    host.register(plugin, "not-a-decoder")
    registry = Registry.build(host)
    assert problems_of(host) == [("not-a-decoder", "hook register_decoders")]
    assert "expected a Decoder subclass" in host.problems[0].message
    assert set(registry.decoders) == {"greedy", "top-k"}


def test_a_steerer_hook_must_register_steerers(host):
    class WrongKind:
        @chatcore.hookimpl
        def register_steerers(self, register):
            register(EchoDecoder)

    host.register(WrongKind(), "wrong-kind")
    registry = Registry.build(host)
    assert problems_of(host) == [("wrong-kind", "hook register_steerers")]
    assert "expected a Steerer subclass" in host.problems[0].message
    assert set(registry.steerers) == {"bow-bias"}


def test_a_nameless_decoder_is_reported(host):
    class Nameless:
        @chatcore.hookimpl
        def register_decoders(self, register):
            register(type("Nameless", (GreedyDecoder,), {"name": ""}))

    host.register(Nameless(), "nameless")
    Registry.build(host)
    assert problems_of(host) == [("nameless", "hook register_decoders")]
    assert "has no name" in host.problems[0].message


# -- names and settings -------------------------------------------------------------------------


def test_unknown_names_list_what_is_available(engine):
    with pytest.raises(UnknownNameError) as excinfo:
        engine.make_decoder("beam")
    assert str(excinfo.value) == "unknown decoder 'beam' (available: greedy, top-k)"
    assert isinstance(excinfo.value, ChatcoreError) and isinstance(excinfo.value, KeyError)
    with pytest.raises(UnknownNameError) as excinfo:
        engine.make_steerer("pplm")
    assert str(excinfo.value) == "unknown steerer 'pplm' (available: bow-bias)"
    with pytest.raises(UnknownNameError, match="available: greedy, top-k"):
        engine.send(engine.conversation(), "hi", ReplyOptions(decoder="Greedy"))


@pytest.mark.parametrize(
    "decoder, settings, needles",
    [
        ("top-k", {"top_k": 0}, ["`top_k` must be a positive integer, got 0", "decoder 'top-k'"]),
        ("top-k", {"top_k": "0"}, ["`top_k` must be a positive integer, got 0"]),
        ("top-k", {"top_k": "abc"}, ["`top_k` must be an integer, got 'abc'"]),
        ("top-k", {"temperature": -1}, ["`temperature` must be between 1e-15 and 1e+38, got -1.0"]),
        ("top-k", {"temperature": "nan"}, ["`temperature` must be a finite number, got 'nan'"]),
        ("top-k", {"top_p": "1.5"}, ["`top_p` must be in (0, 1], got 1.5"]),
        ("top-k", {"foo": 1}, ["unknown setting for decoder 'top-k': 'foo'", "known: ", "top_k"]),
        ("greedy", {"top_k": 5}, ["unknown setting for decoder 'greedy': 'top_k'"]),
        ("greedy", {"repetition_penalty": "0"}, ["`repetition_penalty` must be a number of at least 1e-15, got 0.0"]),
        ("greedy", {"no_repeat_ngram_size": "-2"}, ["`no_repeat_ngram_size` must be a non-negative integer, got -2"]),
        ("greedy", {"no_repeat_ngram_size": "true"}, ["`no_repeat_ngram_size` must be an integer, got 'true'"]),
    ],
)
def test_bad_decoder_settings_raise_option_errors(engine, decoder, settings, needles):
    with pytest.raises(OptionError) as excinfo:
        engine.make_decoder(decoder, settings)
    message = str(excinfo.value)
    for needle in needles:
        assert needle in message
    assert "\n" not in message
    with pytest.raises(OptionError):
        engine.send(engine.conversation(), "hi", ReplyOptions(decoder=decoder, decoder_settings=settings))


@pytest.mark.parametrize(
    "settings, needle",
    [
        ({}, "needs words"),
        ({"words": "pizza", "strength": "500"}, "`strength` must be between -100 and 100, got 500"),
        ({"topic": "cars"}, "`topic` must be one of"),
        ({"file": "/nonexistent/words.txt"}, "`file`: no such word file"),
        ({"words": "pizza", "colour": "red"}, "unknown setting for steerer 'bow-bias': 'colour'"),
    ],
)
def test_bad_steerer_settings_raise_option_errors(engine, settings, needle):
    with pytest.raises(OptionError) as excinfo:
        engine.make_steerer("bow-bias", settings)
    assert needle in str(excinfo.value)


def test_integer_settings_refuse_fractional_numbers(engine):
    with pytest.raises(OptionError, match="`top_k` must be an integer, got 2.7"):
        engine.make_decoder("top-k", {"top_k": 2.7})


def test_integer_settings_accept_integral_values(engine):
    assert engine.make_decoder("top-k", {"top_k": 3}).settings.top_k == 3
    assert engine.make_decoder("top-k", {"top_k": " 4 "}).settings.top_k == 4
    with pytest.raises(OptionError, match="`top_k` must be an integer, got True"):
        engine.make_decoder("top-k", {"top_k": True})
    with pytest.raises(OptionError, match="`top_k` must be an integer, got '2.5'"):
        engine.make_decoder("top-k", {"top_k": "2.5"})


def test_settings_accept_strings_and_dashes(engine):
    decoder = engine.make_decoder("top-k", {"top-k": "12", "temperature": "0.5", "no-repeat-ngram-size": "2"})
    assert (decoder.settings.top_k, decoder.settings.temperature, decoder.settings.no_repeat_ngram_size) == (12, 0.5, 2)
    steerer = engine.make_steerer("bow-bias", {"words": "pizza, pasta ,", "strength": "3"})
    assert steerer.settings.words == ("pizza", "pasta") and steerer.settings.strength == 3.0


def test_a_plugin_constructor_crash_is_a_plugin_error(engine):
    @dataclass
    class CrashSettings:
        pass

    class CrashDecoder(Decoder):
        name = "crash"
        Settings = CrashSettings

        def __init__(self, settings=None):
            raise ZeroDivisionError("oops")

    class CrashPlugin:
        @chatcore.hookimpl
        def register_decoders(self, register):
            register(CrashDecoder)

    engine.host.register(CrashPlugin(), "crash-plugin")
    engine = Engine(engine.loaded, host=engine.host)
    with pytest.raises(PluginError) as excinfo:
        engine.make_decoder("crash")
    assert excinfo.value.plugin == "crash-plugin"
    assert "ZeroDivisionError: oops" in str(excinfo.value)
    assert ("crash-plugin", "decoder crash") in problems_of(engine.host)


# -- steerers that fail --------------------------------------------------------------------------


@dataclass
class NoSettings:
    pass


class ExplodingSteerer(Steerer):
    name = "exploding"
    Settings = NoSettings

    def wrap(self, step):
        def steered(state):
            output = step(state)
            if state.step >= 2:
                raise RuntimeError("steerer went off")
            return output

        return steered


class ExplodingPrepare(Steerer):
    name = "exploding-prepare"
    Settings = NoSettings

    def prepare(self, session):
        raise KeyError("missing")

    def wrap(self, step):
        return step


class ExplodingWrap(Steerer):
    name = "exploding-wrap"
    Settings = NoSettings

    def wrap(self, step):
        raise AttributeError("no such layer")


@dataclass
class ExplodingSettingsCheck:
    level: int = 1

    def __post_init__(self):
        raise LookupError("a table this check needs is missing")


class ExplodingSettings(Steerer):
    name = "exploding-settings"
    Settings = ExplodingSettingsCheck

    def wrap(self, step):  # pragma: no cover - never built
        return step


class ExplodingPlugin:
    @chatcore.hookimpl
    def register_steerers(self, register):
        register(ExplodingSteerer)
        register(ExplodingPrepare)
        register(ExplodingWrap)
        register(ExplodingSettings)


@pytest.fixture
def exploding_engine(loaded, host):
    host.register(ExplodingPlugin(), "exploding-plugin")
    return Engine(loaded, host=host)


def test_a_steerer_raising_in_its_step_is_a_plugin_error_and_the_engine_recovers(exploding_engine):
    engine = exploding_engine
    conversation = engine.conversation()
    response = engine.send(
        conversation,
        "hi",
        ReplyOptions(decoder="greedy", steerers=[("exploding", {})], min_new_tokens=10, max_new_tokens=10),
    )
    with pytest.raises(PluginError) as excinfo:
        response.text()
    assert "exploding-plugin" in excinfo.value.plugin
    assert "exploding-plugin" in str(excinfo.value)
    assert "steerer went off" in str(excinfo.value)
    assert any("exploding-plugin" in p.plugin and p.stage == "steerer exploding" for p in engine.host.problems)
    assert response.done and response.interrupted
    assert len(response.token_ids) == 2
    # Cut by an error (not by the reader), marked so in its provenance; its two tokens ("ar")
    # are not a whole word, so no reply is kept and the user's message waits for one.
    assert "steerer went off" in response.provenance["error"]
    assert response.text() == "" and [turn.role for turn in conversation.turns] == ["user"]

    # the same engine, and the same conversation, still reply
    after = engine.send(
        conversation, "still there?", ReplyOptions(decoder="greedy", min_new_tokens=5, max_new_tokens=5)
    )
    after.text()
    assert len(after.token_ids) == 5 and not after.interrupted
    fresh = engine.send(
        engine.conversation(), "hi", ReplyOptions(decoder="top-k", seed=1, min_new_tokens=5, max_new_tokens=5)
    )
    fresh.text()
    assert len(fresh.token_ids) == 5


def test_a_steerer_failure_is_blamed_on_the_steerer_plugin_alone(exploding_engine):
    response = exploding_engine.send(
        exploding_engine.conversation(),
        "hi",
        ReplyOptions(decoder="greedy", steerers=[("exploding", {})], min_new_tokens=10, max_new_tokens=10),
    )
    with pytest.raises(PluginError) as excinfo:
        response.text()
    assert excinfo.value.plugin == "exploding-plugin"
    assert [p.plugin for p in exploding_engine.host.problems] == ["exploding-plugin"]


def test_a_steerer_raising_in_prepare_is_a_plugin_error(exploding_engine):
    response = exploding_engine.send(
        exploding_engine.conversation(), "hi", ReplyOptions(decoder="greedy", steerers=[("exploding-prepare", {})])
    )
    with pytest.raises(PluginError) as excinfo:
        response.text()
    assert excinfo.value.plugin == "exploding-plugin"
    assert "prepare" in str(excinfo.value) and "KeyError" in str(excinfo.value)
    assert problems_of(exploding_engine.host) == [("exploding-plugin", "steerer exploding-prepare prepare")]


def test_a_steerer_raising_in_wrap_is_blamed_on_the_steerer(exploding_engine):
    response = exploding_engine.send(
        exploding_engine.conversation(), "hi", ReplyOptions(decoder="greedy", steerers=[("exploding-wrap", {})])
    )
    with pytest.raises(PluginError) as excinfo:
        response.text()
    assert excinfo.value.plugin == "exploding-plugin"
    assert "steerer 'exploding-wrap'" in str(excinfo.value) and "no such layer" in str(excinfo.value)
    assert problems_of(exploding_engine.host) == [("exploding-plugin", "steerer exploding-wrap")]


def test_settings_that_crash_are_one_plugin_error_before_any_model_loads(exploding_engine):
    from chatcore.engine import validate_options

    options = ReplyOptions(steerers=[("exploding-settings", {"level": "2"})])
    with pytest.raises(PluginError, match="steerer 'exploding-settings' failed to start: LookupError") as excinfo:
        validate_options(options, exploding_engine.registry)
    assert excinfo.value.plugin == "exploding-plugin"
    with pytest.raises(PluginError, match="LookupError"):
        exploding_engine.make_steerer("exploding-settings", {})


# -- entry points -------------------------------------------------------------------------------------


BUILTIN_ENTRY_POINTS = {"greedy", "top_k", "bow_bias"}


def make_distribution(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """A real (if minimal) installed distribution on a sys.path entry."""
    info = root / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    lines = "\n".join(f"{name} = {value}" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[chatcore]\n{lines}\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


THIRD_PARTY_SOURCE = """
    import chatcore
    from chatcore.plugins.greedy import GreedyDecoder

    class ThirdDecoder(GreedyDecoder):
        name = "third"

    @chatcore.hookimpl
    def register_decoders(register):
        register(ThirdDecoder)
"""


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    make_distribution(
        tmp_path,
        "chatcore-third",
        {"third": "chatcore_third_plugin", "broken": "chatcore_third_broken"},
        {
            "chatcore_third_plugin": THIRD_PARTY_SOURCE,
            "chatcore_third_broken": "raise SystemExit('a plugin must not exit the program')\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for module in ("chatcore_third_plugin", "chatcore_third_broken"):
        sys.modules.pop(module, None)


@pytest.fixture(autouse=True)
def _forget_test_modules():
    yield
    for module in [m for m in sys.modules if m.startswith("chatcore_test_")]:
        del sys.modules[module]


def test_builtin_entry_points_always_load():
    host = PluginHost()
    host.load_entry_points()
    infos = {info.name: info for info in host.plugins()}
    assert BUILTIN_ENTRY_POINTS <= set(infos)
    for name in BUILTIN_ENTRY_POINTS:
        assert infos[name].builtin and infos[name].distribution == "chatcore"
        assert infos[name].module == f"chatcore.plugins.{name}"
    assert infos["greedy"].hooks == ["register_decoders"]
    registry = Registry.build(host)
    assert {"greedy", "top-k"} <= set(registry.decoders) and "bow-bias" in registry.steerers
    assert registry.decoders["greedy"].plugin == "greedy"
    assert [p for p in host.problems if p.plugin in BUILTIN_ENTRY_POINTS] == []


def test_third_party_plugins_are_skipped_when_chatcore_plugins_is_empty(third_party):
    host = PluginHost()
    host.load_entry_points()
    names = {info.name for info in host.plugins()}
    assert BUILTIN_ENTRY_POINTS <= names
    assert not any(name.startswith("chatcore-third:") for name in names)
    assert not any(p.plugin.startswith("chatcore-third:") for p in host.problems)
    assert "third" not in Registry.build(host).decoders


@pytest.mark.parametrize("allowed", ["third", "chatcore-third", "chatcore-third:third", " other , third "])
def test_chatcore_plugins_selects_third_party_plugins(third_party, monkeypatch, allowed):
    monkeypatch.setenv("CHATCORE_PLUGINS", allowed)
    host = PluginHost()
    host.load_entry_points()
    infos = {info.name: info for info in host.plugins()}
    assert BUILTIN_ENTRY_POINTS <= set(infos)
    info = infos["chatcore-third:third"]
    assert (info.builtin, info.distribution, info.version, info.module) == (
        False,
        "chatcore-third",
        "1.2.3",
        "chatcore_third_plugin",
    )
    assert Registry.build(host).decoders["third"].plugin == "chatcore-third:third"
    third_problems = [p for p in problems_of(host) if p[0].startswith("chatcore-third:")]
    # naming the distribution selects all its entry points, the broken one included
    assert third_problems == ([("chatcore-third:broken", "import")] if allowed == "chatcore-third" else [])


def test_a_name_in_chatcore_plugins_that_no_plugin_has_is_reported(third_party, monkeypatch):
    monkeypatch.setenv("CHATCORE_PLUGINS", "thrid, third")  # a typo would otherwise leave a plugin out silently
    host = PluginHost()
    host.load_entry_points()
    assert "chatcore-third:third" in {info.name for info in host.plugins()}
    assert [(p.plugin, p.stage) for p in host.problems if p.stage == "lookup"] == [("thrid", "lookup")]
    assert "CHATCORE_PLUGINS names it" in str(next(p for p in host.problems if p.plugin == "thrid"))


def test_a_name_in_chatcore_plugins_that_no_plugin_has_is_not_said_on_every_command(third_party, monkeypatch, caplog):
    monkeypatch.setenv("CHATCORE_PLUGINS", "nonexistent")
    with caplog.at_level(logging.DEBUG, logger="chatcore.plugins"):
        PluginHost().load_entry_points()
    levels = [record.levelno for record in caplog.records if "nonexistent" in record.getMessage()]
    assert levels == [logging.DEBUG]  # `chatcore plugins` lists it, as every loading problem


def test_without_chatcore_plugins_every_plugin_loads_and_a_broken_one_is_reported(third_party, monkeypatch):
    monkeypatch.delenv("CHATCORE_PLUGINS")
    host = PluginHost()
    host.load_entry_points()  # SystemExit at import must not end the program
    assert "chatcore-third:third" in {info.name for info in host.plugins()}
    third = [p for p in host.problems if p.plugin.startswith("chatcore-third:")]
    assert [(p.plugin, p.stage) for p in third] == [("chatcore-third:broken", "import")]
    assert "SystemExit" in third[0].message


def test_only_chatcores_own_entry_points_count_as_builtin(tmp_path, monkeypatch):
    make_distribution(tmp_path, "sneaky-dist", {"sneaky": "chatcore.text"}, {})
    monkeypatch.syspath_prepend(str(tmp_path))
    host = PluginHost()
    host.load_entry_points()
    assert all(info.distribution == "chatcore" for info in host.plugins() if info.builtin)
    assert "sneaky" not in host.infos


def test_the_process_wide_host_loads_entry_points_once():
    host = get_plugin_host()
    assert get_plugin_host() is host
    assert BUILTIN_ENTRY_POINTS <= {info.name for info in host.plugins()}
    replacement = PluginHost()
    set_plugin_host(replacement)
    assert get_plugin_host() is replacement
    set_plugin_host(None)
    assert get_plugin_host() is not replacement


def test_a_broken_plugin_is_not_reported_by_every_command_only_where_it_matters(third_party):
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(third_party)}
    env.pop("CHATCORE_PLUGINS", None)

    def chatcore(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "chatcore.cli", *args], capture_output=True, text=True, env=env, timeout=120
        )

    quiet = chatcore("--help")
    assert quiet.returncode == 0 and "broken" not in quiet.stderr + quiet.stdout
    listed = chatcore("plugins")
    assert "chatcore-third:broken" in listed.stdout + listed.stderr
    assert "a plugin must not exit the program" in listed.stdout + listed.stderr


# -- settings conversion: paths, JSON objects, and types it cannot convert ------------------
@dataclass
class PathAndMapSettings:
    file: Path | None = None
    weights: dict | None = None


def test_path_and_dict_settings_are_converted_and_checked():
    from chatcore.options import parse_settings

    parsed = parse_settings(PathAndMapSettings, {"file": "~/lists/food.txt", "weights": '{"pizza": 2}'})
    assert parsed.file == Path("~/lists/food.txt").expanduser() and parsed.weights == {"pizza": 2}
    assert parse_settings(PathAndMapSettings, {"file": "none"}).file is None
    with pytest.raises(OptionError, match="`weights` must be a JSON object"):
        parse_settings(PathAndMapSettings, {"weights": "[1, 2]"})
    with pytest.raises(OptionError, match="`weights` must be a JSON object"):
        parse_settings(PathAndMapSettings, {"weights": "{not json"})
    with pytest.raises(OptionError, match="`file` must be a file path"):
        parse_settings(PathAndMapSettings, {"file": "a\x00b"})


class Moment:  # a plain class: no schema, no way to read it from text
    pass


def test_a_setting_of_a_type_chatcore_cannot_convert_is_refused_at_registration(host):
    @dataclass
    class OddSettings:
        when: Moment | None = None

    class Odd(Steerer):
        name = "odd"
        Settings = OddSettings

        def wrap(self, step):
            return step

    class OddPlugin:
        @chatcore.hookimpl
        def register_steerers(self, register):
            register(Odd)

    host.register(OddPlugin(), "odd-plugin")
    registry = Registry.build(host)
    assert "odd" not in registry.steerers
    assert problems_of(host) == [("odd-plugin", "hook register_steerers")]
    assert "setting `when` of OddSettings: chatcore cannot convert" in host.problems[0].message


def test_a_hook_wrapper_is_refused_loudly_not_skipped(host):
    class Wrapping:
        @chatcore.hookimpl(wrapper=True)
        def on_response(self, conversation, response):
            return (yield)

    assert not host.register(Wrapping(), "wrapping")
    assert problems_of(host) == [("wrapping", "register")]
    assert "hook wrappers are not supported on chatcore hooks: on_response" in host.problems[0].message
    assert host.pm.get_plugin("wrapping") is None


def test_an_option_error_a_plugin_raises_names_its_decoder_or_steerer(host):
    from chatcore.engine import build_plugin_object
    from chatcore.errors import OptionError

    registry = Registry.build(host)

    def refusing(message: str):
        def build():
            raise OptionError(message)

        return build

    with pytest.raises(OptionError, match=r"^steerer 'banwords': no tokens for these words$"):
        build_plugin_object(host, registry, "steerer", "banwords", refusing("no tokens for these words"))
    with pytest.raises(OptionError, match=r"^banwords: already named$"):  # named by the plugin: left as it is
        build_plugin_object(host, registry, "steerer", "banwords", refusing("banwords: already named"))
