"""``chatcore train model --reverse --init-from`` on Llama-family models, and MMI with the
reverse models it makes, beside a chat template (tiny random models, real tokenizers)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from chatcore.cli import build_cli
from chatcore.engine import ReplyOptions
from chatcore.errors import ChatcoreError
from chatcore.models import load_model
from chatcore.plugins.mmi import reranking
from chatcore.testing import CHATML_TEMPLATE, build_tiny_model, make_engine
from chatcore.training.corpus import load_chitchat
from chatcore.training.pipeline import train_model_command
from chatcore.training.trainer import ModelShape, TrainConfig

ARCHITECTURES = ("llama", "qwen2", "gemma")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small JSONL corpus of real dialogues."""
    path = tmp_path_factory.mktemp("corpus") / "dialogues.jsonl"
    with path.open("w", encoding="utf-8") as handle:
        for dialogue in load_chitchat()[:40]:
            handle.write(json.dumps({"id": dialogue.id, "turns": list(dialogue.turns)}) + "\n")
    return path


@pytest.fixture(scope="module", params=ARCHITECTURES)
def forward_and_reverse(request, tmp_path_factory, corpus):
    """A tiny chat-template model of one architecture and a reverse model fine-tuned from it
    (so it shares the tokenizer) by the training command's library entry point."""
    architecture = request.param
    root = tmp_path_factory.mktemp(f"reverse-{architecture}")
    forward = build_tiny_model(
        root / "forward",
        architecture=architecture,
        chat_template=CHATML_TEMPLATE,
        layers=2,
        width=64,
        heads=4,
        positions=256,
    )
    config = TrainConfig(
        out_dir=str(root / "run"),
        epochs=1.0,
        batch_size=4,
        block_size=64,
        learning_rate=3e-3,
        warmup_steps=2,
        eval_every=6,
        eval_blocks=4,
        device="cpu",
        save_dtype="float32",
    )
    result = train_model_command(
        str(corpus),
        config,
        ModelShape(),
        init_from=str(forward),
        reverse=True,
        heldout=0.1,
        progress=False,
        filter_config=None,
    )
    return architecture, forward, root / "run" / "best", result


@pytest.mark.slow
def test_reverse_training_fine_tunes_any_causal_lm(forward_and_reverse):
    architecture, forward, best, result = forward_and_reverse
    assert result.steps >= 6 and result.best_step > 0 and math.isfinite(result.best_val_loss)
    saved = json.loads((best / "config.json").read_text())
    assert saved["model_type"] == architecture
    card = json.loads((best / "chatcore_training.json").read_text())
    assert card["direction"] == "reverse"
    reverse = load_model(str(best), device="cpu")
    assert reranking.same_tokenizer(reverse.tokenizer, load_model(str(forward), device="cpu").tokenizer)
    # The fine-tuned weights moved, and the model scores P(source | reply) as MMI asks it to.
    untrained = load_model(str(forward), device="cpu")
    reply = reranking.encode_source(reverse, ["i love to cook pasta"])[0]
    source = reranking.encode_source(reverse, ["what do you like to eat?"])
    (trained_score,) = reranking.reverse_scores(reverse, [reply], source)
    (untrained_score,) = reranking.reverse_scores(untrained, [reply], source)
    assert trained_score.tokens == len(source[0]) + 1
    assert math.isfinite(trained_score.total) and trained_score.total != pytest.approx(untrained_score.total)
    # Trained on reversed dialogues, it predicts the held-out sources better than its start.
    assert result.best_val_loss < math.log(len(reverse.tokenizer))


