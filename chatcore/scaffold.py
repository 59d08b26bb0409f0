"""``chatcore new-plugin NAME``: the skeleton of a steering plugin package.

The package is what docs/writing-plugins.md builds by hand: a pyproject.toml whose
``chatcore`` entry point makes the plugin discoverable once installed, a module with
a Steerer subclass and its ``register_steerers`` hookimpl, and a test that uses
chatcore's pytest fixtures. The skeleton steerer works as generated (it adds
``strength`` to the end-of-turn score), so its test passes before any edit.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from string import Template

from chatcore.errors import ChatcoreError, OptionError

NAME_PATTERN = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")


@dataclass(frozen=True)
class PluginNames:
    """Every name derived from the steerer's name, e.g. ``shout-louder``."""

    steerer: str  # shout-louder: what users type after --steer
    distribution: str  # chatcore-shout-louder: the folder and the pip name
    package: str  # chatcore_shout_louder: the import name
    entry_point: str  # shout_louder: the key in [project.entry-points.chatcore]
    class_name: str  # ShoutLouder

    @classmethod
    def from_name(cls, name: str) -> "PluginNames":
        if not NAME_PATTERN.fullmatch(name):
            raise OptionError(
                f"`NAME` must be lower-case letters and digits, words joined by single hyphens "
                f"(like my-steerer), got {name!r}"
            )
        snake = name.replace("-", "_")
        return cls(
            steerer=name,
            distribution=f"chatcore-{name}",
            package=f"chatcore_{snake}",
            entry_point=snake,
            class_name="".join(part.capitalize() for part in name.split("-")),
        )


PYPROJECT = Template("""\
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "$distribution"
version = "0.1.0"
description = "The $steerer steerer for chatcore."
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["chatcore", "pydantic>=2.11"]

[project.optional-dependencies]
test = ["pytest>=8"]

# chatcore loads every module listed in this group.
[project.entry-points.chatcore]
$entry_point = "$package"

[tool.setuptools.packages.find]
where = ["src"]

# Files the plugin reads at run time (word lists, vectors) go inside the package, next
# to its code: these patterns put them in the wheel too.
[tool.setuptools.package-data]
"*" = ["*.txt", "*.json", "*.jsonl", "*.safetensors", "data/**/*"]

[tool.pytest.ini_options]
testpaths = ["tests"]
markers = ["slow: takes more than a few seconds"]
""")

MODULE = Template('''\
"""The $steerer steerer for chatcore.

A steerer wraps one decoding step: it receives the inner step (the model, and any
steerer listed before it) and returns a new step. This skeleton edits the scores: it
adds `strength` to the end-of-turn token, so a positive strength makes replies
shorter and a negative one longer. Replace the body of `wrap` with your method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

import chatcore
from chatcore.options import Settings
from chatcore.steering import Steerer
from chatcore.step import Step, StepOutput, StepState

if TYPE_CHECKING:
    from chatcore.decoding import GenerationSession


class ${class_name}Settings(Settings):
    """What `--steer "$steerer strength=4"` sets: a pydantic model, so values arrive
    converted and checked, and the docstring under a field is its help text."""

    strength: Annotated[float, Field(ge=-100, le=100)] = 2.0
    """Added to the end-of-turn score: positive ends replies sooner, negative later."""


class $class_name(Steerer):
    name = "$steerer"
    description = "adds `strength` to the end-of-turn score (shorter or longer replies)"
    Settings = ${class_name}Settings

    def prepare(self, session: "GenerationSession") -> None:
        # Once per reply, before the first step: read the model, encode text, load files.
        self.end_of_turn = session.eos_token_id

    def wrap(self, step: Step) -> Step:
        def steered(state: StepState) -> StepOutput:
            output = step(state)
            logits = output.logits.clone()  # (B, V): one row per reply being decoded
            logits[:, self.end_of_turn] += self.settings.strength
            return output.replace(logits=logits)

        return steered


@chatcore.hookimpl
def register_steerers(register: Callable[[type], None]) -> None:
    register($class_name)
''')

CONFTEST = Template('''\
import pytest

# chatcore's fixtures: chatcore_engine, chatcore_conversation, chatcore_tiny_model, ...
pytest_plugins = ["chatcore.pytest_plugin"]


@pytest.fixture
def chatcore_plugins():
    """The plugins under test: every chatcore_engine registers these (and no installed plugin)."""
    return ("$package",)
''')

TEST = Template("""\
import pytest

from chatcore.errors import OptionError
from chatcore.testing import compare_to_baseline


def test_the_steerer_is_registered(chatcore_engine):
    assert "$steerer" in chatcore_engine.registry.steerers


def test_bad_settings_name_the_setting(chatcore_engine):
    with pytest.raises(OptionError, match="strength"):
        chatcore_engine.make_steerer("$steerer", {"strength": "1000"})


def test_a_strong_end_of_turn_bias_shortens_replies(chatcore_engine):
    comparison = compare_to_baseline(
        chatcore_engine, "$steerer", {"strength": 50},
        contexts=["hi, how are you?", "what do you do for fun?"], seeds=[0, 1], max_new_tokens=12,
    )
    assert comparison.steered.mean_length < comparison.baseline.mean_length
""")

README = Template("""\
# $distribution

The `$steerer` steerer for [chatcore](https://pypi.org/project/chatcore/).

```sh
pip install -e .
chatcore plugins                                  # lists $distribution:$entry_point
chatcore generate --steer "$steerer strength=4" "hi, how are you?"
pytest
```
""")


def render(names: PluginNames) -> dict[str, str]:
    """Relative path -> text of every file in the package."""
    values = dataclasses.asdict(names)
    return {
        "pyproject.toml": PYPROJECT.substitute(values),
        "README.md": README.substitute(values),
        f"src/{names.package}/__init__.py": MODULE.substitute(values),
        "tests/conftest.py": CONFTEST.substitute(values),
        f"tests/test_{names.entry_point}.py": TEST.substitute(values),
    }


def write_plugin(name: str, parent: str | Path = ".") -> Path:
    """Create ``parent/chatcore-NAME/`` with the skeleton; never touches an existing folder."""
    names = PluginNames.from_name(name)
    taken = installed_as(names)
    if taken is not None:
        raise ChatcoreError(f"{taken}: choose another name (chatcore new-plugin my-{name}), or uninstall it first")
    parent = Path(parent)
    if not parent.is_dir():
        raise ChatcoreError(f"no such folder: {parent}")
    folder = parent / names.distribution
    try:
        folder.mkdir()
    except FileExistsError:
        raise ChatcoreError(f"{folder} already exists; remove it or choose another name") from None
    except OSError as error:
        raise ChatcoreError(f"cannot create {folder}: {error.strerror}") from None
    for relative, text in render(names).items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return folder


def installed_as(names: PluginNames) -> str | None:
    """What already uses these names in this environment (a distribution of that name,
    or a chatcore plugin under that entry-point name), or None."""
    from importlib import metadata

    try:
        found = metadata.distribution(names.distribution)
    except metadata.PackageNotFoundError:
        found = None
    if found is not None:
        return f"a package named {names.distribution} is installed already ({found.version})"
    for entry_point in metadata.entry_points(group="chatcore"):
        if entry_point.name == names.entry_point:
            owner = entry_point.dist.name if entry_point.dist else "another package"
            return f"the chatcore plugin name {names.entry_point!r} is taken by {owner}"
    return None
