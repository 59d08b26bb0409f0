"""chatcore.anatomy on tiny random GPT-2 and Llama-family models: the parts are found, running
the blocks one by one gives the model's own logits (with a cache, with left padding), and
the hook points act on the model's forward pass."""

from __future__ import annotations

import pytest
import torch

from chatcore.anatomy import UnsupportedModelError, anatomy_of
from chatcore.models import cache_keyword
from chatcore.testing import ARCHITECTURES, build_tiny_model


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from chatcore.models import load_model

    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), architecture=request.param, heads=4)
    return load_model(str(folder), device="cpu", dtype="float32")


def padded_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows, the second left-padded by 3: ids, attention mask and position ids (B, T)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (2, 9), generator=generator)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def manual_logits(anatomy, ids, mask, positions, cache) -> torch.Tensor:
    """(B, T, V) logits of the new positions, one block at a time through the anatomy."""
    hidden = anatomy.embed(positions, input_ids=ids)
    inputs = anatomy.block_inputs(hidden, positions, mask, cache)
    hidden = anatomy.run_blocks(hidden, range(anatomy.n_layer), inputs)
    return anatomy.logits(anatomy.final(hidden))


def test_the_parts_and_sizes_are_found(tiny) -> None:
    anatomy = anatomy_of(tiny.model)
    assert anatomy is anatomy_of(tiny.model)  # read once per model
    assert (anatomy.n_layer, anatomy.width, anatomy.n_head) == (2, 32, 4)
    assert anatomy.head_dim == 8 and anatomy.n_kv_head in (2, 4)
    assert anatomy.max_positions == 128 and anatomy.vocab_size == tiny.model.config.vocab_size
    assert (anatomy.rotary is None) == (tiny.model.config.model_type == "gpt2")
    for layer in range(anatomy.n_layer):
        parts = anatomy.attention(layer)
        assert (parts.fused_qkv is None) == (parts.query is not None)
        assert anatomy.mlp(layer) is not anatomy.block(layer)
    assert "blocks" in repr(anatomy)


def test_blocks_run_by_hand_give_the_models_logits_with_cache_and_padding(tiny) -> None:
    model, anatomy = tiny.model, anatomy_of(tiny.model)
    ids, mask, positions = padded_batch(anatomy.vocab_size)
    with torch.no_grad():
        prompt, steps = 6, 3
        ours, theirs = anatomy.new_cache(), anatomy.new_cache()
        for start, end in [(0, prompt)] + [(prompt + i, prompt + i + 1) for i in range(steps)]:
            expected = model(
                input_ids=ids[:, start:end],
                attention_mask=mask[:, :end],
                position_ids=positions[:, start:end],
                **{cache_keyword(model): theirs},
                use_cache=True,
            ).logits
            got = manual_logits(anatomy, ids[:, start:end], mask[:, :end], positions[:, start:end], ours)
            real = mask[:, start:end].bool()
            torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)


def test_residual_hook_adds_and_reads_the_stream(tiny) -> None:
    model, anatomy = tiny.model, anatomy_of(tiny.model)
    ids = torch.arange(5, 12).unsqueeze(0)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with anatomy.read_residual([0]) as seen:
            model(input_ids=ids)
        assert len(seen[0]) == 1 and seen[0][0].shape == (1, 7, 32)
        vector = torch.randn(32, generator=torch.Generator().manual_seed(1)) * 4
        with anatomy.add_to_residual(0, vector, positions=slice(-1, None)):
            steered = model(input_ids=ids).logits
            with anatomy.read_residual([0]) as again:
                model(input_ids=ids)
        after = model(input_ids=ids).logits
    torch.testing.assert_close(steered[:, :-1], plain[:, :-1])  # causal: earlier positions unchanged
    assert not torch.allclose(steered[:, -1], plain[:, -1])
    torch.testing.assert_close(again[0][0][:, -1] - seen[0][0][:, -1], vector.unsqueeze(0))
    torch.testing.assert_close(after, plain)  # the hook is gone once the context closes


def test_head_hook_sees_every_head_and_silencing_them_all_removes_attention(tiny) -> None:
    model, anatomy = tiny.model, anatomy_of(tiny.model)
    ids = torch.arange(5, 12).unsqueeze(0)
    shapes = []

    def silence(heads: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(heads.shape))
        return torch.zeros_like(heads)

    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with anatomy.head_hook(1, silence):
            silenced = model(input_ids=ids).logits
        with anatomy.head_hook(1, lambda heads: None):
            untouched = model(input_ids=ids).logits
    assert shapes == [(1, 7, 4, 8)]
    assert not torch.allclose(silenced, plain)
    torch.testing.assert_close(untouched, plain)


def test_a_model_without_blocks_is_refused_by_class_name() -> None:
    from transformers import BertConfig, BertForMaskedLM

    model = BertForMaskedLM(
        BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    )
    with pytest.raises(UnsupportedModelError, match="BertForMaskedLM"):
        anatomy_of(model)


def test_a_layer_outside_the_model_is_a_clear_error(tiny) -> None:
    from chatcore.errors import ChatcoreError

    with pytest.raises(ChatcoreError, match="outside the 2 blocks"):
        anatomy_of(tiny.model).attention(2)
