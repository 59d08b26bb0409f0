"""CoCon: the block's masks, the cached pipeline, the steerer, block refusal, training."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from chatcore.decoding import GenerationSession
from chatcore.engine import Engine, ReplyOptions
from chatcore.errors import ChatcoreError, OptionError
from chatcore.models import cache_keyword
from chatcore.plugins.bow_bias import word_variants
from chatcore.plugins.cocon.block import CoconBlock, CoconConfig
from chatcore.plugins.cocon.model_split import SplitModel, UnsupportedModelError
from chatcore.plugins.cocon.pipeline import CoconPipeline
from chatcore.plugins.cocon.store import (
    BlockMismatchError,
    check_compatible,
    load_block,
    model_fingerprint,
    read_info,
    save_block,
)
from chatcore.testing import decode_steps
from chatcore.text import encode_text

COCON_PLUGINS = (
    "chatcore.plugins.greedy",
    "chatcore.plugins.top_k",
    "chatcore.plugins.bow_bias",
    "chatcore.plugins.cocon.plugin",
)


def random_block(n_embd: int, n_head: int, split_layer: int, seed: int = 0) -> CoconBlock:
    """An untrained block with weights large enough that it changes what it touches."""
    torch.manual_seed(seed)
    return CoconBlock(
        CoconConfig(n_embd=n_embd, n_head=n_head, split_layer=split_layer, dropout=0.0, init_std=0.3)
    ).eval()


@pytest.fixture(scope="module")
def tiny_block_dir(loaded, tmp_path_factory):
    """A (random) block saved for the tiny fixture model, as `chatcore train cocon` saves one."""
    config = loaded.model.config
    block = random_block(config.n_embd, config.n_head, 1)
    directory = tmp_path_factory.mktemp("cocon-block")
    save_block(
        block,
        directory,
        {"name": "tiny", "fingerprint": model_fingerprint(loaded.model, loaded.tokenizer)},
        dtype="float32",
    )
    return directory


@pytest.fixture
def cocon_host():
    from chatcore.plugin_manager import PluginHost

    host = PluginHost()
    host.load_modules(COCON_PLUGINS)
    assert host.problems == []
    return host


@pytest.fixture
def cocon_engine(loaded, cocon_host):
    return Engine(loaded, host=cocon_host)


# -- the block -----------------------------------------------------------------------------


def test_block_shapes_and_content_is_visible_to_every_position():
    block = random_block(32, 4, 1)
    B, T, S = 2, 6, 3
    hidden = torch.randn(B, T, 32)
    content = torch.randn(B, S, 32)
    keys, values = block.content_keys_values(content)
    assert keys.shape == values.shape == (B, 4, S, 8)
    valid = torch.ones(B, T, dtype=torch.bool)
    out, all_keys, all_values = block(hidden, valid, keys, values, S)
    assert out.shape == (B, T, 32)
    assert all_keys.shape == all_values.shape == (B, 4, S + T, 8)
    # Changing the content changes the output at every position, the first included.
    other_keys, other_values = block.content_keys_values(torch.randn(B, S, 32))
    changed, _, _ = block(hidden, valid, other_keys, other_values, S)
    assert ((changed - out).abs().amax(dim=-1) > 1e-4).all()


def test_block_hides_the_future_and_padding():
    block = random_block(32, 4, 1)
    hidden = torch.randn(1, 6, 32)
    keys, values = block.content_keys_values(torch.randn(1, 2, 32))
    valid = torch.ones(1, 6, dtype=torch.bool)
    out, _, _ = block(hidden, valid, keys, values, 2)
    future = hidden.clone()
    future[:, 4] += 5.0
    changed, _, _ = block(future, valid, keys, values, 2)
    assert torch.allclose(changed[:, :4], out[:, :4], atol=1e-6)  # earlier positions unchanged
    assert not torch.allclose(changed[:, 4:], out[:, 4:], atol=1e-4)
    # A padding position is never attended to: changing it changes no real position.
    padded_valid = valid.clone()
    padded_valid[:, 0] = False
    first, _, _ = block(hidden, padded_valid, keys, values, 2)
    moved = hidden.clone()
    moved[:, 0] += 5.0
    second, _, _ = block(moved, padded_valid, keys, values, 2)
    assert torch.allclose(first[:, 1:], second[:, 1:], atol=1e-6)


@torch.no_grad()
def test_tau_moves_attention_and_is_per_content():
    block = random_block(32, 4, 1)
    hidden = torch.randn(1, 5, 32)
    valid = torch.ones(1, 5, dtype=torch.bool)
    first_keys, first_values = block.content_keys_values(torch.randn(1, 2, 32))
    second_keys, second_values = block.content_keys_values(torch.randn(1, 3, 32))
    keys, values = torch.cat([first_keys, second_keys], 2), torch.cat([first_values, second_values], 2)
    no_content, _, _ = block(hidden, valid)
    # A very negative tau on every content position is the block without content.
    hidden_away = torch.full((1, 1, 5), -1e4)
    away, _, _ = block(hidden, valid, keys, values, 5, hidden_away)
    assert torch.allclose(away, no_content, atol=1e-5)
    # One tau per content: switching off the first content leaves the second alone.
    per_content = torch.tensor([-1e4, -1e4, 0.0, 0.0, 0.0]).view(1, 1, 5)
    only_second, _, _ = block(hidden, valid, keys, values, 5, per_content)
    second_alone, _, _ = block(hidden, valid, second_keys, second_values, 3)
    assert torch.allclose(only_second, second_alone, atol=1e-5)
    # A larger tau moves the output further from the no-content output.
    distances = []
    for tau in (-2.0, 0.0, 2.0, 5.0):
        out, _, _ = block(hidden, valid, keys, values, 5, torch.full((1, 1, 5), tau))
        distances.append(float((out - no_content).norm().detach()))
    assert distances == sorted(distances)


# -- the split model and the cached pipeline --------------------------------------------------


def test_split_model_reproduces_the_model(loaded):
    split = SplitModel(loaded.model, 1)
    ids = torch.tensor([encode_text(loaded.tokenizer, "hello there, how are you?")])
    L = ids.size(1)
    with torch.no_grad():
        embeddings = split.embed(torch.arange(L)[None], input_ids=ids)
        inputs = split.pass_inputs(embeddings)
        mine = split.head(split.beta(split.alpha(embeddings, inputs), inputs))
        theirs = loaded.model(ids).logits
    assert torch.allclose(mine, theirs, atol=1e-5)
    with pytest.raises(UnsupportedModelError, match="split layer"):
        SplitModel(loaded.model, loaded.model.config.n_layer)


def test_cached_steps_equal_a_full_recompute(loaded):
    split = SplitModel(loaded.model, 1)
    pipeline = CoconPipeline(split, random_block(split.n_embd, loaded.model.config.n_head, 1))
    tokenizer = loaded.tokenizer
    content = pipeline.encode_content(
        [encode_text(tokenizer, " pizza"), encode_text(tokenizer, " is great")], [2.0, -1.0]
    )
    history = len(encode_text(tokenizer, "what should we eat tonight?")) + 1
    rows = [
        encode_text(tokenizer, "what should we eat tonight?")
        + [loaded.eos_token_id]
        + encode_text(tokenizer, "maybe something warm and"),
        encode_text(tokenizer, "what should we cook on friday?")[: history - 1]
        + [loaded.eos_token_id]
        + encode_text(tokenizer, "i was thinking about soup"),
    ]
    length = min(len(r) for r in rows)
    sequences = torch.tensor([r[:length] for r in rows])  # (2, L)
    B = sequences.size(0)
    with torch.no_grad():
        output = pipeline.forward(
            torch.ones(B, history),
            torch.arange(history).expand(B, -1),
            history,
            content,
            input_ids=sequences[:, :history],
        )
        cached = [output.logits]
        for position in range(history, length - 1):
            output = pipeline.forward(
                torch.ones(B, position + 1),
                torch.full((B, 1), position),
                history,
                content,
                input_ids=sequences[:, position : position + 1],
                cache=output.cache,
            )
            cached.append(output.logits)
        alpha_hidden = split.hidden_at_split(sequences[:, :-1])
        full, _ = pipeline.full_forward(
            alpha_hidden,
            history,
            content.keys.expand(B, -1, -1, -1),
            content.values.expand(B, -1, -1, -1),
            content.bias,
        )
    assert output.cache.length == length - 1
    assert torch.allclose(torch.stack(cached, dim=1), full, atol=1e-4)


def test_a_left_padded_row_decodes_as_it_would_alone(loaded, tiny_block_dir):
    block, _ = load_block(tiny_block_dir)
    split = SplitModel(loaded.model, block.config.split_layer)
    pipeline = CoconPipeline(split, block)
    content = pipeline.encode_content([encode_text(loaded.tokenizer, " music")], [1.0])
    short, long = [5, 9, 13, 0], [7, 3, 11, 8, 2, 6, 0]
    with torch.no_grad():
        alone = pipeline.forward(torch.ones(1, 4), torch.arange(4)[None], 4, content, input_ids=torch.tensor([short]))
        padded = torch.tensor([[0, 0, 0] + short, long])
        valid = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
        positions = (valid.cumsum(-1) - 1).clamp(min=0)
        both = pipeline.forward(valid, positions, 7, content, input_ids=padded)
    assert torch.allclose(both.logits[0], alone.logits[0], atol=1e-4)


# -- the steerer -----------------------------------------------------------------------------


def test_cocon_settings_are_validated(cocon_engine):
    cocon = cocon_engine.registry.steerer("cocon")  # settings alone: the tiny model has no bundled block
    with pytest.raises(OptionError, match="tau"):
        cocon.from_options({"content": "a,b,c", "tau": "1,2"})
    with pytest.raises(OptionError, match="tau"):
        cocon.from_options({"content": "pizza", "tau": "100"})
    steerer = cocon.from_options({"content": "pizza, is perfect", "tau": "2"})
    assert steerer.settings.content == ("pizza", "is perfect")
    assert steerer.settings.taus() == [2.0, 2.0]
    assert cocon.from_options({"content": "a,b"}).settings.taus(1.5) == [1.5, 1.5]


def test_a_content_longer_than_the_models_positions_is_a_clear_error(cocon_engine, tiny_block_dir, loaded):
    content = "pizza " * (loaded.max_positions + 10)
    options = ReplyOptions(
        decoder="greedy", max_new_tokens=2, steerers=[("cocon", {"content": (content,), "block": str(tiny_block_dir)})]
    )
    with pytest.raises(Exception, match=r"`content` .* tokens long; .* takes at most"):
        cocon_engine.send(cocon_engine.conversation(), "hi", options).text()


def test_tau_defaults_to_the_blocks_own(cocon_engine, tiny_block_dir, tmp_path):
    import shutil

    def taus(block: str, settings: dict) -> list[float]:
        response = cocon_engine.send(
            cocon_engine.conversation(),
            "hi there",
            ReplyOptions(
                decoder="greedy",
                steerers=[("cocon", {"content": "pizza,dog", "block": block, **settings})],
                max_new_tokens=2,
            ),
        )
        response.text()
        return response.provenance["details"]["cocon"]["tau"]

    assert taus(str(tiny_block_dir), {}) == [0.0, 0.0]  # a block without a default_tau: the paper's 0
    for value, name in ((2.5, "with-default"), ("high", "bad-default")):
        folder = tmp_path / name
        shutil.copytree(tiny_block_dir, folder)
        info = json.loads((folder / "cocon_config.json").read_text())
        (folder / "cocon_config.json").write_text(json.dumps({**info, "default_tau": value}))
        if value == "high":
            with pytest.raises(Exception, match="default_tau"):
                taus(str(folder), {})
        else:
            assert taus(str(folder), {}) == [2.5, 2.5]
            assert taus(str(folder), {"tau": "1,-1"}) == [1.0, -1.0]  # given values win


def test_the_bundled_block_names_its_default_tau():
    from chatcore.plugins.cocon.store import resolve_block

    folder = resolve_block("cocon-chatcore-tiny", {}, "chatcore-tiny")
    value = read_info(folder)["default_tau"]
    assert isinstance(value, (int, float)) and -50 <= value <= 50
    docs = (Path(__file__).resolve().parents[1] / "docs" / "cocon.md").read_text(encoding="utf-8")
    assert f"({value:g} for the bundled block)" in docs  # the settings table states the shipped value


def test_a_training_runs_folder_names_its_block(tmp_path):
    """``block=RUN`` (what ``train cocon --out RUN`` made) reads ``RUN/block``."""
    import shutil

    from chatcore.api import ModelLoadError
    from chatcore.plugins.cocon.store import resolve_block

    bundled = resolve_block("cocon-chatcore-tiny", {}, "chatcore-tiny")
    shutil.copytree(bundled, tmp_path / "run" / "block")
    assert resolve_block(str(tmp_path / "run"), {}, "chatcore-tiny") == tmp_path / "run" / "block"
    with pytest.raises(ModelLoadError, match="no CoCon block"):
        resolve_block(str(tmp_path / "elsewhere"), {}, "chatcore-tiny")


def test_cocon_replies_under_every_decoder_and_composes_after(cocon_engine, tiny_block_dir):
    settings = {"content": "pizza", "tau": "2", "block": str(tiny_block_dir)}
    for decoder in ("greedy", "top-k"):
        response = cocon_engine.send(
            cocon_engine.conversation(),
            "what should we eat?",
            ReplyOptions(decoder=decoder, steerers=[("cocon", settings)], seed=1, min_new_tokens=6, max_new_tokens=6),
        )
        response.text()
        assert len(response.token_ids) == 6
        assert response.provenance["details"]["cocon"]["content_tokens"] == [
            len(encode_text(cocon_engine.tokenizer, " pizza"))
        ]
    # A logit steerer after cocon wraps the cocon step: its bias decides the first token.
    steered = cocon_engine.send(
        cocon_engine.conversation(),
        "what should we eat?",
        ReplyOptions(
            decoder="greedy",
            min_new_tokens=4,
            max_new_tokens=4,
            steerers=[("cocon", settings), ("bow-bias", {"words": "pizza", "strength": "100"})],
        ),
    )
    steered.text()
    first_tokens = {encode_text(cocon_engine.tokenizer, form)[0] for form in word_variants("pizza")}
    assert steered.token_ids[0] in first_tokens


def test_cocon_must_come_first(cocon_engine, tiny_block_dir):
    from chatcore.errors import OptionError

    options = ReplyOptions(
        steerers=[("bow-bias", {"words": "pizza"}), ("cocon", {"content": "pizza", "block": str(tiny_block_dir)})]
    )
    conversation = cocon_engine.conversation()
    cocon_engine.add_user(conversation, "hi")
    with pytest.raises(OptionError, match="must come first"):  # refused before any decoding
        cocon_engine.respond(conversation, options)


def test_cocon_decodes_several_rows_in_one_batch(cocon_engine, loaded, tiny_block_dir):
    steerer = cocon_engine.make_steerer("cocon", {"content": "music", "block": str(tiny_block_dir)})
    prompt = encode_text(loaded.tokenizer, "do you like songs?") + [loaded.eos_token_id]

    def greedy(scores, generator):
        return scores.argmax(-1)

    def decode(prompt_ids, rows):
        session = GenerationSession(
            model=loaded,
            prompt_ids=prompt_ids,
            steerers=[steerer],
            max_new_tokens=5,
            generator=torch.Generator().manual_seed(0),
            seed=0,
            min_new_tokens=5,
        )
        steerer.prepare(session)
        return torch.stack(list(decode_steps(session, greedy, rows=rows)), dim=1)  # (rows, 5)

    batch = decode(prompt, 3)
    assert batch.shape == (3, 5)
    alone = decode(prompt, 1)[0]
    assert all(torch.equal(row, alone) for row in batch)
    assert decode(prompt[2:], 1).shape == (1, 5)


def test_a_block_for_one_model_is_refused_on_another(loaded, tiny_block_dir, cocon_engine):
    from chatcore.models import load_model

    bundled = load_model("chatcore-tiny")
    info = read_info(tiny_block_dir)
    with pytest.raises(BlockMismatchError, match="trained for model 'tiny', not for 'chatcore-tiny'"):
        check_compatible(info, model_fingerprint(bundled.model, bundled.tokenizer), "tiny-block", "chatcore-tiny")
    # Through the steerer: the bundled model refuses the tiny model's block, with the fix in the message.
    engine = Engine(bundled, host=cocon_engine.host)
    options = ReplyOptions(steerers=[("cocon", {"content": "pizza", "block": str(tiny_block_dir)})])
    with pytest.raises(BlockMismatchError, match="chatcore train cocon"):
        engine.send(engine.conversation(), "hi", options).text()
    # The same shape but another tokenizer is refused too.
    fingerprint = dict(info["base_model"]["fingerprint"], tokenizer_sha256="0" * 64)
    with pytest.raises(BlockMismatchError, match="different tokenizer"):
        check_compatible(info, fingerprint, "tiny-block", "other")
    # And with no block given, a model without a bundled block gets told how to make one.
    options = ReplyOptions(steerers=[("cocon", {"content": "pizza"})])
    with pytest.raises(BlockMismatchError, match="no bundled CoCon block fits"):
        cocon_engine.send(cocon_engine.conversation(), "hi", options).text()


# -- the bundled block ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled_pipeline():
    from chatcore.models import load_model
    from chatcore.plugins.cocon.store import bundled_blocks, check_compatible, resolve_block

    if not bundled_blocks():
        pytest.skip("no bundled CoCon block")
    bundled = load_model("chatcore-tiny")
    fingerprint = model_fingerprint(bundled.model, bundled.tokenizer)
    folder = resolve_block(None, fingerprint, "chatcore-tiny")
    block, info = load_block(folder)
    check_compatible(info, fingerprint, folder.name, "chatcore-tiny")
    return bundled, CoconPipeline(SplitModel(bundled.model, block.config.split_layer), block)


def test_empty_content_stays_close_to_the_plain_model(bundled_pipeline):
    """Null-content training: with no content the block barely moves the next-token distribution."""
    bundled, pipeline = bundled_pipeline
    tokenizer, eos = bundled.tokenizer, bundled.eos_token_id
    contexts = [
        "hi, how are you?",
        "what do you do for fun?",
        "i just got back from a trip to the mountains",
        "do you have any pets?",
        "what kind of music do you like?",
        "i am so tired today",
    ]
    kls, agree, total = [], 0, 0
    with torch.no_grad():
        for text in contexts:
            ids = torch.tensor([encode_text(tokenizer, text) + [eos] + encode_text(tokenizer, "i think that it")])
            L = ids.size(1)
            history = L - 4
            plain = torch.log_softmax(bundled.model(ids).logits[0, history - 1 :].float(), -1)
            logits, _ = pipeline.full_forward(pipeline.split.hidden_at_split(ids), history)
            cocon = torch.log_softmax(logits[0], -1)
            kls.append(float((plain.exp() * (plain - cocon)).sum(-1).mean()))
            agree += int((plain.argmax(-1) == cocon.argmax(-1)).sum())
            total += plain.size(0)
    mean_kl = sum(kls) / len(kls)
    assert mean_kl < 0.15, f"mean KL(plain || cocon without content) = {mean_kl:.3f}"
    assert agree / total >= 0.75, f"top-1 agreement {agree}/{total}"


def test_empty_content_stays_close_after_a_long_history(bundled_pipeline):
    """Chat prompts run to hundreds of tokens: the block must stay close to the plain
    model there too (a block trained on short histories alone drifts far from it)."""
    from chatcore.conversation import build_prompt
    from chatcore.evaluation.prompts import chitchat_heldout

    bundled, pipeline = bundled_pipeline
    tokenizer, eos = bundled.tokenizer, bundled.eos_token_id

    def longest(contexts: list, count: int) -> list[tuple[int, list[int], list[int]]]:
        rows = []
        for context in contexts:
            reply = (encode_text(tokenizer, context.reference or "") + [eos])[:48]
            budget = bundled.max_positions - len(reply)
            prompt = build_prompt([encode_text(tokenizer, turn) for turn in context.turns], eos, budget).token_ids
            rows.append((len(prompt), prompt, reply))
        return sorted(rows, key=lambda row: row[0])[-count:]

    # The longest of the benchmark's 6-turn prompts, and prompts of long conversations
    # that fill most of the model's positions (there the block shipped before drifted to KL 1.3).
    for rows, shortest, limit in (
        (longest(chitchat_heldout()[:100], 8), 200, 0.1),
        (longest(chitchat_heldout(40), 8), 420, 0.2),
    ):
        assert rows[0][0] >= shortest, [length for length, _, _ in rows]
        kls = []
        with torch.no_grad():
            for length, prompt, reply in rows:
                ids = torch.tensor([prompt + reply])
                plain = torch.log_softmax(bundled.model(ids).logits[0, length - 1 : -1].float(), -1)
                logits, _ = pipeline.full_forward(pipeline.split.hidden_at_split(ids), length)
                cocon = torch.log_softmax(logits[0, :-1], -1)
                kls.append(float((plain.exp() * (plain - cocon)).sum(-1).mean()))
        mean_kl = sum(kls) / len(kls)
        assert mean_kl < limit, f"mean KL(plain || cocon without content) after {rows[0][0]}+ tokens = {mean_kl:.3f}"


def test_content_raises_the_content_word_with_the_bundled_block(bundled_pipeline):
    """A one-word content makes that word more likely mid-reply, more so as tau grows."""
    bundled, pipeline = bundled_pipeline
    tokenizer, eos = bundled.tokenizer, bundled.eos_token_id
    ratios = []
    for word in (" music", " dog", " pizza"):
        token = encode_text(tokenizer, word)[0]
        for context in ("what did you do this weekend?", "hi, how are you?"):
            reply_start = encode_text(tokenizer, context) + [eos]
            ids = torch.tensor([reply_start + encode_text(tokenizer, "i really like")])
            with torch.no_grad():
                alpha_hidden = pipeline.split.hidden_at_split(ids)
                null = float(torch.softmax(pipeline.full_forward(alpha_hidden, len(reply_start))[0][0, -1], -1)[token])
                probabilities = []
                for tau in (-2.0, 0.0, 2.0):
                    content = pipeline.encode_content([[token]], [tau])
                    logits, _ = pipeline.full_forward(
                        alpha_hidden, len(reply_start), content.keys, content.values, content.bias
                    )
                    probabilities.append(float(torch.softmax(logits[0, -1], -1)[token]))
            assert probabilities == sorted(probabilities), (word, context, probabilities)
            ratios.append(probabilities[1] / null)
    assert sum(ratios) / len(ratios) > 1.5, ratios


# The shape of a CoCon run small enough for a test: every loss active from the first step.
TINY_RUN = dict(
    batch_size=4,
    history_tokens=8,
    continuation_tokens=6,
    cycle_tokens=3,
    cycle_batch_size=2,
    cycle_from_step=1,
    adv_from_step=1,
    disc_every=1,
    eval_every=2,
    eval_windows=4,
)


# -- training ---------------------------------------------------------------------------------


def test_training_writes_a_loadable_block_and_resumes(loaded, tiny_model_dir, tmp_path):
    from chatcore.plugins.cocon.training import CoconTrainConfig, train_cocon

    corpus = tmp_path / "dialogues.jsonl"
    lines = [
        {
            "turns": [
                "hi there, how are you doing today?",
                "i am fine thanks, and you? what are you up to",
                "not much, just cooking some pasta for dinner tonight",
                "sounds great, enjoy your meal",
            ]
        }
    ]
    corpus.write_text("\n".join(json.dumps(line) for line in lines * 6) + "\n")
    config = dict(
        out_dir=str(tmp_path / "run"),
        model=str(tiny_model_dir),
        corpus=str(corpus),
        heldout=0.0,
        **TINY_RUN,
        warmup_steps=1,
        no_history_share=0.5,
        min_history_tokens=3,
        plain_target=0.5,
        device="cpu",
    )
    result = train_cocon(CoconTrainConfig(steps=2, **config), progress=False)
    assert result.steps == 2 and set(result.heldout) == {"plain", "null", "self", "word", "null_kl"}
    assert result.heldout["null_kl"] >= 0.0
    block, info = load_block(result.block_dir)
    assert info["base_model"]["fingerprint"] == model_fingerprint(loaded.model, loaded.tokenizer)
    assert info["block"]["split_layer"] == 1 and info["training"]["steps"] == 2
    resumed = train_cocon(CoconTrainConfig(steps=3, **config), resume=True, progress=False)
    assert resumed.steps == 3


class _Stop(Exception):
    """Raised in the middle of a training run, as a crash or a kill would end it."""


def test_an_interrupted_run_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch):
    """Stopped after its first checkpoint and resumed, a run ends with the very weights of a
    run never stopped: the checkpoint restores the step, the scheduler, the window generator
    and the random state (the block's dropout draws from it)."""
    from safetensors.torch import load_file

    from chatcore.plugins.cocon.losses import CoconLosses
    from chatcore.plugins.cocon.training import CoconTrainConfig, train_cocon
    from chatcore.training.accelerated import read_progress

    corpus = tmp_path / "dialogues.jsonl"
    turns = ["hi, how was the weekend?", "great, we went hiking in the hills", "nice, was it cold up there", "a bit"]
    corpus.write_text((json.dumps({"turns": turns}) + "\n") * 6)
    config = dict(
        model=str(tiny_model_dir),
        corpus=str(corpus),
        heldout=0.0,
        steps=4,
        **TINY_RUN,
        warmup_steps=2,
        dropout=0.1,
        device="cpu",
    )
    whole = train_cocon(CoconTrainConfig(out_dir=str(tmp_path / "whole"), **config), progress=False)

    batches = []
    original = CoconLosses.__call__

    def stop_at_the_fourth_batch(self, *args, **kwargs):
        batches.append(1)
        if len(batches) == 4:
            raise _Stop
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CoconLosses, "__call__", stop_at_the_fourth_batch)
    cut = CoconTrainConfig(out_dir=str(tmp_path / "cut"), **config)
    with pytest.raises(_Stop):
        train_cocon(cut, progress=False)
    checkpoint = tmp_path / "cut" / "checkpoint"
    assert read_progress(checkpoint)["step"] == 2
    assert torch.load(checkpoint / "scheduler.bin", weights_only=False)["last_epoch"] == 2
    saved_rng = torch.load(checkpoint / "random_states_0.pkl", weights_only=False)["torch_manual_seed"]

    rng_at_start = []

    def record_the_rng(self, *args, **kwargs):
        if not rng_at_start:
            rng_at_start.append(torch.get_rng_state())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CoconLosses, "__call__", record_the_rng)
    resumed = train_cocon(cut, resume=True, progress=False)
    assert resumed.steps == 4 and torch.equal(rng_at_start[0], saved_rng)
    for name in ("model.safetensors", "model_1.safetensors"):  # the block, the discriminator
        ours, theirs = load_file(checkpoint / name), load_file(tmp_path / "whole" / "checkpoint" / name)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[key], theirs[key]) for key in ours), name
    assert resumed.heldout == whole.heldout


