"""docs/writing-plugins.md cannot drift from the code.

- Every file the tutorial shows (a code block after ``<!-- file: PATH -->``) is the
  example package's file: each piece appears in it verbatim, and the pieces together
  are the whole file (blank lines between pieces aside).
- `chatcore new-plugin steering-vectors`, the tutorial's first command, gives the
  example package its names, its entry point and its conftest.py.
- Every `chatcore ...` command shown parses, and every steerer spec in it (and in the
  REPL and Discord examples) is valid for the registry with the example plugin loaded.
- Slow: following the tutorial literally in a temporary folder (new-plugin, then the
  files as shown) gives a package whose tests pass; the Python example and the
  `chatcore generate` example run.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import tomllib
from click.testing import CliRunner

import chatcore.plugin_manager as plugin_manager
from chatcore import hookspecs
from chatcore.cli import build_cli
from chatcore.cli.specs import parse_spec
from chatcore.registry import Registry
from chatcore.scaffold import PluginNames, render

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "writing-plugins.md"
EXAMPLE = ROOT / "examples" / "chatcore-steering-vectors"
PLUGIN_NAME = "chatcore-steering-vectors:steering_vectors"
FILE_MARKER = re.compile(r"<!-- file: (\S+) -->")
SHELL_STEPS = ("cd ", "pip install -e .", "pytest")  # the only non-chatcore commands the tutorial may show


@dataclass
class Block:
    language: str
    text: str
    file: str | None  # the package file this block is a piece of


def blocks() -> list[Block]:
    found, file, lines = [], None, TUTORIAL.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        marker = FILE_MARKER.fullmatch(line.strip())
        if marker:
            file = marker.group(1)
        elif line.startswith("```"):
            end = lines.index("```", index + 1)
            found.append(Block(line[3:].strip(), "\n".join(lines[index + 1 : end]), file))
            file, index = None, end
        elif line.strip():
            file = None  # a marker applies to the block right after it
        index += 1
    return found


def pieces_by_file() -> dict[str, list[str]]:
    files: dict[str, list[str]] = {}
    for block in blocks():
        if block.file:
            files.setdefault(block.file, []).append(block.text)
    return files


def non_blank(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def shell_lines() -> list[str]:
    return [
        line.strip()
        for block in blocks()
        if block.language == "sh"
        for line in block.text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def steer_specs_in_prose() -> list[str]:
    text = TUTORIAL.read_text(encoding="utf-8")
    repl = [
        line.split("/steer ", 1)[1]
        for block in blocks()
        if block.language == "text"
        for line in block.text.splitlines()
        if "/steer " in line
    ]
    discord = re.findall(r"`/chat steer ([^`]+)`", text)
    return [spec for spec in repl + discord if spec.strip() != "off"]


@pytest.fixture
def example_host(monkeypatch: pytest.MonkeyPatch) -> plugin_manager.PluginHost:
    """The built-ins (from chatcore's entry points), the scaffold command and the
    example plugin, as `chatcore` would load them once the example is installed."""
    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    host = plugin_manager.PluginHost()
    host.load_entry_points()
    if host.pm.get_plugin("scaffold_command") is None:
        host.load_modules(("chatcore.scaffold_command",))
    import chatcore_steering_vectors

    assert host.register(chatcore_steering_vectors, PLUGIN_NAME)
    plugin_manager.set_plugin_host(host)
    return host


def test_the_tutorial_has_file_pieces_and_commands() -> None:
    assert len(pieces_by_file()) >= 6
    assert any(line.startswith("chatcore eval ") for line in shell_lines())


@pytest.mark.parametrize("path", sorted(pieces_by_file()))
def test_each_file_shown_is_the_example_file_pieced_together(path: str) -> None:
    actual = (EXAMPLE / path).read_text(encoding="utf-8")
    pieces = pieces_by_file()[path]
    for piece in pieces:
        assert piece in actual, f"a piece shown for {path} is not in {EXAMPLE / path}:\n{piece[:400]}"
    assert non_blank("\n".join(pieces)) == non_blank(actual), f"the pieces shown for {path} are not the whole file"


def test_every_source_file_of_the_example_is_shown() -> None:
    sources = {str(p.relative_to(EXAMPLE)) for p in (EXAMPLE / "src").rglob("*.py")}
    shown = set(pieces_by_file())
    assert sources <= shown, f"not shown in the tutorial: {sorted(sources - shown)}"
    assert {"pyproject.toml", "tests/conftest.py", "tests/test_steering_vectors.py"} <= shown


def test_the_hook_signature_shown_is_the_hookspecs() -> None:
    function = hookspecs.register_steerers
    parameters = ", ".join(f"{p.name}: {p.annotation}" for p in inspect.signature(function).parameters.values())
    signature = f"def register_steerers({parameters}) -> None"
    assert any(block.text == signature for block in blocks() if block.language == "python")


def test_new_plugin_gives_the_example_its_names_entry_point_and_conftest() -> None:
    assert "chatcore new-plugin steering-vectors" in shell_lines()
    skeleton = render(PluginNames.from_name("steering-vectors"))
    example = tomllib.loads((EXAMPLE / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    generated = tomllib.loads(skeleton["pyproject.toml"])["project"]
    assert generated["name"] == example["name"]
    assert generated["entry-points"] == example["entry-points"]
    assert skeleton["tests/conftest.py"] == (EXAMPLE / "tests" / "conftest.py").read_text(encoding="utf-8")
    assert set(skeleton) - {"README.md"} <= {str(p.relative_to(EXAMPLE)) for p in EXAMPLE.rglob("*") if p.is_file()}


def test_the_skeleton_listing_shown_is_what_new_plugin_writes() -> None:
    listing = next(block.text for block in blocks() if block.text.startswith("chatcore-steering-vectors/\n"))
    shown = [line.split()[0] for line in listing.splitlines()[1:]]
    assert sorted(shown) == sorted(render(PluginNames.from_name("steering-vectors")))


def test_only_known_shell_steps_are_shown() -> None:
    others = [line for line in shell_lines() if not line.startswith("chatcore ") and not line.startswith(SHELL_STEPS)]
    assert others == []


def test_every_chatcore_command_shown_parses_with_valid_specs(example_host) -> None:
    cli = build_cli()
    registry = Registry.build(example_host)
    commands = [shlex.split(line)[1:] for line in shell_lines() if line.startswith("chatcore ")]
    assert {"new-plugin", "plugins", "generate", "chat", "eval"} <= {args[0] for args in commands}
    for name, *args in commands:
        command = cli.commands.get(name)
        assert isinstance(command, click.Command), f"no `chatcore {name}` command"
        context = command.make_context(name, list(args))  # raises on an unknown option or a bad value
        for spec in context.params.get("steer_specs", ()):
            steerer, settings = parse_spec(spec)
            registry.steerer(steerer).from_options(settings)
        if context.params.get("decoder_spec"):
            decoder, settings = parse_spec(context.params["decoder_spec"])
            registry.decoder(decoder).from_options(settings)
    specs = steer_specs_in_prose()
    assert len(specs) >= 2
    for spec in specs:
        steerer, settings = parse_spec(spec)
        registry.steerer(steerer).from_options(settings)


def test_the_plugins_listing_shown_is_what_chatcore_plugins_prints(example_host) -> None:
    result = CliRunner().invoke(build_cli(), ["plugins"])
    assert result.exit_code == 0, result.output
    printed = result.output.splitlines()
    start = printed.index(next(line for line in printed if line.startswith(f"{PLUGIN_NAME}  (")))
    shown = next(block.text.splitlines() for block in blocks() if block.text.startswith(f"{PLUGIN_NAME}  ("))
    assert printed[start + 1 : start + 3] == shown[1:]


@pytest.mark.slow
def test_the_python_example_and_the_generate_command_run(example_host) -> None:
    examples = [
        block.text
        for block in blocks()
        if block.language == "python" and not block.file and not block.text.startswith("def ")
    ]
    assert examples
    for code in examples:
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            exec(compile(code, str(TUTORIAL), "exec"), {})
        assert "'layer': 3" in output.getvalue()
    generate = next(line for line in shell_lines() if line.startswith("chatcore generate "))
    result = CliRunner().invoke(build_cli(), shlex.split(generate)[1:])
    assert result.exit_code == 0, result.output
    assert result.output.strip()


@pytest.mark.slow
def test_following_the_tutorial_literally_gives_a_plugin_whose_tests_pass(
    example_host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # A newcomer's environment does not have the finished example installed, as this one has.
    monkeypatch.setattr("chatcore.scaffold.installed_as", lambda names: None)
    first = next(line for line in shell_lines() if line.startswith("chatcore new-plugin "))
    result = CliRunner().invoke(build_cli(), shlex.split(first)[1:])
    assert result.exit_code == 0, result.output
    package = tmp_path / "chatcore-steering-vectors"
    for path, pieces in pieces_by_file().items():
        (package / path).write_text("\n\n".join(pieces) + "\n", encoding="utf-8")
    env = dict(os.environ)
    # Stands in for `pip install -e .`: the package imports from its folder, and its
    # tests register it through the chatcore_plugins fixture, not the entry point.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package / "src"), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    # The bundled-model test is the example's own, run by tests/test_example_plugin.py.
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "--basetemp", str(tmp_path / "t")],
        cwd=package,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert re.search(r"\b[1-9]\d* passed", run.stdout) and "failed" not in run.stdout
