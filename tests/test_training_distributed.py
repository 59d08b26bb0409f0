"""Training on several processes (torchrun, gloo on CPU), gradient accumulation, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chatcore.training.trainer import ModelShape, TrainConfig, step_shard

SHAPE = dict(n_layer=1, n_embd=32, n_head=2, n_positions=64, dropout=0.0)
TRAIN = dict(epochs=1.0, block_size=32, warmup_steps=2, eval_every=4, device="cpu", save_dtype="float32")

# Run by torchrun in each of two processes: the library's train() on a real tiny GPT-2,
# with a forward hook recording every training block this rank fed the model.
WORKER = """
import json, os, sys
import torch
from transformers import AutoTokenizer
from chatcore.training.data import encode_dialogues
from chatcore.training.pipeline import training_dialogues
from chatcore.training.trainer import ModelShape, TrainConfig, build_model, train

corpus, tokenizer_dir, out_dir, shape, settings = sys.argv[1:6]
torch.set_num_threads(1)
train_set, heldout_set, _ = training_dialogues(corpus, 0.1, None)
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
torch.manual_seed(0)
model = build_model(tokenizer, ModelShape(**json.loads(shape)))
seen = []

def record(module, args, kwargs):
    if module.training:
        seen.extend(",".join(map(str, row)) for row in kwargs["input_ids"].tolist())

model.register_forward_pre_hook(record, with_kwargs=True)
config = TrainConfig(out_dir=out_dir, **json.loads(settings))
train(model, tokenizer, encode_dialogues(train_set, tokenizer), encode_dialogues(heldout_set, tokenizer),
      config, progress=False)
with open(os.path.join(out_dir, "seen-%s.json" % os.environ["RANK"]), "w") as handle:
    json.dump(seen, handle)
"""


def test_step_shard_gives_each_rank_its_own_blocks():
    import torch

    order = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    single = step_shard(order, 1, batch_size=8, grad_accum=1, world_size=1, rank=0)
    assert len(single) == 1 and single[0].tolist() == order[8:16].tolist()  # the plain loop's slice
    shards = [step_shard(order, 1, batch_size=2, grad_accum=2, world_size=2, rank=rank) for rank in range(2)]
    pieces = [piece.tolist() for shard in shards for piece in shard]
    assert all(len(piece) == 2 for piece in pieces)
    flat = [index for piece in pieces for index in piece]
    assert sorted(flat) == sorted(order[8:16].tolist())  # together: exactly one global batch
    assert set(map(tuple, shards[0])).isdisjoint(map(tuple, shards[1]))


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    from chatcore.training.corpus import load_chitchat
    from chatcore.training.tokenizer import train_tokenizer

    folder = tmp_path_factory.mktemp("dist-corpus")
    dialogues = load_chitchat()[:10]
    corpus = folder / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"id": d.id, "turns": list(d.turns)}) for d in dialogues))
    tokenizer = train_tokenizer((t for d in dialogues for t in d.turns), vocab_size=300)
    tokenizer.save_pretrained(str(folder / "tokenizer"))
    return corpus, folder / "tokenizer"


def _train_in_process(
    corpus: Path, tokenizer_dir: Path, out_dir: Path, resume=False, shape=SHAPE, on_forward=None, **settings
):
    import torch
    from transformers import AutoTokenizer

    from chatcore.training.data import encode_dialogues
    from chatcore.training.pipeline import training_dialogues
    from chatcore.training.trainer import build_model, train

    train_set, heldout_set, _ = training_dialogues(str(corpus), 0.1, None)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(0)
    model = build_model(tokenizer, ModelShape(**shape))
    if on_forward is not None:
        model.register_forward_pre_hook(on_forward)
    config = TrainConfig(out_dir=str(out_dir), **{**TRAIN, **settings})
    result = train(
        model,
        tokenizer,
        encode_dialogues(train_set, tokenizer),
        encode_dialogues(heldout_set, tokenizer),
        config,
        resume=resume,
        progress=False,
    )
    return result, _checkpoint(out_dir)


def _checkpoint(out_dir: Path) -> dict:
    """The model's weights and the loop's counters in the run's checkpoint folder."""
    from safetensors.torch import load_file

    from chatcore.training.accelerated import read_progress

    folder = out_dir / "checkpoint"
    return {"model": load_file(folder / "model.safetensors"), **read_progress(folder)}


def _assert_same_weights(first: dict, second: dict) -> None:
    import torch

    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_gradient_accumulation_matches_one_large_batch(tiny_corpus, tmp_path):
    corpus, tokenizer_dir = tiny_corpus
    large, large_state = _train_in_process(corpus, tokenizer_dir, tmp_path / "large", batch_size=4, epochs=0.15)
    accumulated, accumulated_state = _train_in_process(
        corpus, tokenizer_dir, tmp_path / "accum", batch_size=2, grad_accum=2, epochs=0.15
    )
    assert large.steps == accumulated.steps > 2
    assert large.tokens_seen == accumulated.tokens_seen
    _assert_same_weights(large_state["model"], accumulated_state["model"])


class _Stop(Exception):
    """Raised in the middle of a training run, as a crash or a kill would end it."""