def cooking_run(tiny_model_dir, tmp_path, steps: int = 4, warmup_steps: int = 2) -> dict:
    """``train cocon`` settings for a few steps of the tiny model on a corpus of one dialogue about
    cooking, written into ``tmp_path``."""
    corpus = tmp_path / "dialogues.jsonl"
    turns = ["what did you cook today?", "a curry with lentils and rice", "sounds spicy", "only a little"]
    corpus.write_text((json.dumps({"turns": turns}) + "\n") * 6)
    return dict(
        model=str(tiny_model_dir), corpus=str(corpus), heldout=0.0, steps=steps, **TINY_RUN, warmup_steps=warmup_steps,
        device="cpu",
    )  # fmt: skip


def test_resuming_a_damaged_or_other_run_is_one_line_naming_what_differs(tiny_model_dir, tmp_path):
    """The checkpoint is written whole (a stop leaves the previous one); a damaged one, or one of
    a block of other settings, is refused naming the folder or the setting."""
    from chatcore.plugins.cocon.training import CoconTrainConfig, train_cocon

    config = CoconTrainConfig(out_dir=str(tmp_path / "run"), **cooking_run(tiny_model_dir, tmp_path, steps=2))
    train_cocon(config, progress=False)
    assert not list(tmp_path.glob("run/*.partial")) and (tmp_path / "run" / "block" / "cocon_config.json").is_file()
    other = CoconTrainConfig(**{**config.model_dump(), "dropout": 0.2, "steps": 3})
    with pytest.raises(ChatcoreError) as refused:
        train_cocon(other, resume=True, progress=False)
    assert "holds a block of other settings (dropout 0.1 -> 0.2): give the settings" in str(refused.value)
    assert "{" not in str(refused.value)
    optimizer = tmp_path / "run" / "checkpoint" / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:64])
    longer = CoconTrainConfig(**{**config.model_dump(), "steps": 3})
    with pytest.raises(ChatcoreError, match=r"checkpoint in .*run/checkpoint is damaged and cannot be read"):
        train_cocon(longer, resume=True, progress=False)