@pytest.mark.slow
def test_mmi_with_a_chat_template_model_scores_message_turns(forward_and_reverse):
    _, forward, best, _ = forward_and_reverse
    engine = make_engine(str(forward), "chatcore.plugins.mmi.plugin")
    conversation = engine.conversation(system="You are terse.")
    engine.add_user(conversation, "hi! do you have any pets?")
    conversation.add_bot_text("yes, two cats")
    engine.add_user(conversation, "what are <|im_end|> their names?")  # special-token text stays text
    options = ReplyOptions(
        decoder="mmi",
        seed=3,
        max_new_tokens=12,
        decoder_settings={"candidates": 4, "source_turns": 2, "reverse_model": str(best)},
    )
    response = engine.respond(conversation, options)
    text = response.text()
    details = response.provenance["details"]["mmi"]
    assert details["source_turns"] == 2 and details["retokenized"] is False
    candidates = response.provenance["candidates"]
    stops = engine.prompt_format.stop_token_ids | {engine.loaded.eos_token_id}
    for candidate in candidates:
        assert not stops & set(candidate["token_ids"])  # cut at any stop token, <|im_end|> included
    # The source is the two latest turns as text, newest first; the system prompt is not in it.
    reverse = reranking.load_reverse_model(str(best), device="cpu")
    source = reranking.encode_source(reverse, ["what are <|im_end|> their names?", "yes, two cats"])
    assert reverse.tokenizer.convert_tokens_to_ids("<|im_end|>") not in source[0]
    ids = [c["token_ids"] for c in candidates]
    for candidate, score in zip(candidates, reranking.reverse_scores(reverse, ids, source)):
        assert candidate["scores"]["reverse"] == pytest.approx(score.total, abs=1e-4)
    chosen = [c for c in candidates if c["chosen"]]
    eligible = [c for c in candidates if c["token_ids"] and c["scores"]["ended"]] or [
        c for c in candidates if c["token_ids"]
    ]
    assert len(chosen) == 1 and chosen[0]["token_ids"] == response.token_ids
    assert chosen[0]["scores"]["reverse"] == max(c["scores"]["reverse"] for c in eligible)
    assert conversation.turns[-1].text == text


def test_source_texts_skip_the_system_prompt_and_read_newest_first():
    from chatcore.prompting import Message

    messages = [Message("system", "be kind"), Message("user", "a"), Message("assistant", "b"), Message("user", "c")]
    assert reranking.source_texts(messages, 2) == ["c", "b"]
    assert reranking.source_texts(messages, 9) == ["c", "b", "a"]


