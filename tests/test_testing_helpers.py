"""chatcore.testing (helpers for plugin authors) and the pytest plugin that wraps them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

import chatcore
from chatcore.errors import ChatcoreError, PluginError
from chatcore.evaluation.runner import EvalRow
from chatcore.steering import Steerer
from chatcore.testing import (
    build_conversation,
    build_tiny_model,
    compare_to_baseline,
    make_engine,
    mean_row,
    plugin_host,
)


class Misspelled:
    @chatcore.hookimpl
    def register_steerer(self, register):  # no such hook: the plugin must be refused
        pass


@dataclass
class NoSettings:
    pass


class Exploding(Steerer):
    name = "exploding-test"
    Settings = NoSettings

    def wrap(self, step):
        def exploded(state):
            raise RuntimeError("boom")

        return exploded


class ExplodingPlugin:
    @chatcore.hookimpl
    def register_steerers(self, register):
        register(Exploding)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """build_tiny_model's model: random weights, the bundled model's 8,192-token tokenizer."""
    from chatcore.models import load_model

    return load_model(str(build_tiny_model(tmp_path_factory.mktemp("tiny"))), device="cpu")


@pytest.fixture
def bow_engine(tiny):
    return make_engine(tiny, "chatcore.plugins.bow_bias")


def test_build_tiny_model_is_small_and_uses_the_bundled_tokenizer(tiny) -> None:
    from transformers import AutoTokenizer

    from chatcore.models import resolve_model_path

    assert tiny.model.config.n_layer == 2 and tiny.model.num_parameters() < 400_000
    assert tiny.max_positions == 128
    assert tiny.tokenizer.get_vocab() == AutoTokenizer.from_pretrained(resolve_model_path("chatcore-tiny")).get_vocab()


def test_plugin_host_holds_the_base_decoders_and_the_plugins_given_only() -> None:
    host = plugin_host("chatcore.plugins.bow_bias")
    registered = sorted(name for name, _ in host.pm.list_name_plugin())
    assert registered == ["chatcore.plugins.bow_bias", "chatcore.plugins.greedy", "chatcore.plugins.top_k"]


@pytest.mark.parametrize(
    "plugin, message",
    [
        ("no_such_module_here", "no_such_module_here"),
        (Misspelled(), "unknown hook 'register_steerer'"),
    ],
)
def test_plugin_host_refuses_a_broken_plugin_loudly(plugin, message) -> None:
    with pytest.raises(PluginError, match=message):
        plugin_host(plugin)


class RaisingRegistration:
    @chatcore.hookimpl
    def register_steerers(self, register):
        raise RuntimeError("cannot build my steerer")


class NotASteerer:
    @chatcore.hookimpl
    def register_steerers(self, register):
        register(dict)


@pytest.mark.parametrize(
    "plugin, message",
    [
        (RaisingRegistration(), "'RaisingRegistration': failed at hook register_steerers: RuntimeError: cannot build"),
        (
            NotASteerer(),
            "'NotASteerer': failed at hook register_steerers: TypeError: register_steerers: expected a "
            "Steerer subclass",
        ),
    ],
)
def test_the_engine_factory_fails_on_a_plugin_that_does_not_register_cleanly(tiny, plugin, message) -> None:
    with pytest.raises(PluginError, match=message):
        make_engine(tiny, plugin)


def test_make_engine_registers_nothing_installed(bow_engine) -> None:
    assert sorted(bow_engine.registry.decoders) == ["greedy", "top-k"]
    assert sorted(bow_engine.registry.steerers) == ["bow-bias"]


def test_build_conversation_ends_with_the_users_turn(bow_engine) -> None:
    conversation = build_conversation(bow_engine, "hi", "hello!", "how are you?")
    turns = [(t.role, t.text) for t in conversation.turns]
    assert turns == [("user", "hi"), ("bot", "hello!"), ("user", "how are you?")]
    assert [t.role for t in build_conversation(bow_engine, "hello!", "hi").turns] == ["bot", "user"]


def test_mean_row_averages_every_metric_and_sums_counts() -> None:
    rows = [
        EvalRow("a", 2, 10.0, 0.2, 0.4, 0.6, 5.0, 0.0, 0.5, 100.0),
        EvalRow("b", 2, 20.0, 0.4, 0.6, 0.8, 7.0, 0.5, None, None),
    ]
    row = mean_row("both", rows)
    assert (row.label, row.count, row.perplexity, row.mean_length, row.degenerate_share) == ("both", 4, 15.0, 6.0, 0.25)
    assert row.distinct_2 == pytest.approx(0.5) and row.attribute_share == 0.5 and row.tokens_per_s == 100.0


def test_compare_to_baseline_measures_a_steerer_against_no_steering(bow_engine) -> None:
    contexts = ["hi, how are you?", ["hello", "hey! what's up?", "what should we eat?"]]
    comparison = compare_to_baseline(
        bow_engine,
        "bow-bias",
        {"words": "pizza", "strength": "50"},
        contexts=contexts,
        seeds=[0, 7],
        vocabulary={"pizza"},
        decoder="greedy",
        max_new_tokens=6,
    )
    assert comparison.baseline.count == comparison.steered.count == 4
    assert [r.settings["seed"] for r in comparison.reports["steered"]] == [0, 7]
    assert comparison.reports["baseline"][0].settings["steerers"] == []
    assert comparison.steered.attribute_share > comparison.baseline.attribute_share
    assert comparison.attribute_gain == comparison.steered.attribute_share - comparison.baseline.attribute_share
    assert comparison.perplexity_ratio == comparison.steered.perplexity / comparison.baseline.perplexity


def test_compare_to_baseline_takes_a_builtin_word_list_by_name(bow_engine) -> None:
    comparison = compare_to_baseline(
        bow_engine,
        "bow-bias",
        {"topic": "food", "strength": "50"},
        contexts=["hi"],
        vocabulary="food",
        decoder="greedy",
        max_new_tokens=4,
    )
    assert comparison.steered.attribute_share is not None


def test_compare_to_baseline_does_not_hide_a_failing_steerer(tiny) -> None:
    engine = make_engine(tiny, ExplodingPlugin())
    with pytest.raises(ChatcoreError, match="the steered run failed: .*boom"):
        compare_to_baseline(engine, "exploding-test", contexts=["hi"], max_new_tokens=3)


def test_compare_to_baseline_refuses_bad_settings_before_generating(bow_engine) -> None:
    with pytest.raises(ChatcoreError, match="strength"):
        compare_to_baseline(bow_engine, "bow-bias", {"words": "pizza", "strength": "1000"})


# -- the pytest plugin ---------------------------------------------------------------------------

PLUGIN_TEST = textwrap.dedent("""
    import pytest


    @pytest.fixture
    def chatcore_plugins():
        return ("chatcore.plugins.bow_bias",)


    def test_fixtures_are_there(chatcore_plugins, chatcore_engine_factory, chatcore_conversation):
        assert chatcore_plugins == ("chatcore.plugins.bow_bias",)
        assert callable(chatcore_engine_factory) and callable(chatcore_conversation)
