"""chatcore's pytest plugin: fixtures for testing chatcore plugins.

Installed with chatcore as the ``pytest11`` entry point ``chatcore``, so pytest loads
it in every project, but it only defines fixtures: nothing is autouse, no hook changes
how tests run, and torch is imported only when a test asks for a model. Every fixture
name starts with ``chatcore_`` so none shadows a project's own. Where plugin
autoloading is off (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``), ask for it with
``pytest -p chatcore.pytest_plugin`` or ``pytest_plugins = ["chatcore.pytest_plugin"]``
in the top-level conftest.py.

Fixtures:
    chatcore_tiny_model_dir   session: a folder with a tiny random GPT-2 and a real tokenizer
    chatcore_tiny_model       session: that model, loaded (a chatcore.models.LoadedModel)
    chatcore_bundled_model    session: the bundled, really trained chatcore-tiny
    chatcore_plugins          the plugins under test (override it in your conftest.py)
    chatcore_engine_factory   factory(*plugins, model=None) -> Engine with greedy, top-k,
                              chatcore_plugins and ``plugins`` only (installed ones are ignored)
    chatcore_engine           chatcore_engine_factory() on the tiny model
    chatcore_conversation     build(*turns, engine=None) -> Conversation (last turn is the user's)

The steered-vs-unsteered helper is a plain function: ``chatcore.testing.compare_to_baseline``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from chatcore import testing

if TYPE_CHECKING:
    from chatcore.conversation import Conversation
    from chatcore.engine import Engine
    from chatcore.models import LoadedModel


@pytest.fixture(scope="session")
def chatcore_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return testing.build_tiny_model(tmp_path_factory.mktemp("chatcore-tiny-model"))


@pytest.fixture(scope="session")
def chatcore_tiny_model(chatcore_tiny_model_dir: Path) -> "LoadedModel":
    from chatcore.models import load_model

    return load_model(str(chatcore_tiny_model_dir), device="cpu")


@pytest.fixture(scope="session")
def chatcore_bundled_model() -> "LoadedModel":
    from chatcore.models import DEFAULT_MODEL, load_model

    return load_model(DEFAULT_MODEL, device="cpu")


@pytest.fixture
def chatcore_plugins() -> tuple[Any, ...]:
    """The plugins under test: module names, modules or plugin objects.

    Override it in your conftest.py, e.g. ``return ("my_package",)``.
    """
    return ()


@pytest.fixture
def chatcore_engine_factory(
    request: pytest.FixtureRequest, chatcore_plugins: tuple[Any, ...]
) -> Callable[..., "Engine"]:
    def factory(*plugins: Any, model: "str | LoadedModel | None" = None) -> "Engine":
        # The tiny model is built only when a test uses it.
        chosen = model if model is not None else request.getfixturevalue("chatcore_tiny_model")
        return testing.make_engine(chosen, *chatcore_plugins, *plugins)

    return factory


@pytest.fixture
def chatcore_engine(chatcore_engine_factory: Callable[..., "Engine"]) -> "Engine":
    return chatcore_engine_factory()


@pytest.fixture
def chatcore_conversation(request: pytest.FixtureRequest) -> Callable[..., "Conversation"]:
    def build(*turns: str, engine: "Engine | None" = None) -> "Conversation":
        chosen = engine if engine is not None else request.getfixturevalue("chatcore_engine")
        return testing.build_conversation(chosen, *turns)

    return build
