"""docs/writing-plugins.md cannot drift from the code.

- The tutorial links the example package's files (every link resolves, every source
  file is linked) and reprints none of them.
- `chatcore new-plugin steering-vectors`, the tutorial's first command, gives the
  example package its names, its entry point and its conftest.py.
- Every `chatcore ...` command shown parses, and every steerer or decoder spec in it
  (and in the REPL and Discord examples) is valid for the registry with the example
  plugin loaded.
- Slow: the Python example and the `chatcore generate` example run.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
import shlex
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


def test_the_tutorial_links_every_example_file_and_reprints_none() -> None:
    text = TUTORIAL.read_text(encoding="utf-8")
    linked = set(re.findall(r"\(\.\./examples/chatcore-steering-vectors/([^)#]+)\)", text))
    assert all((EXAMPLE / path).is_file() for path in linked), sorted(p for p in linked if not (EXAMPLE / p).is_file())
    sources = {str(p.relative_to(EXAMPLE)) for p in EXAMPLE.rglob("*.py")} | {"pyproject.toml"}
    assert sources <= linked, f"not linked from the tutorial: {sorted(sources - linked)}"
    for path in sources:
        lines = non_blank((EXAMPLE / path).read_text(encoding="utf-8"))
        for block in blocks():
            shown = non_blank(block.text)
            # A short excerpt may be quoted; a whole file or a long stretch of one is a reprint.
            assert not any(lines[i : i + 8] == shown[:8] for i in range(len(lines) - 7) if len(shown) >= 8), path


def test_the_tutorial_shows_commands() -> None:
    assert any(line.startswith("chatcore eval ") for line in shell_lines())


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
