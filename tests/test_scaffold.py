"""`chatcore new-plugin NAME`: the skeleton package, its names, and what it refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from click.testing import CliRunner

import chatcore
import chatcore.plugin_manager as plugin_manager
from chatcore.cli import build_cli
from chatcore.errors import ChatcoreError, OptionError
from chatcore.scaffold import Kind, PluginNames, render, write_plugin
from chatcore.testing import plugin_host


@pytest.fixture
def new_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Runs `chatcore new-plugin ARGS...` in tmp_path with the scaffold command registered."""
    host = plugin_manager.PluginHost()
    host.load_modules(("chatcore.scaffold_command",))
    assert host.problems == []
    plugin_manager.set_plugin_host(host)
    monkeypatch.chdir(tmp_path)

    def run(*args: str):
        return CliRunner().invoke(build_cli(), ["new-plugin", *args]), tmp_path

    return run


def test_names_follow_from_the_plugin_name() -> None:
    names = PluginNames.from_name("shout-louder")
    assert names == PluginNames(
        name="shout-louder",
        distribution="chatcore-shout-louder",
        package="chatcore_shout_louder",
        entry_point="shout_louder",
        class_name="ShoutLouder",
    )


@pytest.mark.parametrize("name", ["", "Shout", "shout_louder", "-shout", "shout-", "a--b", "1up", "shout louder"])
def test_bad_names_are_refused_with_the_rule(name: str) -> None:
    with pytest.raises(OptionError, match="lower-case letters and digits"):
        PluginNames.from_name(name)


def test_a_name_given_with_the_package_prefix_is_refused_with_the_name_to_give() -> None:
    with pytest.raises(OptionError, match="give `NAME` without 'chatcore-' \\('shout'\\)"):
        PluginNames.from_name("chatcore-shout")


def test_the_command_writes_the_package(new_plugin) -> None:
    result, folder = new_plugin("shout")
    assert result.exit_code == 0, result.output
    package = folder / "chatcore-shout"
    written = sorted(str(p.relative_to(package)) for p in package.rglob("*") if p.is_file())
    assert written == sorted(render(PluginNames.from_name("shout")))
    assert f"created {Path('chatcore-shout')}/" in result.output and "pip install -e ." in result.output
    project = tomllib.loads((package / "pyproject.toml").read_text())
    assert project["project"]["name"] == "chatcore-shout"
    assert project["project"]["entry-points"]["chatcore"] == {"shout": "chatcore_shout"}
    assert "chatcore" in project["project"]["dependencies"]


def test_an_existing_folder_is_never_overwritten(new_plugin) -> None:
    result, folder = new_plugin("shout")
    assert result.exit_code == 0
    module = folder / "chatcore-shout" / "src" / "chatcore_shout" / "__init__.py"
    module.write_text("# my work\n")
    with pytest.raises(ChatcoreError, match="already exists"):
        write_plugin("shout", folder)
    assert module.read_text() == "# my work\n"


def test_the_command_reports_an_existing_folder_in_one_line(new_plugin) -> None:
    new_plugin("shout")
    result, _ = new_plugin("shout")
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    assert "chatcore-shout already exists; remove it or choose another name" in result.output


def test_the_command_refuses_a_missing_parent_folder(new_plugin, tmp_path: Path) -> None:
    result, _ = new_plugin("shout", "--dir", "nowhere")
    assert result.exit_code != 0 and "no such folder" in result.output
    assert not (tmp_path / "nowhere").exists()


def test_the_generated_plugin_registers_and_validates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from chatcore.registry import Registry

    package = write_plugin("brevity-test", tmp_path)
    monkeypatch.syspath_prepend(str(package / "src"))
    try:
        registry = Registry.build(plugin_host("chatcore_brevity_test"))
        steerer_class = registry.steerer("brevity-test")
        assert registry.steerers["brevity-test"].plugin == "chatcore_brevity_test"
        assert steerer_class.from_options({"strength": "-3"}).settings.strength == -3.0
        with pytest.raises(OptionError, match="`strength` must be between -100 and 100, got 500.0"):
            steerer_class.from_options({"strength": "500"})
    finally:
        sys.modules.pop("chatcore_brevity_test", None)


def test_the_generated_steerer_edits_only_the_end_of_turn_score(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine
) -> None:
    import torch

    from chatcore.decoding import GenerationSession
    from chatcore.registry import Registry
    from chatcore.step import StepOutput, StepState

    package = write_plugin("brevity-test", tmp_path)
    monkeypatch.syspath_prepend(str(package / "src"))
    try:
        engine.host.load_modules(("chatcore_brevity_test",))
        steerer = Registry.build(engine.host).steerer("brevity-test").from_options({"strength": "5"})
        session = GenerationSession(
            model=engine.loaded,
            prompt_ids=[1, 2],
            steerers=[steerer],
            max_new_tokens=2,
            generator=torch.Generator().manual_seed(0),
            seed=0,
        )
        steerer.prepare(session)
        ids = torch.tensor([[1, 2], [3, 4]])
        state = StepState(
            input_ids=ids,
            sequences=ids,
            attention_mask=torch.ones_like(ids),
            position_ids=torch.tensor([[0, 1], [0, 1]]),
            cache=None,
            step=0,
            prompt_length=2,
        )
        scores = torch.randn(2, engine.loaded.model.config.vocab_size)  # (B, V)
        change = steerer.wrap(lambda state: StepOutput(logits=scores, cache=None))(state).logits - scores
        eos = engine.eos_token_id
        assert torch.allclose(change[:, eos], torch.full((2,), 5.0))
        change[:, eos] = 0
        assert torch.count_nonzero(change) == 0
    finally:
        sys.modules.pop("chatcore_brevity_test", None)