""")


def run_pytest(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_pytest_plugin_loads_on_request_only(tmp_path: Path) -> None:
    (tmp_path / "test_plugin_fixtures.py").write_text(PLUGIN_TEST)
    asked = run_pytest(tmp_path, "-p", "chatcore.pytest_plugin")
    assert asked.returncode == 0, asked.stdout[-3000:] + asked.stderr[-2000:]
    not_asked = run_pytest(tmp_path)
    assert not_asked.returncode != 0 and "fixture 'chatcore_engine_factory' not found" in not_asked.stdout


def test_the_pytest_plugin_does_not_import_torch() -> None:
    code = "import sys, chatcore.pytest_plugin; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


ENTRY_POINT = "chatcore.pytest_plugin"


def test_the_pytest11_entry_point_and_a_conftest_that_asks_by_name_do_not_clash(tmp_path: Path) -> None:
    # What `pip install` writes for chatcore's pytest11 entry point, in a folder of its own.
    declared = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    entry_points = declared["project"].get("entry-points", {}).get("pytest11", {ENTRY_POINT: ENTRY_POINT})
    assert entry_points == {ENTRY_POINT: ENTRY_POINT}, "name the entry point after its module, or the two clash"
    site = tmp_path / "site" / "chatcore_pytest_entry-0.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: chatcore-pytest-entry\nVersion: 0\n")
    (site / "entry_points.txt").write_text(f"[pytest11]\n{ENTRY_POINT} = {ENTRY_POINT}\n")
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text(f"pytest_plugins = [{ENTRY_POINT!r}]\n")
    (project / "test_plugin_fixtures.py").write_text(PLUGIN_TEST)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path / "site"), env.get("PYTHONPATH")]))
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    for extra in ((), ("-p", ENTRY_POINT)):
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
