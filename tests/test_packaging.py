"""The editable install and a built wheel both import every built-in plugin, and the
wheel installs no bare top-level `plugins` or `adapters` package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def builtin_modules() -> list[str]:
    modules = [ep.value for ep in metadata.entry_points(group="chatcore") if ep.value.startswith("chatcore.")]
    assert modules, "no built-in entry points: is chatcore installed?"
    return modules


IMPORT_ALL = (
    "import importlib, json, sys; mods = json.loads(sys.argv[1]); "
    "[importlib.import_module(m) for m in mods]; "
    "import chatcore, chatcore.plugins, chatcore.adapters; print(chatcore.__file__)"
)


def test_editable_install_imports_every_builtin(tmp_path: Path) -> None:
    import json

    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, json.dumps(builtin_modules())], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve().is_relative_to(ROOT)


@pytest.mark.slow
def test_wheel_imports_every_builtin_and_has_no_bare_packages(tmp_path: Path) -> None:
    import json

    build = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("chatcore-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/", 1)[0] for name in names}
    assert "plugins" not in top_level and "adapters" not in top_level, top_level
    assert "chatcore/plugins/greedy.py" in names
    # Every source file of the three folders is in the wheel (a subpackage missing from
    # pyproject's package list would silently vanish from installs).
    for folder, prefix in (
        ("chatcore", "chatcore/"),
        ("plugins", "chatcore/plugins/"),
        ("adapters", "chatcore/adapters/"),
    ):
        for source in (ROOT / folder).rglob("*.py"):
            relative = source.relative_to(ROOT / folder).as_posix()
            if folder == "chatcore" and relative.split("/", 1)[0] in ("plugins", "adapters"):
                continue
            assert prefix + relative in names, f"{prefix + relative} is missing from the wheel"
    for data in (
        "chatcore/training/blocklist.txt",
        "chatcore/evaluation/openers.txt",
        "chatcore/bundled/chatcore-tiny/config.json",
        "chatcore/bundled/wordlists/food.txt",
        "chatcore/bundled/cocon-chatcore-tiny/cocon_block.safetensors",
        "chatcore/plugins/pplm/heads/sentiment.safetensors",
        "chatcore/plugins/vector/pairs/food.txt",
    ):
        assert data in names, f"{data} is missing from the wheel"
    assert any(name.startswith("chatcore/bundled/") for name in names)
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    # Import from the unpacked wheel only: put it first and drop the editable finder.
    code = (
        "import sys; sys.path.insert(0, sys.argv[2]); "
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__.lower() "
        "and 'editable' not in getattr(f, '__name__', '').lower()]; " + IMPORT_ALL.replace("sys.argv[1]", "sys.argv[1]")
    )
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(builtin_modules()), str(target)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve().is_relative_to(target.resolve())
