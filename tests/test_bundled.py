"""The bundled models load through the public path and are really trained."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from chatcore.evaluation.metrics import is_degenerate
from chatcore.models import (
    BUNDLED_DIR,
    DEFAULT_MODEL,
    DEFAULT_REVERSE_MODEL,
    bundled_models,
    bundled_reverse_models,
    load_model,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def forward():
    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def reverse():
    return load_model(DEFAULT_REVERSE_MODEL)


def test_bundled_models_are_listed() -> None:
    assert {DEFAULT_MODEL, DEFAULT_REVERSE_MODEL} <= set(bundled_models())


def test_sizes_within_budget(forward, reverse) -> None:
    assert sum(p.numel() for p in forward.model.parameters()) <= 15_500_000
    assert sum(p.numel() for p in reverse.model.parameters()) < sum(p.numel() for p in forward.model.parameters())
    on_disk = sum(f.stat().st_size for f in BUNDLED_DIR.rglob("*") if f.is_file())
    # chatcore-tiny 28 MiB (float16), the CoCon block 4, and the two reverse models in 8 bits
    # (`chatcore models pack`): chatcore-tiny-reverse 7.6, smollm2-reverse 15.8 with its tokenizer.
    assert on_disk <= 60 * 1024 * 1024


def test_reverse_models_are_found_by_their_training_record() -> None:
    assert bundled_reverse_models() == ["chatcore-tiny-reverse", "smollm2-reverse"]


@pytest.mark.slow
def test_smollm2_reverse_shares_smollm2_s_tokenizer(smollm2) -> None:
    from chatcore.plugins.mmi.reranking import same_tokenizer

    assert same_tokenizer(smollm2.tokenizer, load_tokenizer("smollm2-reverse"))


def test_same_tokenizer(forward, reverse) -> None:
    assert forward.tokenizer.get_vocab() == reverse.tokenizer.get_vocab()
    assert forward.eos_token_id == reverse.eos_token_id


def _heldout_perplexity(loaded, reverse_order: bool, dialogues: int = 20) -> float:
    import torch

    from chatcore.training.corpus import load_chitchat, split_heldout
    from chatcore.training.data import encode_dialogues

    _, heldout = split_heldout(load_chitchat())
    stream = encode_dialogues(heldout[:dialogues], loaded.tokenizer, reverse=reverse_order)
    block = 256
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, stream.numel() - 1 - block, block):
            ids = stream[start : start + block + 1].unsqueeze(0)
            logits = loaded.model(input_ids=ids[:, :-1]).logits.float()
            total += torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="sum").item()
            count += block
    return math.exp(total / count)


@pytest.mark.slow
def test_models_are_trained(forward, reverse) -> None:
    # An untrained model sits near the vocabulary size (8192); the shipped ones near 60.
    assert _heldout_perplexity(forward, reverse_order=False) < 90
    assert _heldout_perplexity(reverse, reverse_order=True) < 100


def test_replies_to_openers(forward) -> None:
    from chatcore.engine import Engine
    from chatcore.plugin_manager import PluginHost

    host = PluginHost()
    host.load_modules(("chatcore.plugins.top_k",))
    engine = Engine(forward, host=host)
    replies = [engine.reply_to(["hi, how are you?"], seed=seed, max_new_tokens=30).text() for seed in range(6)]
    assert all(reply.strip() for reply in replies)
    assert sum(is_degenerate(reply) for reply in replies) <= 1
    assert len(set(replies)) >= 4  # sampling with different seeds gives different replies


def test_model_card_exists() -> None:
    card = Path(__file__).resolve().parents[1] / "docs" / "models.md"
    text = card.read_text(encoding="utf-8")
    assert "chatcore-tiny" in text and "perplexity" in text