def test_a_heldout_split_too_short_for_a_window_is_named(tiny_model_dir, tmp_path):
    from chatcore.plugins.cocon.training import CoconTrainConfig, train_cocon

    corpus = tmp_path / "short.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "turns": ["hi", "yo"]}) + "\n" for i in range(60)))
    settings = {**cooking_run(tiny_model_dir, tmp_path), "corpus": str(corpus), "heldout": 0.05}
    with pytest.raises(ChatcoreError) as refused:
        train_cocon(CoconTrainConfig(out_dir=str(tmp_path / "run"), **settings), progress=False)
    message = str(refused.value)
    assert message.startswith("the held-out split (--heldout 0.05) has ") and "too few for one window of 14" in message
    assert message.endswith("give a larger --heldout or a longer corpus")


def test_training_in_chunks_equals_one_run(tiny_model_dir, tmp_path):
    """Two invocations (--run-steps 3, then --resume) end with the weights, optimizer states and
    held-out losses of one uncut run: the chunk stops off an evaluation step with a checkpoint."""
    from safetensors.torch import load_file

    from chatcore.plugins.cocon.training import CoconTrainConfig, train_cocon
    from chatcore.training.accelerated import read_progress

    config = cooking_run(tiny_model_dir, tmp_path)
    whole = train_cocon(CoconTrainConfig(out_dir=str(tmp_path / "whole"), **config), progress=False)
    first = train_cocon(CoconTrainConfig(out_dir=str(tmp_path / "cut"), run_steps=3, **config), progress=False)
    assert first.steps == 3 and read_progress(tmp_path / "cut" / "checkpoint")["step"] == 3
    second = train_cocon(
        CoconTrainConfig(out_dir=str(tmp_path / "cut"), run_steps=3, **config), resume=True, progress=False
    )
    assert second.steps == 4 and second.heldout == whole.heldout
    ours, theirs = tmp_path / "cut" / "checkpoint", tmp_path / "whole" / "checkpoint"
    assert read_progress(ours)["history"] == read_progress(theirs)["history"]
    for name in ("model.safetensors", "model_1.safetensors"):  # the block, the discriminator
        mine, other = load_file(ours / name), load_file(theirs / name)
        assert mine.keys() == other.keys() and all(torch.equal(mine[key], other[key]) for key in mine), name
    for name in ("optimizer.bin", "optimizer_1.bin"):
        mine, other = (torch.load(folder / name, weights_only=False)["state"] for folder in (ours, theirs))
        assert all(torch.equal(mine[index][key], other[index][key]) for index in mine for key in mine[index]), name


