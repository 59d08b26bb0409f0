"""``chatcore new-plugin NAME [--decoder]``: the skeleton of a steerer or decoder plugin package.

The package is what docs/writing-plugins.md describes: a pyproject.toml whose
``chatcore`` entry point makes the plugin discoverable once installed, a module with a
Steerer (or, with ``--decoder``, a TokenDecoder) subclass and its registration hookimpl,
importing only chatcore's public API (:mod:`chatcore.api`), and a test that uses
chatcore's pytest fixtures. The skeleton works as generated (the steerer adds
``strength`` to the end-of-turn score; the decoder samples at a ``temperature``), so its
tests pass before any edit.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Literal

from chatcore.errors import ChatcoreError, OptionError

NAME_PATTERN = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")
KINDS = ("steerer", "decoder")
Kind = Literal["steerer", "decoder"]


@dataclass(frozen=True)
class PluginNames:
    """Every name derived from the plugin's name, e.g. ``shout-louder``."""

    name: str  # shout-louder: what users type after --steer (or --decoder)
    distribution: str  # chatcore-shout-louder: the folder and the pip name
    package: str  # chatcore_shout_louder: the import name
    entry_point: str  # shout_louder: the key in [project.entry-points.chatcore]
    class_name: str  # ShoutLouder

    @classmethod
    def from_name(cls, name: str) -> "PluginNames":
        if name.startswith("chatcore-"):
            raise OptionError(
                f"give `NAME` without 'chatcore-' ({name.removeprefix('chatcore-')!r}): "
                f"the package is named chatcore-NAME"
            )
        if not NAME_PATTERN.fullmatch(name):
            raise OptionError(
                f"`NAME` must start with a letter and be lower-case letters and digits, words joined by "
                f"single hyphens (like my-steerer), got {name!r}"
            )
        snake = name.replace("-", "_")
        return cls(
            name=name,
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
description = "The $name $kind for chatcore."
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
"""The $name steerer for chatcore.

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
from chatcore.api import Settings, Steerer, Step, StepOutput, StepState

if TYPE_CHECKING:
    from chatcore.api import GenerationSession


class ${class_name}Settings(Settings):
    """What `--steer "$name strength=4"` sets: a pydantic model, so values arrive
    converted and checked, and the docstring under a field is its help text."""

    strength: Annotated[float, Field(ge=-100, le=100)] = 2.0
    """Added to the end-of-turn score: positive ends replies sooner, negative later."""


class $class_name(Steerer):
    name = "$name"
    description = "adds `strength` to the end-of-turn score (shorter or longer replies)"
    Settings = ${class_name}Settings
    # A score steerer: it calls its inner step once and edits only the scores, so its
    # replies share the batch (and its fast path). Set False once `wrap` runs the model
    # itself or changes what the step reads (docs/hooks.md, "Steerers").
    shares_batch = True

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

from chatcore.api import OptionError
from chatcore.testing import compare_to_baseline


def test_the_steerer_is_registered(chatcore_engine):
    assert "$name" in chatcore_engine.registry.steerers


def test_bad_settings_name_the_setting(chatcore_engine):
    with pytest.raises(OptionError, match="strength"):
        chatcore_engine.make_steerer("$name", {"strength": "1000"})


def test_a_strong_end_of_turn_bias_shortens_replies(chatcore_engine):
    comparison = compare_to_baseline(
        chatcore_engine, "$name", {"strength": 50},
        contexts=["hi, how are you?", "what do you do for fun?"], seeds=[0, 1], max_new_tokens=12,
    )
    assert comparison.steered.mean_length < comparison.baseline.mean_length
""")

DECODER_MODULE = Template('''\
"""The $name decoder for chatcore.

A token decoder chooses each next token of a reply: chatcore's one decoding loop runs the
model (and any steerer) and hands the decoder each step's scores, (rows, V), after the
decoder's score processors. This skeleton divides the scores by `temperature` and draws
from them. Replace `processors` and `select` with your method; a decoder never runs the
model or a loop of its own (see docs/hooks.md, "Decoders").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

import chatcore
from chatcore.api import RepetitionSettings, ScoreProcessor, TokenDecoder, selects_from_scores, temperature

if TYPE_CHECKING:
    import torch


class ${class_name}Settings(RepetitionSettings):
    """What `--decoder "$name temperature=0.5"` sets (with the repetition controls every
    token decoder has): a pydantic model, so values arrive converted and checked."""

    temperature: Annotated[float, Field(ge=0.01, le=100)] = 0.7
    """Divide the scores by this before drawing (lower: more predictable)."""


class $class_name(TokenDecoder):
    name = "$name"
    description = "draws each token from the scores divided by `temperature`"
    Settings = ${class_name}Settings

    def processors(self) -> list[ScoreProcessor]:
        # Applied to each step's scores in this order; the repetition controls first.
        return [*self.repetition_processors(), temperature(self.settings.temperature)]

    @selects_from_scores  # it picks an index of its scores' rows: no check of its ids is needed
    def select(self, scores: "torch.Tensor", generator: "torch.Generator") -> "torch.Tensor":
        import torch

        probabilities = torch.softmax(scores, dim=-1)  # (rows, V)
        return torch.multinomial(probabilities, num_samples=1, generator=generator).squeeze(1)  # (rows,)


@chatcore.hookimpl
def register_decoders(register: Callable[[type], None]) -> None:
    register($class_name)
''')

