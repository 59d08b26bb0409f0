"""The example plugin package in examples/chatcore-steering-vectors: its own tests pass,
its pyproject declares the entry point chatcore loads, and, once installed, chatcore
discovers it through that entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from click.testing import CliRunner

import chatcore.plugin_manager as plugin_manager
from chatcore.registry import Registry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "chatcore-steering-vectors"
DISTRIBUTION = "chatcore-steering-vectors"
MODULE = "chatcore_steering_vectors"


def declared_entry_points() -> dict[str, str]:
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["name"] == DISTRIBUTION
    return project["entry-points"]["chatcore"]


def test_the_pyproject_declares_the_chatcore_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    entry_points = declared_entry_points()
    assert entry_points == {"steering_vectors": MODULE}
    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    host = plugin_manager.PluginHost()
    host.load_modules(tuple(entry_points.values()))
    assert host.problems == []
    assert Registry.build(host).steerers["activation-addition"].plugin == MODULE


@pytest.mark.slow
def test_the_example_packages_own_tests_pass(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLE / "src"), env.get("PYTHONPATH")]))
    # The test models are tiny: more threads only contend on a shared machine.
    env.setdefault("OMP_NUM_THREADS", "1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "run"), "tests"],
        cwd=EXAMPLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


def installed_entry_point() -> metadata.EntryPoint | None:
    for entry_point in metadata.entry_points(group="chatcore"):
        if entry_point.value == MODULE:
            return entry_point
    return None


def test_the_installed_example_is_found_through_its_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    entry_point = installed_entry_point()
    if entry_point is None:
        pytest.skip(
            f"{DISTRIBUTION} is not installed here; CI installs it with "
            f"`pip install -e examples/{DISTRIBUTION}` and then this test runs"
        )
    assert entry_point.dist is not None and entry_point.dist.name == DISTRIBUTION
    monkeypatch.setenv("CHATCORE_PLUGINS", DISTRIBUTION)  # the suite otherwise loads only the built-ins
    host = plugin_manager.PluginHost()
    host.load_entry_points()
    name = f"{DISTRIBUTION}:{entry_point.name}"
    assert [p for p in host.problems if p.plugin == name] == []
    assert Registry.build(host).steerers["activation-addition"].plugin == name
    plugin_manager.set_plugin_host(host)
    from chatcore.cli import build_cli

    result = CliRunner().invoke(build_cli(), ["plugins"])
    assert result.exit_code == 0, result.output
    assert f"{name}  ({DISTRIBUTION} " in result.output
    assert "steerers: activation-addition" in result.output