def test_fine_tuning_starts_from_the_given_block(loaded, tiny_model_dir, tiny_block_dir, tmp_path):
    from chatcore.plugins.cocon.training import CoconTrainConfig, train_cocon

    corpus = tmp_path / "dialogues.jsonl"
    lines = [
        {
            "turns": [
                "do you like to cook pasta at home?",
                "yes, i cook pasta every sunday with my kids",
                "that sounds lovely, what sauce do you make",
                "mostly tomato and basil from the garden",
            ]
        }
    ]
    corpus.write_text("\n".join(json.dumps(line) for line in lines * 6) + "\n")
    config = dict(
        model=str(tiny_model_dir),
        corpus=str(corpus),
        heldout=0.0,
        batch_size=4,
        history_tokens=8,
        continuation_tokens=6,
        cycle_weight=0.0,
        adv_weight=0.0,
        eval_every=1,
        eval_windows=4,
        warmup_steps=0,
        short_content_share=1.0,
        span_weight=4.0,
        learning_rate=1e-8,
        dropout=0.0,
        device="cpu",
    )
    start, _ = load_block(tiny_block_dir)
    tuned = train_cocon(
        CoconTrainConfig(out_dir=str(tmp_path / "tuned"), init_block=str(tiny_block_dir), steps=1, **config),
        progress=False,
    )
    fresh = train_cocon(CoconTrainConfig(out_dir=str(tmp_path / "fresh"), steps=1, **config), progress=False)
    tuned_block, tuned_info = load_block(tuned.block_dir)
    fresh_block, fresh_info = load_block(fresh.block_dir)
    _, start_info = load_block(tiny_block_dir)
    assert tuned_info["training"]["init_block_training"] == start_info["training"]  # its history is kept
    assert "init_block_training" not in fresh_info["training"]
    weight = "mlp_in.weight"
    assert torch.allclose(tuned_block.state_dict()[weight].float(), start.state_dict()[weight].float(), atol=1e-3)
    assert not torch.allclose(fresh_block.state_dict()[weight].float(), start.state_dict()[weight].float(), atol=1e-3)