def test_an_interrupted_run_resumes_exactly(tiny_corpus, tmp_path):
    """Stopped after a checkpoint and resumed, a run ends with the very weights of a run
    never stopped: the checkpoint restores the step, the optimizer, the scheduler and the
    random state (dropout draws from it)."""
    import torch

    corpus, tokenizer_dir = tiny_corpus
    settings = dict(batch_size=2, epochs=0.2, eval_every=2, shape={**SHAPE, "dropout": 0.1})
    whole, whole_state = _train_in_process(corpus, tokenizer_dir, tmp_path / "whole", **settings)
    assert whole.steps >= 5

    forwards = []

    def stop_in_the_fifth_step(module, args):
        if module.training:
            forwards.append(torch.get_rng_state())
            if len(forwards) == 5:
                raise _Stop

    cut = tmp_path / "cut"
    with pytest.raises(_Stop):
        _train_in_process(corpus, tokenizer_dir, cut, on_forward=stop_in_the_fifth_step, **settings)
    checkpoint = cut / "checkpoint"
    assert _checkpoint(cut)["step"] == 4
    assert torch.load(checkpoint / "scheduler.bin", weights_only=False)["last_epoch"] == 4
    saved_rng = torch.load(checkpoint / "random_states_0.pkl", weights_only=False)["torch_manual_seed"]

    forwards.clear()

    def record(module, args):
        if module.training:
            forwards.append(torch.get_rng_state())

    resumed, resumed_state = _train_in_process(corpus, tokenizer_dir, cut, resume=True, on_forward=record, **settings)
    assert torch.equal(forwards[0], saved_rng)  # the random state where the checkpoint left it
    assert len(forwards) == whole.steps - 4  # the steps after the checkpoint, and only those
    assert resumed.steps == whole.steps and resumed.tokens_seen == whole.tokens_seen
    assert resumed_state.keys() == whole_state.keys()
    for name, weight in whole_state["model"].items():
        assert torch.equal(resumed_state["model"][name], weight), name
    schedules = [
        torch.load(run / "checkpoint" / "scheduler.bin", weights_only=False) for run in (cut, tmp_path / "whole")
    ]
    assert schedules[0]["last_epoch"] == whole.steps
    for key in ("last_epoch", "base_lrs", "_last_lr"):
        assert schedules[0][key] == schedules[1][key], key


def test_a_checkpoint_of_the_old_format_is_refused_in_one_line(tmp_path):
    from chatcore.errors import ChatcoreError
    from chatcore.training.accelerated import checkpoint_to_resume

    with pytest.raises(ChatcoreError, match=r"no checkpoint in .*checkpoint$"):
        checkpoint_to_resume(tmp_path)
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(ChatcoreError, match=r"checkpoint.pt is in the format of an older chatcore.*without --resume"):
        checkpoint_to_resume(tmp_path)


def test_fp16_on_the_cpu_is_refused_in_one_line():
    from chatcore.errors import ChatcoreError
    from chatcore.training.accelerated import make_accelerator

    with pytest.raises(ChatcoreError, match="fp16 needs a GPU"):
        make_accelerator("cpu", "fp16")

    # From the command line it is refused before the corpus is read (this one does not exist).
    from click.testing import CliRunner

    from chatcore.cli import build_cli

    args = ["train", "model", "--out", "unused", "--corpus", "no-such-corpus.jsonl", "--device", "cpu"]
    result = CliRunner().invoke(build_cli(), [*args, "--precision", "fp16"])
    assert result.exit_code != 0
    assert "fp16 needs a GPU" in str(result.exception) + result.output and "no-such-corpus" not in result.output


@pytest.mark.slow
def test_torchrun_two_cpu_processes_then_resume_on_one(tiny_corpus, tmp_path):
    corpus, tokenizer_dir = tiny_corpus
    torchrun = Path(sys.executable).with_name("torchrun")
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    out = tmp_path / "run"
    settings = {**TRAIN, "batch_size": 2, "epochs": 0.15}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launched = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc_per_node=2",
            str(worker),
            str(corpus),
            str(tokenizer_dir),
            str(out),
            json.dumps(SHAPE),
            json.dumps(settings),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]

    # Both ranks trained, on different blocks, and only rank 0 wrote the model.
    seen = [json.loads((out / f"seen-{rank}.json").read_text()) for rank in range(2)]
    result = json.loads((out / "result.json").read_text())
    assert result["world_size"] == 2 and result["global_batch"] == 4
    assert len(seen[0]) == len(seen[1]) == 2 * result["steps"]
    assert set(seen[0]).isdisjoint(seen[1])
    assert (out / "best" / "config.json").is_file() and (out / "checkpoint" / "model.safetensors").is_file()

    # Two ranks of 2 blocks train exactly like one process with batches of 4.
    _, single_state = _train_in_process(corpus, tokenizer_dir, tmp_path / "single", batch_size=4, epochs=0.15)
    distributed_state = _checkpoint(out)
    assert distributed_state["step"] == single_state["step"]
    _assert_same_weights(distributed_state["model"], single_state["model"])

    # The checkpoint resumes on one process, through `python -m chatcore.cli`, with another global batch.
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "chatcore.cli",
            "train",
            "model",
            "--corpus",
            str(corpus),
            "--tokenizer",
            str(tokenizer_dir),
            "--out",
            str(out),
            "--resume",
            "--no-filter",
            "--heldout",
            "0.1",
            "--n-layer",
            "1",
            "--n-embd",
            "32",
            "--n-head",
            "2",
            "--n-positions",
            "64",
            "--dropout",
            "0",
            "--block-size",
            "32",
            "--batch-size",
            "2",
            "--epochs",
            "0.3",
            "--warmup-steps",
            "2",
            "--eval-every",
            "4",
            "--device",
            "cpu",
            "--save-dtype",
            "float32",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    continued_at = 2 * distributed_state["step"]  # half the blocks per step: twice the steps per epoch
    assert f"continuing at step {continued_at}" in resumed.stderr
    after = json.loads((out / "result.json").read_text())
    assert after["world_size"] == 1 and after["global_batch"] == 2
    assert after["steps"] > continued_at
    assert after["seconds"] >= result["seconds"]  # the clock carried over from the checkpoint