DECODER_TEST = Template("""\
import pytest

from chatcore.api import OptionError


def test_the_decoder_is_registered(chatcore_engine):
    assert "$name" in chatcore_engine.registry.decoders


def test_bad_settings_name_the_setting(chatcore_engine):
    with pytest.raises(OptionError, match="temperature"):
        chatcore_engine.make_decoder("$name", {"temperature": "0"})


def test_it_replies_and_the_same_seed_gives_the_same_reply(chatcore_engine, chatcore_conversation):
    settings = {"decoder": "$name", "seed": 3, "max_new_tokens": 8}
    first = chatcore_engine.respond(chatcore_conversation("hi, how are you?"), **settings)
    again = chatcore_engine.respond(chatcore_conversation("hi, how are you?"), **settings)
    assert first.text() == again.text()
    assert first.provenance["decoder"]["name"] == "$name"
""")

README = Template("""\
# $distribution

The `$name` $kind for [chatcore](https://pypi.org/project/chatcore/).

```sh
pip install -e .
chatcore plugins                                  # lists $distribution:$entry_point
chatcore generate $example "hi, how are you?"
pytest
```
""")


def render(names: PluginNames, kind: Kind = "steerer") -> dict[str, str]:
    """Relative path -> text of every file in the package of a ``kind`` plugin."""
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {', '.join(KINDS)}, got {kind!r}")
    example = f'--decoder "{names.name} temperature=0.5"' if kind == "decoder" else f'--steer "{names.name} strength=4"'
    values = {**dataclasses.asdict(names), "kind": kind, "example": example}
    module, test = (DECODER_MODULE, DECODER_TEST) if kind == "decoder" else (MODULE, TEST)
    return {
        "pyproject.toml": PYPROJECT.substitute(values),
        "README.md": README.substitute(values),
        f"src/{names.package}/__init__.py": module.substitute(values),
        "tests/conftest.py": CONFTEST.substitute(values),
        f"tests/test_{names.entry_point}.py": test.substitute(values),
    }


def write_plugin(name: str, parent: str | Path = ".", kind: Kind = "steerer") -> Path:
    """Create ``parent/chatcore-NAME/`` with the skeleton of a ``kind`` plugin; never
    touches an existing folder."""
    names = PluginNames.from_name(name)
    taken = installed_as(names) or registered_as(names, kind)
    if taken is not None:
        remedy = "" if "built-in" in taken else ", or uninstall it first"
        raise ChatcoreError(f"{taken}: choose another name (chatcore new-plugin my-{name}){remedy}")
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
    for relative, text in render(names, kind).items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return folder


def registered_as(names: PluginNames, kind: Kind) -> str | None:
    """Which loaded plugin registers a ``kind`` (steerer or decoder) under ``names.name``
    already, or None: installed next to it, neither plugin would keep the bare name."""
    from chatcore.plugin_manager import get_plugin_host
    from chatcore.registry import QUALIFIER, registry_of

    host = get_plugin_host()
    registry = registry_of(host)
    table = registry.steerers if kind == "steerer" else registry.decoders
    owners = [entry.plugin for key, entry in table.items() if key.rpartition(QUALIFIER)[2] == names.name]
    if not owners:
        return None
    builtin = [plugin for plugin in owners if plugin in host.infos and host.infos[plugin].builtin]
    owner = "a built-in plugin of chatcore" if builtin else f"the plugin {', '.join(sorted(owners))}"
    return f"the {kind} name {names.name!r} is registered by {owner}"


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
            if owner == "chatcore":
                return f"{names.entry_point!r} is a built-in plugin of chatcore"
            return f"the chatcore plugin name {names.entry_point!r} is taken by {owner}"
    return None