def test_the_span_weight_weighs_the_content_positions():
    from chatcore.plugins.cocon.losses import lm_loss, weighted_lm_loss

    torch.manual_seed(0)
    logits, targets = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    assert torch.allclose(weighted_lm_loss(logits, targets, torch.ones(2, 5)), lm_loss(logits, targets))
    weights = torch.ones(2, 5)
    weights[0, 2] = 4.0
    each = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), reduction="none")
    expected = (each.sum() + 3 * each[2]) / 13
    assert torch.allclose(weighted_lm_loss(logits, targets, weights), expected)


def test_the_plain_target_mixes_the_text_with_the_plain_models_distribution():
    from chatcore.plugins.cocon.losses import mixed_lm_loss, weighted_lm_loss

    torch.manual_seed(0)
    logits, targets = torch.randn(2, 5, 11, requires_grad=True), torch.randint(0, 11, (2, 5))
    weights = torch.ones(2, 5)
    weights[1, 3] = 4.0
    teacher = torch.softmax(torch.randn(2, 5, 11), -1)
    text_only = mixed_lm_loss(logits, targets, weights, teacher, torch.zeros(2, 5))
    assert torch.allclose(text_only, weighted_lm_loss(logits, targets, weights))
    one_hot = torch.nn.functional.one_hot(targets, 11).float()
    assert torch.allclose(mixed_lm_loss(logits, targets, weights, one_hot, torch.ones(2, 5)), text_only)
    half = mixed_lm_loss(logits, targets, weights, teacher, torch.full((2, 5), 0.5))
    assert torch.allclose(
        half, 0.5 * text_only + 0.5 * mixed_lm_loss(logits, targets, weights, teacher, torch.ones(2, 5))
    )
    # With the teacher's own distribution as the target, the loss is at its minimum: no gradient.
    own = torch.softmax(logits.detach(), -1)
    mixed_lm_loss(logits, targets, weights, own, torch.ones(2, 5)).backward()
    assert logits.grad is not None and logits.grad.abs().max() < 1e-6


def test_history_lengths_are_drawn_between_the_bounds(loaded, tiny_block_dir):
    from chatcore.plugins.cocon.losses import CoconLosses
    from chatcore.plugins.cocon.training import CoconTrainConfig

    block, _ = load_block(tiny_block_dir)
    pipeline = CoconPipeline(SplitModel(loaded.model, block.config.split_layer), block.float())
    generator = torch.Generator().manual_seed(0)
    fixed = CoconLosses(pipeline, CoconTrainConfig(out_dir="unused", history_tokens=40))
    assert {fixed.history_length(generator) for _ in range(20)} == {40}
    drawn = CoconLosses(pipeline, CoconTrainConfig(out_dir="unused", history_tokens=256, min_history_tokens=16))
    lengths = sorted(drawn.history_length(generator) for _ in range(2000))
    assert lengths[0] == 16 and lengths[-1] == 256
    assert 48 <= lengths[1000] <= 80  # log-uniform: the median is near sqrt(16 * 256) = 64
    with pytest.raises(ValueError, match="min_history_tokens"):
        CoconTrainConfig(out_dir="unused", history_tokens=32, min_history_tokens=64)
    with pytest.raises(ValueError, match="plain_target"):
        CoconTrainConfig(out_dir="unused", plain_target=1.5)


def test_train_cocon_command_is_registered():
    import click
    from click.testing import CliRunner

    from chatcore.cli.train import train
    from chatcore.plugins.cocon import plugin as cocon

    cli = click.Group()
    cocon.register_commands(cli)  # on its own: the train group comes with it
    assert cli.commands["train"] is train and "cocon" in train.commands
    result = CliRunner().invoke(train, ["cocon", "--help"])
    assert result.exit_code == 0
    for option in (
        "--cycle-from-step",
        "--adv-from-step",
        "--resume",
        "--device",
        "--null-weight",
        "--min-history-tokens",
        "--plain-target",
    ):
        assert option in result.output


# -- Llama-family models ------------------------------------------------------------------------

ARCHITECTURE_PLUGINS = COCON_PLUGINS + ("chatcore.plugins.mmi.plugin",)


@pytest.fixture(scope="module", params=("gpt2", "llama", "qwen2", "gemma"))
def family_model(request, tmp_path_factory):
    """A tiny random model of each family: 2 blocks, width 32, 4 heads (2 key-value heads)."""
    from chatcore.models import load_model
    from chatcore.testing import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp(f"cocon-{request.param}"), architecture=request.param, heads=4)
    return load_model(str(folder), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def family_block_dir(family_model, tmp_path_factory):
    split = SplitModel(family_model.model, 1)
    block = random_block(split.n_embd, split.n_head, 1)
    directory = tmp_path_factory.mktemp("family-block")
    save_block(
        block,
        directory,
        {"name": family_model.name, "fingerprint": model_fingerprint(family_model.model, family_model.tokenizer)},
        dtype="float32",
    )
    return directory


def test_alpha_then_beta_equals_the_plain_model_with_cache_and_left_padding(family_model):
    model, split = family_model.model, SplitModel(family_model.model, 1)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 400, (2, 10), generator=generator)
    valid = torch.ones(2, 10, dtype=torch.long)
    valid[1, :4] = 0
    positions = (valid.cumsum(-1) - 1).clamp(min=0)
    ours, theirs = split.new_cache(), split.new_cache()
    with torch.no_grad():
        for start, end in ((0, 6), (6, 7), (7, 8), (8, 10), (10, 10)):
            if start == end:
                break
            expected = model(
                input_ids=ids[:, start:end],
                attention_mask=valid[:, :end],
                position_ids=positions[:, start:end],
                **{cache_keyword(model): theirs},
                use_cache=True,
            ).logits
            embeddings = split.embed(positions[:, start:end], input_ids=ids[:, start:end])
            inputs = split.pass_inputs(embeddings, positions[:, start:end], valid[:, :end], ours)
            mine = split.head(split.beta(split.alpha(embeddings, inputs), inputs))
            real = valid[:, start:end].bool()
            torch.testing.assert_close(mine[real], expected[real], rtol=1e-4, atol=1e-4)


