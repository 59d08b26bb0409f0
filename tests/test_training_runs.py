"""``chatcore train model`` runs that stop, resume and repeat: checkpoints written whole,
damaged or mismatched checkpoints refused in one line, --seed, Ctrl-C, no held-out split
(a tiny model from scratch on chatcore-tiny's tokenizer: each run takes a second or two)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from chatcore.cli import build_cli
from chatcore.errors import ChatcoreError
from chatcore.training.accelerated import CHECKPOINT_DIR, read_progress
from chatcore.training.corpus import load_chitchat
from chatcore.training.pipeline import train_model_command
from chatcore.training.trainer import ModelShape, TrainConfig

SHAPE = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--n-positions", "64", "--dropout", "0.1"]
STEPS = ["--block-size", "32", "--batch-size", "4", "--warmup-steps", "2", "--save-dtype", "float32"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small JSONL corpus of real dialogues (about 20,000 tokens: 160 steps of 4 blocks an epoch)."""
    path = tmp_path_factory.mktemp("corpus") / "dialogues.jsonl"
    with path.open("w", encoding="utf-8") as handle:
        for dialogue in load_chitchat()[:40]:
            handle.write(json.dumps({"id": dialogue.id, "turns": list(dialogue.turns)}) + "\n")
    return path


def run(out: Path, corpus: Path, epochs: float = 0.05, seed: int = 1234, resume: bool = False, **shape: int):
    """``train model`` from scratch, called as the command calls it."""
    config = TrainConfig(
        out_dir=str(out),
        epochs=epochs,
        batch_size=4,
        block_size=32,
        warmup_steps=2,
        eval_every=4,
        seed=seed,
        device="cpu",
        save_dtype="float32",
    )
    settings = {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64, **shape}
    return train_model_command(
        str(corpus),
        config,
        ModelShape(**settings),
        tokenizer_path="chatcore-tiny",
        heldout=0.2,
        resume=resume,
        progress=False,
        filter_config=None,
    )


def command(corpus: Path, out: Path, *arguments: str):
    base = ["train", "model", "--corpus", str(corpus), "--out", str(out), "--tokenizer", "chatcore-tiny"]
    options = ["--no-filter", "--quiet", "--device", "cpu", "--heldout", "0.2"]
    return CliRunner().invoke(build_cli(), [*base, *options, *arguments])