def test_the_decoder_command_writes_a_decoder_package(new_plugin) -> None:
    result, folder = new_plugin("tally", "--decoder")
    assert result.exit_code == 0, result.output
    module = (folder / "chatcore-tally" / "src" / "chatcore_tally" / "__init__.py").read_text()
    assert "class Tally(TokenDecoder):" in module and "def register_decoders(" in module
    assert "from chatcore.api import" in module and "from chatcore." not in module.replace("from chatcore.api", "")


def test_the_generated_decoder_replies_on_the_tiny_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine
) -> None:
    from chatcore.engine import ReplyOptions
    from chatcore.testing import make_engine

    package = write_plugin("tally-test", tmp_path, "decoder")
    monkeypatch.syspath_prepend(str(package / "src"))
    try:
        with_decoder = make_engine(engine.loaded, "chatcore_tally_test")
        assert with_decoder.registry.decoders["tally-test"].plugin == "chatcore_tally_test"
        with pytest.raises(OptionError, match="`temperature` must be between 0.01 and 100, got 0.0"):
            with_decoder.make_decoder("tally-test", {"temperature": "0"})
        options = ReplyOptions(decoder="tally-test", seed=3, max_new_tokens=6)
        replies = [with_decoder.reply_to(["hi, how are you?"], options) for _ in range(2)]
        texts = [reply.text() for reply in replies]
        assert texts[0] == texts[1] and replies[0].provenance["decoder"]["name"] == "tally-test"
        assert replies[0].provenance["timings"]["new_tokens"] >= 1
    finally:
        sys.modules.pop("chatcore_tally_test", None)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["steerer", "decoder"])
def test_the_generated_tests_pass_with_chatcores_fixtures(tmp_path: Path, kind: Kind) -> None:
    package = write_plugin("brevity-test", tmp_path, kind)
    env = dict(os.environ)
    # Stands in for `pip install -e .`: the package imports from its folder.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package / "src"), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")  # a tiny model: more threads only contend
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t")],
        cwd=package,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "3 passed" in result.stdout


def test_a_name_an_installed_package_uses_is_refused_in_one_line(new_plugin) -> None:
    # The tutorial's example package is installed with chatcore's own development set-up.
    result, folder = new_plugin("steering-vectors")
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "a package named chatcore-steering-vectors is installed already" in result.output
    assert "chatcore new-plugin my-steering-vectors" in result.output
    assert not (folder / "chatcore-steering-vectors").exists()


def test_a_built_in_plugins_name_is_refused_as_built_in(new_plugin) -> None:
    result, folder = new_plugin("greedy")
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "'greedy' is a built-in plugin of chatcore: choose another name (chatcore new-plugin my-greedy)" in (
        result.output
    )
    assert "uninstall" not in result.output and not (folder / "chatcore-greedy").exists()


def test_a_decoder_name_a_loaded_plugin_registers_is_refused_in_one_line(new_plugin) -> None:
    from chatcore.plugins.greedy import GreedyDecoder

    class TakenDecoder(GreedyDecoder):
        name = "taken-name"

    class Plugin:
        @chatcore.hookimpl
        def register_decoders(self, register):
            register(TakenDecoder)

    plugin_manager.get_plugin_host().register(Plugin(), "taker")
    result, folder = new_plugin("taken-name", "--decoder")
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert [line for line in result.output.splitlines() if line.strip()] == [
        "Error: the decoder name 'taken-name' is registered by the plugin taker: "
        "choose another name (chatcore new-plugin my-taken-name), or uninstall it first"
    ]
    assert not (folder / "chatcore-taken-name").exists()


def test_the_skeleton_registers_the_slow_marker_and_ships_its_data_files() -> None:
    project = tomllib.loads(render(PluginNames.from_name("shout"))["pyproject.toml"])
    assert any(marker.startswith("slow:") for marker in project["tool"]["pytest"]["ini_options"]["markers"])
    assert "*.txt" in project["tool"]["setuptools"]["package-data"]["*"]


@pytest.mark.slow
def test_a_wheel_built_from_the_skeleton_holds_the_plugins_data_files(tmp_path: Path) -> None:
    import zipfile

    package = write_plugin("wordy-test", tmp_path)
    data = package / "src" / "chatcore_wordy_test"
    (data / "words.txt").write_text("pizza\npasta\n")
    (data / "data").mkdir()
    (data / "data" / "vector.json").write_text("[0.5, 1.5]")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(package)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "chatcore_wordy_test/words.txt" in names and "chatcore_wordy_test/data/vector.json" in names