def test_cached_cocon_steps_equal_a_full_recompute_on_every_family(family_model):
    split = SplitModel(family_model.model, 1)
    pipeline = CoconPipeline(split, random_block(split.n_embd, split.n_head, 1))
    content = pipeline.encode_content([[11, 12, 13], [40]], [1.5, -0.5])
    sequences = torch.randint(5, 400, (2, 12), generator=torch.Generator().manual_seed(1))
    history, B = 5, 2
    with torch.no_grad():
        output = pipeline.forward(
            torch.ones(B, history),
            torch.arange(history).expand(B, -1),
            history,
            content,
            input_ids=sequences[:, :history],
        )
        cached = [output.logits]
        for position in range(history, 11):
            output = pipeline.forward(
                torch.ones(B, position + 1),
                torch.full((B, 1), position),
                history,
                content,
                input_ids=sequences[:, position : position + 1],
                cache=output.cache,
            )
            cached.append(output.logits)
        full, _ = pipeline.full_forward(
            split.hidden_at_split(sequences[:, :-1]),
            history,
            content.keys.expand(B, -1, -1, -1),
            content.values.expand(B, -1, -1, -1),
            content.bias,
        )
    torch.testing.assert_close(torch.stack(cached, dim=1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("history_tokens", [0, 5])
def test_groups_of_rows_with_their_own_contents_in_one_pass_equal_a_pass_per_group(family_model, history_tokens):
    """The self, null and cycle passes of a batch run as one: each group's logits and the
    block's gradients are those of a pass of its own (contents of other lengths, no content,
    a self-token bias, fewer rows)."""
    from chatcore.plugins.cocon.history import read_history
    from chatcore.plugins.cocon.losses import self_token_bias
    from chatcore.plugins.cocon.pipeline import RowGroup

    model = copy.deepcopy(family_model.model).requires_grad_(False)
    split = SplitModel(model, 1)
    block = random_block(split.n_embd, split.n_head, 1).eval()
    pipeline = CoconPipeline(split, block)
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(5, 400, (4, 9), generator=generator)
    alpha_hidden, history = read_history(split, ids, history_tokens)
    queries = 9 - history_tokens + 1 if history_tokens else 9
    with torch.no_grad():
        contents = [
            split.hidden_at_split(torch.randint(5, 400, (rows, n), generator=generator)) for rows, n in ((4, 3), (2, 5))
        ]

    def groups() -> list[RowGroup]:
        keys, values = block.content_keys_values(contents[0])
        other_keys, other_values = block.content_keys_values(contents[1])
        bias = self_token_bias(queries, 1, 3, keys.dtype, keys.device)
        return [
            RowGroup(alpha_hidden, keys, values, bias),
            RowGroup(alpha_hidden),
            RowGroup(alpha_hidden[:2], other_keys, other_values),
        ]

    def gradients(logits: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        block.zero_grad(set_to_none=True)
        sum((index + 1) * part.log_softmax(-1)[..., 7].sum() for index, part in enumerate(logits)).backward()
        return {name: p.grad.clone() for name, p in block.named_parameters() if p.grad is not None}

    together = pipeline.full_forward_groups(groups(), history_tokens, history)
    grads_together = gradients(together)
    alone = []
    for group in groups():
        part = None if history is None else history.first(group.rows)
        alone.append(
            pipeline.full_forward(group.alpha_hidden, history_tokens, group.keys, group.values, group.bias, part)[0]
        )
    grads_alone = gradients(alone)
    assert (
        [t.shape for t in together]
        == [a.shape for a in alone]
        == [(4, queries, together[0].size(-1))] * 2 + [(2, queries, together[0].size(-1))]
    )
    for mine, reference in zip(together, alone):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-5)
    assert grads_together.keys() == grads_alone.keys() and grads_together
    for name in grads_together:
        torch.testing.assert_close(grads_together[name], grads_alone[name], rtol=1e-3, atol=1e-5, msg=name)


def test_the_cycle_generation_reads_its_tokens_states_as_constants(family_model):
    """As in the paper's training, each generated token's LM-alpha states are read by the next
    step without gradients (no backward through LM-alpha per generated token); the soft
    embeddings themselves keep theirs, and the block's weights get the cycle loss's gradient."""
    from chatcore.plugins.cocon.losses import CoconLosses
    from chatcore.plugins.cocon.training import CoconTrainConfig

    model = copy.deepcopy(family_model.model).requires_grad_(False)  # frozen, as in training
    split = SplitModel(model, 1)
    block = random_block(split.n_embd, split.n_head, 1).eval()
    config = CoconTrainConfig(out_dir="unused", history_tokens=6, continuation_tokens=4, cycle_tokens=3)
    losses = CoconLosses(CoconPipeline(split, block), config)
    alpha_outputs: list[bool] = []
    handle = split.anatomy.block(0).register_forward_hook(
        lambda module, args, output: alpha_outputs.append(
            (output[0] if isinstance(output, tuple) else output).requires_grad
        )
    )
    try:
        with torch.enable_grad():
            ids = torch.randint(5, 400, (2, 6), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                content = split.hidden_at_split(ids[:, :3])
            alpha_outputs.clear()
            keys, values = block.content_keys_values(content)
            embeddings, steered = losses.generate_soft(ids, keys, values, 3)
    finally:
        handle.remove()
    assert alpha_outputs == [False, False, False]  # the history (no gradient there), then 2 fed-back tokens
    assert embeddings.requires_grad and steered.requires_grad
    embeddings.square().sum().backward()
    assert block.sequence_qkv.weight.grad is not None and block.sequence_qkv.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("plain_target", [0.0, 0.3])
def test_the_history_read_once_gives_the_losses_and_gradients_of_whole_windows(family_model, plain_target, monkeypatch):
    """Every training pass reads the batch's history from one cache (LM-beta runs over the
    rewritten positions alone): each loss, the generated states and the block's gradients
    equal those of passes over the whole windows, on every family."""
    from chatcore.plugins.cocon import history as history_module
    from chatcore.plugins.cocon import losses as losses_module
    from chatcore.plugins.cocon.training import CoconTrainConfig

    model = copy.deepcopy(family_model.model)
    with torch.no_grad():  # sharper attention than a fresh init's, so that positions tell
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and "embed" not in name and "wte" not in name and "wpe" not in name:
                parameter.mul_(4.0)
    split = SplitModel(model, 1)
    block = random_block(split.n_embd, split.n_head, 1).train()  # no dropout: content masking still draws
    config = CoconTrainConfig(
        out_dir="unused",
        history_tokens=9,
        continuation_tokens=5,
        cycle_tokens=3,
        cycle_batch_size=3,
        no_history_share=0.0,
        plain_target=plain_target,
    )
    losses = losses_module.CoconLosses(CoconPipeline(split, block), config)
    windows = torch.randint(5, 400, (4, 14), generator=torch.Generator().manual_seed(1))
    read = []

    def run() -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
        block.zero_grad(set_to_none=True)
        result = losses(windows, torch.Generator().manual_seed(3), with_cycle=True, with_adv=True)
        assert result.fake is not None
        (sum(result.losses.values()) + result.fake.square().mean()).backward()
        grads = {
            name: parameter.grad.clone() for name, parameter in block.named_parameters() if parameter.grad is not None
        }
        return {name: loss.detach() for name, loss in result.losses.items()}, result.fake.detach(), grads

    def recorded(split_model, input_ids, history_length):
        alpha_hidden, history = history_module.read_history(split_model, input_ids, history_length)
        read.append(history)
        return alpha_hidden, history

    for seed in range(3):  # short and whole contents
        torch.manual_seed(seed)
        monkeypatch.setattr(losses_module, "read_history", recorded)
        once, fake_once, grads_once = run()
        assert read[-1] is not None or family_model.model.config.model_type == "gemma"
        monkeypatch.setattr(losses_module, "read_history", lambda s, ids, hs: (s.hidden_at_split(ids), None))
        whole, fake_whole, grads_whole = run()
        assert once.keys() == whole.keys() == {"self", "null", "cycle"}
        for name in once:
            torch.testing.assert_close(once[name], whole[name], rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(fake_once, fake_whole, rtol=1e-4, atol=1e-5)
        assert grads_once.keys() == grads_whole.keys() and grads_once
        for name in grads_once:
            torch.testing.assert_close(grads_once[name], grads_whole[name], rtol=1e-3, atol=1e-5, msg=name)


def test_cocon_replies_on_every_family_under_greedy_top_k_and_mmi(family_model, family_block_dir):
    from chatcore.testing import make_engine

    engine = make_engine(family_model, *ARCHITECTURE_PLUGINS[2:])
    cocon = ("cocon", {"content": "pizza", "tau": "2", "block": str(family_block_dir)})
    replies = {}
    # The bundled reverse model reads the chat-template families' replies through text.
    mmi = {"candidates": 2, "allow_retokenize": True}
    for decoder, settings in (("greedy", {}), ("top-k", {}), ("mmi", mmi)):
        for steerers in ([], [cocon]):
            response = engine.send(
                engine.conversation(),
                "what should we eat?",
                ReplyOptions(
                    decoder=decoder,
                    decoder_settings=settings,
                    steerers=steerers,
                    seed=3,
                    min_new_tokens=5,
                    max_new_tokens=5,
                ),
            )
            response.text()
            assert len(response.token_ids) == 5
            replies[decoder, bool(steerers)] = response.token_ids
        assert response.provenance["details"]["cocon"]["split_layer"] == 1
    assert replies["greedy", True] != replies["greedy", False]  # the (random) block changes the reply


def test_train_cocon_on_a_tiny_llama_runs_the_command_the_reply_error_names(tmp_path):
    import shlex

    import click
    from click.testing import CliRunner

    from chatcore.cli.train import train
    from chatcore.models import load_model
    from chatcore.plugins.cocon import plugin as cocon
    from chatcore.testing import CHATML_TEMPLATE, build_tiny_model, make_engine

    folder = build_tiny_model(
        tmp_path / "llama", architecture="llama", layers=3, heads=4, chat_template=CHATML_TEMPLATE
    )  # trained on windows rendered in its template
    loaded = load_model(str(folder), device="cpu", dtype="float32")
    engine = make_engine(loaded, *COCON_PLUGINS[2:])
    with pytest.raises(BlockMismatchError) as refused:
        engine.send(engine.conversation(), "hi", ReplyOptions(steerers=[("cocon", {"content": "pizza"})])).text()
    command = str(refused.value).split("`")[1]  # chatcore train cocon --model FOLDER --out DIR
    assert command.startswith("chatcore train cocon --model ")
    corpus = tmp_path / "dialogues.jsonl"
    lines = [
        {
            "turns": [
                "hi there, how are you doing today?",
                "i am fine thanks, and you? what are you up to",
                "not much, just cooking some pasta for dinner tonight",
                "sounds great, enjoy your meal",
            ]
        }
    ]
    corpus.write_text("\n".join(json.dumps(line) for line in lines * 6) + "\n")
    arguments = shlex.split(command.replace("DIR", str(tmp_path / "run")))[2:] + [
        "--corpus",
        str(corpus),
        "--heldout",
        "0",
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--history-tokens",
        "8",
        "--min-history-tokens",
        "2",
        "--continuation-tokens",
        "6",
        "--cycle-from-step",
        "1",
        "--adv-from-step",
        "1",
        "--cycle-tokens",
        "3",
        "--plain-target",
        "0.5",
        "--eval-every",
        "3",
        "--device",
        "cpu",
        "--quiet",
    ]
    cocon.register_commands(click.Group())
    result = CliRunner().invoke(train, arguments)
    assert result.exit_code == 0, result.output
    assert "3 steps" in result.output
    block, info = load_block(tmp_path / "run" / "block")
    assert (block.config.n_embd, block.config.n_head, block.config.split_layer) == (32, 4, 1)
    assert info["base_model"]["fingerprint"]["n_layer"] == 3
    assert info["base_model"]["fingerprint"]["model_type"] == "llama"
    response = engine.send(
        engine.conversation(),
        "what should we eat?",
        ReplyOptions(
            decoder="greedy",
            max_new_tokens=4,
            min_new_tokens=4,
            steerers=[("cocon", {"content": "pasta", "block": str(tmp_path / "run" / "block")})],
        ),
    )
    response.text()
    assert len(response.token_ids) == 4


def test_dialogues_are_rendered_as_chat_prompts_with_the_reply_starts(tmp_path):
    from chatcore.models import load_model
    from chatcore.plugins.cocon.windows import CONVERSATION_TURNS, render_dialogues
    from chatcore.prompting import scripted_messages
    from chatcore.testing import CHATML_TEMPLATE, build_tiny_model
    from chatcore.training.corpus import Dialogue
    from chatcore.training.formats import prompt_format_for

    folder = build_tiny_model(tmp_path / "qwen2", architecture="qwen2", chat_template=CHATML_TEMPLATE)
    loaded = load_model(str(folder), device="cpu")
    prompt_format = prompt_format_for("auto", loaded.model, loaded.tokenizer, "tiny")
    assert prompt_format.name == "chat-template"
    turns = [f"turn number {index} <|im_start|>" for index in range(9)]
    stream, starts = render_dialogues([Dialogue(id="d", turns=turns)], prompt_format)
    # 9 turns: a conversation of 7 turns (the first the bot's, as in a 6-turn scripted context;
    # replies at turns 2, 4 and 6), then one of 2 (a reply at turn 8)
    assert CONVERSATION_TURNS == 7 and len(starts) == 4 and starts.tolist() == sorted(starts.tolist())
    first = prompt_format.render(scripted_messages(turns[:2]))
    assert stream[: len(first)].tolist() == first and int(starts[0]) == len(first)
    reply = prompt_format.encode_text(turns[2]) + [prompt_format.end_of_reply_id]
    assert stream[len(first) : len(first) + len(reply)].tolist() == reply  # the typed marker stays text
    last = prompt_format.render(scripted_messages(turns[7:8]))
    assert stream[int(starts[3]) - len(last) : int(starts[3])].tolist() == last
    assert stream[-1] == prompt_format.end_of_reply_id


@pytest.mark.slow
def test_cocon_on_smollm2_splits_exactly_and_replies_with_a_fresh_block(smollm2, tmp_path):
    """SmolLM2 (a Llama, 30 blocks, width 576, 9 heads of 64): alpha then beta gives its own
    logits on a chat prompt, and a block of its shape replies through its chat template."""
    from chatcore.testing import make_engine

    split = SplitModel(smollm2.model, 10)
    ids = torch.tensor(
        [
            smollm2.tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi, how are you?"}], add_generation_prompt=True, return_dict=False
            )
        ]
    )
    with torch.no_grad():
        embeddings = split.embed(torch.arange(ids.size(1))[None], input_ids=ids)
        inputs = split.pass_inputs(embeddings)
        mine = split.head(split.beta(split.alpha(embeddings, inputs), inputs))
        torch.testing.assert_close(mine, smollm2.model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    block = CoconBlock(CoconConfig(n_embd=split.n_embd, n_head=split.n_head, split_layer=10, dropout=0.0))
    assert block.head_dim == 64
    save_block(block, tmp_path, {"name": "smollm2", "fingerprint": model_fingerprint(smollm2.model, smollm2.tokenizer)})
    engine = make_engine(smollm2, *COCON_PLUGINS[2:])
    response = engine.send(
        engine.conversation(),
        "what should we eat?",
        ReplyOptions(
            decoder="greedy",
            max_new_tokens=4,
            min_new_tokens=4,
            steerers=[("cocon", {"content": "pizza", "block": str(tmp_path)})],
        ),
    )
    assert response.text() and len(response.token_ids) == 4
    assert response.provenance["details"]["cocon"]["split_layer"] == 10


@pytest.mark.slow
def test_the_compiled_halves_compute_what_the_eager_ones_do(loaded):
    """``--compile``: LM-beta through torch.compile (LM-alpha is compiled the same way, through
    the same code) gives the eager half's hidden states and the gradients a training step
    takes through it, over a window and then one token after it from the cache."""
    import shutil

    from chatcore.plugins.cocon.compiled import CompiledHalf
    from chatcore.plugins.cocon.model_split import SplitModel

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("torch.compile on the CPU needs a C++ compiler")
    eager, compiled = SplitModel(loaded.model, 1), SplitModel(loaded.model, 1)
    compiled.beta = CompiledHalf(compiled.beta)  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, loaded.model.config.vocab_size, (2, 7), generator=generator)
    results = []
    for split in (eager, compiled):
        cache = split.new_cache()
        positions = torch.arange(6).expand(2, -1)
        embedded = split.embed(positions, input_ids=ids[:, :6])
        inputs = split.pass_inputs(embedded, positions, cache=cache)
        hidden = split.alpha(embedded, inputs).detach().requires_grad_(True)
        window = split.beta(hidden, inputs)
        step = split.embed(positions[:, -1:] + 1, input_ids=ids[:, 6:])  # one token after them, from the cache
        step_inputs = split.pass_inputs(step, positions[:, -1:] + 1, cache=cache)
        last = split.beta(split.alpha(step, step_inputs), step_inputs)
        loss = split.head(window).logsumexp(-1).sum() + split.head(last).logsumexp(-1).sum()
        (gradient,) = torch.autograd.grad(loss, hidden)
        results.append((window.detach(), last.detach(), gradient))
    if compiled.beta.compiled is None:
        pytest.skip("torch.compile could not compile the halves on this machine")
    assert compiled.beta.calls == 2
    for ours, theirs in zip(results[1], results[0]):
        assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_training_with_compile_runs_the_halves_through_it(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """``train cocon --compile`` sends every pass of the frozen model through the compiled halves
    (here torch.compile hands the function back as it is, so the run equals one without);
    where compiling fails, one warning, and the run goes on uncompiled with the same result."""

    from chatcore.plugins.cocon import compiled
    from chatcore.plugins.cocon.training import CoconTrainConfig, train_cocon

    config = cooking_run(tiny_model_dir, tmp_path, steps=2, warmup_steps=1)
    plain = train_cocon(CoconTrainConfig(out_dir=str(tmp_path / "plain"), **config), progress=False)
    halves: list[compiled.CompiledHalf] = []
    made = compiled.CompiledHalf.__init__

    def noted(self, eager, warned=None):
        made(self, eager, warned)
        halves.append(self)

    monkeypatch.setattr(compiled.CompiledHalf, "__init__", noted)
    monkeypatch.setattr(torch, "compile", lambda function, **settings: function)
    same = train_cocon(CoconTrainConfig(out_dir=str(tmp_path / "same"), compile=True, **config), progress=False)
    assert same.heldout == plain.heldout and len(halves) == 2 and all(half.calls > 0 for half in halves)

    def broken(function, **settings):
        def run(*arguments, **keywords):
            raise RuntimeError(
                "no working C++ compiler\n\nSet TORCHDYNAMO_VERBOSE=1 for the internal stack trace"
            )  # torch's advice: left out

        return run

    monkeypatch.setattr(torch, "compile", broken)
    caplog.clear()
    assert trained_uncompiled(config, tmp_path, caplog) == (plain.heldout, "RuntimeError: no working C++ compiler")


def trained_uncompiled(config, tmp_path, caplog) -> tuple[dict, str]:
    """``train cocon --compile`` where compiling fails (as the test made torch.compile): the
    held-out losses it ends with, and the error its one warning names (after the compiling line)."""
    import logging

    from chatcore.plugins.cocon import compiled
    from chatcore.plugins.cocon.training import CoconTrainConfig, train_cocon

    with caplog.at_level(logging.WARNING, logger=compiled.__name__):
        fallen = train_cocon(CoconTrainConfig(out_dir=str(tmp_path / "fallen"), compile=True, **config), progress=False)
    first, warned = (record.getMessage() for record in caplog.records if record.name == compiled.__name__)
    assert first == compiled.COMPILING
    return fallen.heldout, warned.removeprefix(
        "cocon: compiling the frozen model's halves failed, running them uncompiled: "
    )


def test_ctrl_c_ends_training_after_its_step_with_a_checkpoint_resume_continues(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """The first Ctrl-C (SIGINT) stops ``train cocon`` after the step under way, as a chunk's
    end does: a checkpoint, and ``--resume`` ends with the uncut run's block."""
    import signal

    from safetensors.torch import load_file

    from chatcore.plugins.cocon import losses as module
    from chatcore.plugins.cocon.training import CoconTrainConfig, train_cocon
    from chatcore.training.accelerated import read_progress

    config = cooking_run(tiny_model_dir, tmp_path)
    whole = train_cocon(CoconTrainConfig(out_dir=str(tmp_path / "whole"), **config), progress=False)
    calls = []
    losses = module.CoconLosses

    class Interrupted(losses):  # the user presses Ctrl-C during the second step
        def __call__(self, *arguments, **keywords):
            calls.append(1)
            if len(calls) == 2:
                signal.raise_signal(signal.SIGINT)
            return super().__call__(*arguments, **keywords)

    monkeypatch.setattr(module, "CoconLosses", Interrupted)
    first = train_cocon(CoconTrainConfig(out_dir=str(tmp_path / "cut"), **config), progress=False)
    assert first.steps == 2 and read_progress(tmp_path / "cut" / "checkpoint")["step"] == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    monkeypatch.setattr(module, "CoconLosses", losses)
    capsys.readouterr()
    second = train_cocon(CoconTrainConfig(out_dir=str(tmp_path / "cut"), **config), resume=True, progress=False)
    assert second.steps == 4 and second.heldout == whole.heldout
    mine, theirs = (load_file(tmp_path / run / "checkpoint" / "model.safetensors") for run in ("cut", "whole"))
    assert all(torch.equal(mine[key], theirs[key]) for key in mine)
    assert "resuming with other settings" not in capsys.readouterr().err
    longer = {**config, "steps": 5, "batch_size": 2}  # not as the run started: said, then done as asked
    train_cocon(CoconTrainConfig(out_dir=str(tmp_path / "cut"), **longer), resume=True, progress=False)
    said = capsys.readouterr().err
    assert "chatcore: resuming with other settings than the run had: batch_size 4 -> 2, steps 4 -> 5" in said


def test_a_run_with_nothing_to_train_on_leaves_no_out_folder(tiny_model_dir, tmp_path):
    """A corpus whose one dialogue goes to the held-out split: the one-line error, and the run's
    folder, made for it, taken away again."""
    from click.testing import CliRunner

    from chatcore.cli import build_cli

    corpus = tmp_path / "one.jsonl"
    corpus.write_text(json.dumps({"turns": ["hi there", "hello"]}) + "\n")
    out = tmp_path / "run"
    arguments = ["train", "cocon", "--model", str(tiny_model_dir), "--corpus", str(corpus), "--out", str(out)]
    result = CliRunner().invoke(build_cli(), [*arguments, "--heldout", "0.5", "--device", "cpu", "--quiet"])
    assert result.exit_code == 1 and "the training split is empty" in result.stderr, result.output
    assert not out.exists()


def test_a_backward_that_fails_to_compile_reruns_the_step_uncompiled(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """``train cocon --compile``: the backward's kernels compile at the first backward, after a
    forward that worked. A failure there turns the halves uncompiled, with one warning, and the
    step runs again from its start: the run ends as one without ``--compile`` does."""

    from chatcore.plugins.cocon.training import CoconTrainConfig, train_cocon

    config = cooking_run(tiny_model_dir, tmp_path, steps=2, warmup_steps=1)
    plain = train_cocon(CoconTrainConfig(out_dir=str(tmp_path / "plain"), **config), progress=False)

    class FailingBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            return tensor.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("backward kernel failed to compile")

    def backward_fails(function, **settings):
        def run(*arguments, **keywords):
            hidden = function(*arguments, **keywords)
            return FailingBackward.apply(hidden) if hidden.requires_grad else hidden

        return run

    monkeypatch.setattr(torch, "compile", backward_fails)
    assert trained_uncompiled(config, tmp_path, caplog) == (
        plain.heldout,
        "RuntimeError: backward kernel failed to compile",
    )