def one_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and "Traceback" not in result.output and len(lines) == 1, result.output
    return lines[0]


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_a_checkpoint_save_stopped_midway_leaves_the_previous_checkpoint(tmp_path, corpus, monkeypatch):
    """A stop while the checkpoint is written (here: its optimizer file cut short, then the
    process stopped) leaves the last whole checkpoint, and --resume continues from it."""
    from accelerate import Accelerator

    out = tmp_path / "run"
    first = run(out, corpus)
    assert read_progress(out / CHECKPOINT_DIR)["step"] == first.steps == first.total_steps
    whole = (out / CHECKPOINT_DIR / "optimizer.bin").read_bytes()
    save_state = Accelerator.save_state

    def stopped_while_saving(self, output_dir, *args, **kwargs):
        save_state(self, output_dir, *args, **kwargs)
        optimizer = Path(output_dir) / "optimizer.bin"
        optimizer.write_bytes(optimizer.read_bytes()[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(Accelerator, "save_state", stopped_while_saving)
    with pytest.raises(KeyboardInterrupt):
        run(out, corpus, epochs=0.1, resume=True)
    monkeypatch.setattr(Accelerator, "save_state", save_state)
    assert read_progress(out / CHECKPOINT_DIR)["step"] == first.steps
    assert (out / CHECKPOINT_DIR / "optimizer.bin").read_bytes() == whole
    assert (out / "best" / "chatcore_training.json").is_file()

    resumed = run(out, corpus, epochs=0.1, resume=True)
    assert resumed.steps == resumed.total_steps > first.steps
    assert read_progress(out / CHECKPOINT_DIR)["step"] == resumed.steps
    assert not (out / "checkpoint.partial").exists() and not (out / "checkpoint.previous").exists()


def test_a_stop_between_the_two_renames_keeps_the_previous_checkpoint(tmp_path, corpus):
    out = tmp_path / "run"
    first = run(out, corpus)
    (out / CHECKPOINT_DIR).rename(out / "checkpoint.previous")  # where replace_folder puts it aside
    assert run(out, corpus, epochs=0.1, resume=True).steps > first.steps


def test_a_damaged_checkpoint_is_refused_in_one_line(tmp_path, corpus):
    out = tmp_path / "run"
    run(out, corpus)
    optimizer = out / CHECKPOINT_DIR / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    line = one_line(command(corpus, out, *SHAPE, *STEPS, "--epochs", "0.1", "--resume"))
    assert line.startswith(f"Error: --resume: the checkpoint in {out / CHECKPOINT_DIR} is damaged"), line
    assert "train again into another --out" in line
    (out / CHECKPOINT_DIR / "custom_checkpoint_0.pkl").write_bytes(b"cut")
    assert "is damaged" in one_line(command(corpus, out, *SHAPE, *STEPS, "--epochs", "0.1", "--resume"))


def test_resuming_with_another_layer_count_names_the_setting(tmp_path, corpus):
    out = tmp_path / "run"
    run(out, corpus)
    with pytest.raises(ChatcoreError, match=r"was trained with --n-layer 1 \(now 2\): give the settings"):
        run(out, corpus, epochs=0.1, resume=True, n_layer=2)
    # A checkpoint without the saved shape (an older chatcore's): the loader's missing keys, in one line.
    progress = out / CHECKPOINT_DIR / "custom_checkpoint_0.pkl"
    import torch

    state = torch.load(progress, weights_only=True)
    del state["model_shape"]
    torch.save(state, progress)
    arguments = [*SHAPE, *STEPS, "--epochs", "0.1", "--resume"]
    line = one_line(command(corpus, out, *[value if value != "1" else "2" for value in arguments]))
    assert "other settings for the model's shape (Missing key(s)" in line, line


def test_the_same_seed_makes_the_same_run_from_scratch(tmp_path, corpus):
    first, second = run(tmp_path / "a", corpus, seed=7), run(tmp_path / "b", corpus, seed=7)
    assert first.best_val_loss == second.best_val_loss
    a, b = weights(tmp_path / "a" / "best"), weights(tmp_path / "b" / "best")
    assert all(a[name].equal(b[name]) for name in a)
    run(tmp_path / "c", corpus, seed=8)
    c = weights(tmp_path / "c" / "best")
    assert not all(a[name].equal(c[name]) for name in a)


def test_without_a_heldout_split_best_is_the_last_step_labelled_with_its_training_loss(tmp_path, corpus, caplog):
    out = tmp_path / "run"
    result = command(corpus, out, *SHAPE, *STEPS, "--epochs", "0.05", "--eval-every", "3", "--heldout", "0")
    assert result.exit_code == 0, result.output
    assert "the held-out split has 0 tokens" in caplog.text
    assert "no held-out split: model in" in result.stdout and "held-out loss" not in result.stdout
    card = json.loads((out / "best" / "chatcore_training.json").read_text())
    assert card["heldout_loss"] is None and card["train_loss"] > 0 and card["best_step"] == 8
    assert "no held-out split" in card["best_by"]


def test_ctrl_c_stops_after_the_step_with_a_checkpoint(tmp_path, corpus, monkeypatch):
    """The first Ctrl-C: the step under way ends, the checkpoint is written, and the command
    says where it stopped; --resume continues to the end."""
    from chatcore.training import trainer

    shard = trainer.step_shard
    calls = []

    def interrupted_at_the_third_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)
        return shard(*args, **kwargs)

    monkeypatch.setattr(trainer, "step_shard", interrupted_at_the_third_step)
    out = tmp_path / "run"
    arguments = [*SHAPE, *STEPS, "--epochs", "0.05", "--eval-every", "5"]
    result = command(corpus, out, *arguments)
    assert result.exit_code == 0, result.output
    assert "stopped at step 3 of 6: continue with --resume" in result.stdout
    assert "no evaluation yet" in result.stdout
    assert read_progress(out / CHECKPOINT_DIR)["step"] == 3
    monkeypatch.setattr(trainer, "step_shard", shard)
    again = command(corpus, out, *arguments, "--resume")
    assert again.exit_code == 0 and "best held-out loss" in again.stdout and "stopped" not in again.stdout