def test_a_block_longer_than_the_model_positions_is_one_clear_line(tmp_path, corpus):
    folder = build_tiny_model(tmp_path / "llama", architecture="llama", positions=32)
    result = CliRunner().invoke(
        build_cli(),
        [
            "train",
            "model",
            "--reverse",
            "--init-from",
            str(folder),
            "--corpus",
            str(corpus),
            "--no-filter",
            "--out",
            str(tmp_path / "run"),
            "--block-size",
            "64",
            "--quiet",
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code != 0 and result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "block size 64 exceeds the model's 32 positions" in lines[0], result.stderr


def test_a_model_without_trainable_weights_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    from chatcore.training.trainer import check_trainable

    model = AutoModelForCausalLM.from_pretrained(str(build_tiny_model(tmp_path / "qwen2", architecture="qwen2")))
    check_trainable(model, 64)
    model.requires_grad_(False)
    with pytest.raises(ChatcoreError, match="no trainable weights"):
        check_trainable(model, 64)


def test_a_small_reverse_model_trained_on_a_model_s_tokenizer_shares_it(tmp_path, corpus):
    """`--tokenizer` takes a model (here a chat model's folder), as `--model` names one: the
    small model trained from scratch on it turns text into the same ids, so MMI takes it."""
    forward = build_tiny_model(
        tmp_path / "forward", architecture="llama", chat_template=CHATML_TEMPLATE, layers=1, width=32, heads=2
    )
    out = tmp_path / "reverse"
    shape = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--n-positions", "128", "--dropout", "0"]
    steps = ["--block-size", "32", "--batch-size", "4", "--epochs", "0.2", "--eval-every", "4", "--eval-blocks", "2"]
    result = CliRunner().invoke(
        build_cli(),
        ["train", "model", "--reverse", "--corpus", str(corpus), "--tokenizer", str(forward), "--out", str(out)]
        + ["--no-filter", "--heldout", "0.1", "--device", "cpu", "--quiet", *shape, *steps],
    )
    assert result.exit_code == 0, result.output
    card = json.loads((out / "best" / "chatcore_training.json").read_text())
    assert card["direction"] == "reverse" and card["tokenizer"] == str(forward)
    engine = make_engine(str(forward), "chatcore.plugins.mmi.plugin")
    settings = {"candidates": 2, "reverse_model": str(out / "best")}
    response = engine.reply_to(["hi there"], ReplyOptions(decoder="mmi", decoder_settings=settings, seed=0))
    response.text()
    assert response.provenance["details"]["mmi"]["retokenized"] is False


def test_a_tokenizer_named_as_no_model_is_refused_in_one_line(tmp_path, corpus):
    result = CliRunner().invoke(
        build_cli(),
        ["train", "model", "--reverse", "--corpus", str(corpus), "--tokenizer", "./no-such-model"]
        + ["--out", str(tmp_path / "out"), "--no-filter", "--device", "cpu", "--quiet"],
    )
    assert result.exit_code != 0
    assert "'./no-such-model' does not exist" in result.output and "Traceback" not in result.output


def test_resuming_with_another_model_shape_is_one_clear_line(tmp_path, corpus):
    """``--resume`` without the shape settings the run started with (the defaults build a
    larger model): one line naming the settings that differ, not the checkpoint loader's traceback."""
    shape = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--n-positions", "128", "--block-size", "64"]
    common = ["train", "model", "--corpus", str(corpus), "--no-filter", "--out", str(tmp_path / "run")]
    common += ["--tokenizer", "chatcore-tiny", "--batch-size", "8", "--quiet", "--device", "cpu"]
    first = CliRunner().invoke(build_cli(), [*common, *shape, "--epochs", "1"])
    assert first.exit_code == 0, first.output
    again = CliRunner().invoke(build_cli(), [*common, "--resume", "--epochs", "2"])
    assert again.exit_code == 1 and isinstance(again.exception, SystemExit) and "Traceback" not in again.output
    lines = [line for line in again.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert (
        lines[0].startswith("Error: --resume: the checkpoint in ")
        and "was trained with --n-layer 2 (now 6)" in lines[0]
    )
    assert "--n-embd 64 (now 384)" in lines[0]
    assert lines[0].endswith(": give the settings it was started with")


def test_a_corpus_saved_with_a_byte_order_mark_reads_as_without(tmp_path):
    """Windows tools save UTF-8 with a byte-order mark: it is no part of the first line; a line
    that is not JSON says where it breaks."""
    from chatcore.errors import CorpusError
    from chatcore.training.corpus import data_lines, load_corpus

    lines = [json.dumps({"turns": ["hi there", "hello, how are you?"]}), json.dumps(["fine", "good to hear"])]
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_text("\n".join(lines) + "\n", encoding="utf-8")
    marked.write_text("\n".join(lines) + "\n", encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    assert load_corpus(str(marked)) == load_corpus(str(plain)) and len(load_corpus(str(plain))) == 2
    assert data_lines(marked, "prompt file") == data_lines(plain, "prompt file")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"turns": ["a\tb"]}\n'.replace("\\t", "\t"), encoding="utf-8")
    with pytest.raises(
        CorpusError, match=r"broken.jsonl:1: not valid JSON \(Invalid control character at column \d+\)"
    ):
        load_corpus(str(broken))


def test_a_run_that_fails_before_writing_leaves_no_out_folder(tmp_path):
    """Too little text for one step: the one-line error, and no empty --out folder left behind
    (a folder that was there before is kept)."""
    corpus = tmp_path / "two.jsonl"
    corpus.write_text('{"turns": ["hi", "yo"]}\n{"turns": ["ok", "fine"]}\n')
    for out, existed in ((tmp_path / "new-run", False), (tmp_path / "kept", True)):
        if existed:
            out.mkdir()
        arguments = ["train", "model", "--corpus", str(corpus), "--out", str(out), "--tokenizer", "chatcore-tiny"]
        result = CliRunner().invoke(build_cli(), [*arguments, "--no-filter", "--quiet", "--device", "cpu"])
        assert result.exit_code == 1 and "the corpus makes 0 blocks" in result.stderr, result.output
        assert out.is_dir() == existed
