"""The training loop for chatcore's chat models.

One loop serves forward and reverse models, from scratch (a GPT-2-architecture model)
or fine-tuned from any Hugging Face causal LM (``init_from``: GPT-2, Llama, Qwen2,
Gemma ...). Hugging Face Accelerate places the model, runs mixed precision (bf16, or
fp16 with a GradScaler), accumulates gradients and checkpoints the run: OUT/checkpoint/
holds the model, the optimizer, the learning-rate scheduler, the GradScaler and every
process's random state (CPU and CUDA), so ``resume`` continues exactly (see
:mod:`chatcore.training.accelerated`). The best model by held-out loss is saved as an
ordinary Hugging Face folder, OUT/best.

The same loop runs on one device or on several under ``torchrun`` (WORLD_SIZE > 1):
Accelerate wraps the model in DistributedDataParallel (NCCL on GPUs, gloo on CPUs), every
optimizer step takes ``batch_size * grad_accum * world_size`` blocks, and each rank
trains on its own share of them. Only rank 0 evaluates, saves the best model and prints.
A checkpoint's weights and counters hold no per-device state, so it resumes on any number
of devices: with the same global batch exactly where it stopped, otherwise at the same
position in the epochs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, NonNegativeFloat, model_validator

from chatcore.errors import ChatcoreError
from chatcore.options import Settings
from chatcore.training.accelerated import DistributedContext, distributed_context

__all__ = [
    "DistributedContext",
    "ModelShape",
    "TrainConfig",
    "TrainResult",
    "build_model",
    "check_trainable",
    "distributed_context",
    "evaluate_loss",
    "step_shard",
    "train",
]

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("chatcore.training")


Precision = Literal["auto", "fp32", "bf16", "fp16"]


class ModelShape(Settings):
    """The shape of a GPT-2-architecture model trained from scratch."""

    n_layer: Annotated[int, Field(ge=1, le=96)] = 6
    n_embd: Annotated[int, Field(ge=8, le=8192)] = 384
    n_head: Annotated[int, Field(ge=1, le=128)] = 6
    n_positions: Annotated[int, Field(ge=16, le=8192)] = 512
    dropout: Annotated[float, Field(ge=0.0, le=0.9)] = 0.1

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelShape:
        if self.n_embd % self.n_head:
            raise ValueError(f"`n_embd` ({self.n_embd}) must be divisible by `n_head` ({self.n_head})")
        return self


class TrainConfig(Settings):
    """How a chat model is trained (`chatcore train model`)."""

    out_dir: str
    epochs: Annotated[float, Field(ge=0.001, le=10_000)] = 10.0
    batch_size: Annotated[int, Field(ge=1, le=65536)] = 32
    """Blocks per device per micro-batch."""
    block_size: Annotated[int, Field(ge=8, le=8192)] = 256
    learning_rate: Annotated[float, Field(ge=1e-8, le=1.0)] = 1e-3
    min_lr_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    warmup_steps: Annotated[int, Field(ge=0, le=10**9)] = 100
    weight_decay: NonNegativeFloat = 0.1
    grad_clip: NonNegativeFloat = 1.0
    eval_every: Annotated[int, Field(ge=1, le=10**9)] = 200
    seed: int = 1234
    device: str | None = None
    """cpu, cuda ... (default: cuda when present)."""
    precision: Precision = "auto"
    grad_accum: Annotated[int, Field(ge=1, le=65536)] = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    save_dtype: Literal["float32", "float16", "bfloat16"] = "float16"
    max_shard_size: str = "15MB"
    eval_blocks: Annotated[int, Field(ge=1, le=10**9)] | None = None
    """Evaluate only the first N held-out blocks (default: all)."""
    # A 100M-parameter model on a CPU reads about 300 tokens/s, so the full held-out split of
    # a corpus can take longer than the steps between two evaluations; the first N blocks
    # are the same at every evaluation.
    extra: dict[str, Any] = {}


def build_model(tokenizer: Any, shape: ModelShape) -> "torch.nn.Module":
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=shape.n_positions,
        n_embd=shape.n_embd,
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        resid_pdrop=shape.dropout,
        embd_pdrop=shape.dropout,
        attn_pdrop=shape.dropout,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(config)


def check_trainable(model: Any, block_size: int) -> None:
    """Refuse, in one line, a model this loop cannot train: not a causal LM that takes
    ``input_ids`` and returns ``logits``, no trainable weights, or fewer positions than a
    block. Any architecture ``AutoModelForCausalLM`` builds qualifies (GPT-2, Llama, Qwen2,
    Gemma, ...); its position limit is read from its own config."""
    from chatcore.models import max_positions_of

    name = type(model).__name__
    config = getattr(model, "config", None)
    if (
        config is None
        or not callable(getattr(model, "forward", None))
        or not hasattr(model, "get_output_embeddings")
        or model.get_output_embeddings() is None
    ):
        raise ChatcoreError(f"{name} is not a causal language model with an LM head; chatcore trains only those")
    if not any(p.requires_grad for p in model.parameters()):
        raise ChatcoreError(f"{name} has no trainable weights (a quantized model cannot be fine-tuned here)")
    check_block_size(block_size, max_positions_of(config))


def check_block_size(block_size: int, positions: int) -> None:
    """Refuse, in one line, blocks longer than the model's ``positions``."""
    if block_size > positions:
        raise ChatcoreError(
            f"block size {block_size} exceeds the model's {positions} positions: use --block-size {positions} or less"
        )


@dataclass
class TrainResult:
    best_val_loss: float
    """The held-out loss of best/; with ``heldout_evaluated`` False, the training loss of the last
    evaluation's step (best/ is then that step's model)."""
    best_step: int
    steps: int
    tokens_seen: int
    seconds: float
    parameters: int
    total_steps: int = 0
    """The steps the run was set to take: more than ``steps`` when it stopped early (Ctrl-C)."""
    heldout_evaluated: bool = True
    """Whether a held-out split was scored; without one (``--heldout 0``, or a split shorter
    than one block) best/ is the model of the last evaluation's step."""

    @property
    def best_val_perplexity(self) -> float:
        return math.exp(self.best_val_loss)


def step_shard(
    order: "torch.Tensor", within: int, batch_size: int, grad_accum: int, world_size: int, rank: int
) -> list["torch.Tensor"]:
    """The block indices ``rank`` trains on at step ``within`` of an epoch, as
    ``grad_accum`` micro-batches.

    A step takes the next ``batch_size * grad_accum * world_size`` entries of the
    epoch's shuffled order; ranks take consecutive equal shares of it, so no two ranks
    see the same block and one device with the same global batch sees the same blocks.
    """
    global_batch = batch_size * grad_accum * world_size
    indices = order[within * global_batch : (within + 1) * global_batch]
    pieces = indices.tensor_split(world_size * grad_accum)
    return list(pieces[rank * grad_accum : (rank + 1) * grad_accum])


def evaluate_loss(
    model: Any, blocks: "torch.Tensor", batch_size: int, device: "torch.device | str", autocast: Any
) -> float:
    """Mean per-token cross-entropy over (N, T+1) blocks."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, blocks.size(0), batch_size):
            batch = blocks[start : start + batch_size].to(device)
            with autocast():
                logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum"
            )
            total += loss.item()
            count += batch[:, 1:].numel()
    model.train()
    return total / max(1, count)


def _optimizer(model: Any, config: TrainConfig, device: "torch.device") -> "torch.optim.Optimizer":
    """AdamW, with weight decay on the matrices only (not on biases and norms)."""
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )


BEST_DIR = "best"
TRAINING_RECORD = "chatcore_training.json"

# The model settings a checkpoint's weights depend on, and the option (or what) sets each.
SHAPE_SETTINGS = {
    "n_layer": "--n-layer",
    "n_embd": "--n-embd",
    "n_head": "--n-head",
    "n_positions": "--n-positions",
    "vocab_size": "the tokenizer's vocabulary (--tokenizer, --vocab-size)",
    "num_hidden_layers": "the model's layers (--init-from)",
    "hidden_size": "the model's width (--init-from)",
    "num_attention_heads": "the model's heads (--init-from)",
    "num_key_value_heads": "the model's key-value heads (--init-from)",
    "intermediate_size": "the model's MLP width (--init-from)",
    "max_position_embeddings": "the model's positions (--init-from)",
    "model_type": "the architecture (--init-from)",
}


def model_shape_of(model: Any) -> dict[str, Any]:
    """The settings of ``model``'s config that its weights' shapes depend on (:data:`SHAPE_SETTINGS`)."""
    config = model.config
    aliases = getattr(config, "attribute_map", {})  # GPT-2's num_hidden_layers is its n_layer
    return {
        name: getattr(config, name)
        for name in SHAPE_SETTINGS
        if name not in aliases and getattr(config, name, None) is not None
    }


def check_same_shape(saved: dict[str, Any] | None, model: Any, folder: Path) -> None:
    """Refuse, in one line naming the settings that differ, to resume a checkpoint of a model
    of another shape (a checkpoint from before the shape was saved is checked on loading)."""
    if not saved:
        return
    now = model_shape_of(model)
    differences = [
        f"{SHAPE_SETTINGS[name]} {saved[name]!r} (now {now[name]!r})"
        for name in SHAPE_SETTINGS
        if name in saved and name in now and saved[name] != now[name]
    ]
    if differences:
        raise ChatcoreError(
            f"--resume: the checkpoint in {folder} was trained with {', '.join(differences)}: "
            f"give the settings it was started with"
        )


def write_json_whole(path: Path, value: Any) -> None:
    """Write ``path`` through a temporary sibling and a rename: a stop leaves the old file or the new one."""
    import os

    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value, indent=2))
    os.replace(partial, path)


def _save_best(model: Any, tokenizer: Any, config: TrainConfig, record: dict[str, Any] | None) -> None:
    """Write ``model`` as an ordinary Hugging Face folder, OUT/best, in ``save_dtype``, with its
    training record: whole (into a temporary sibling, then renamed into place), so a run
    stopped at any moment leaves the previous best/ or the new one."""
    import torch

    from chatcore.training.accelerated import partial_folder, replace_folder

    best_dir = Path(config.out_dir) / BEST_DIR
    written = partial_folder(best_dir)
    copy = type(model)(model.config)
    copy.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    copy.to(getattr(torch, config.save_dtype))
    copy.config.dtype = config.save_dtype
    copy.save_pretrained(str(written), max_shard_size=config.max_shard_size)
    tokenizer.save_pretrained(str(written))
    if record is not None:
        (written / TRAINING_RECORD).write_text(json.dumps(record, indent=2))
    replace_folder(written, best_dir)


def best_record(
    base: dict[str, Any], step: int, loss: float, heldout_evaluated: bool, seconds: float, parameters: int
) -> dict[str, Any]:
    """best/'s training record: ``base`` (the corpus, tokenizer, filter ...) and the model's step and loss.

    Without a held-out split the loss is the training loss and best/ the last evaluation's
    model: the record says so, and has no held-out loss."""
    scores: dict[str, Any]
    if heldout_evaluated:
        scores = {"heldout_loss": round(loss, 4), "heldout_perplexity": round(math.exp(min(loss, 50)), 2)}
    else:
        scores = {
            "heldout_loss": None,
            "train_loss": round(loss, 4),
            "best_by": "last evaluation's step: no held-out split to choose on",
        }
    return {**base, "parameters": parameters, "best_step": step, **scores, "seconds": round(seconds, 1)}


def train(
    model: Any,
    tokenizer: Any,
    train_stream: "torch.Tensor",
    heldout_stream: "torch.Tensor",
    config: TrainConfig,
    resume: bool = False,
    progress: bool = True,
    record: dict[str, Any] | None = None,
) -> TrainResult:
    """Train ``model`` on ``train_stream``; keep the best held-out model in out_dir/best (with
    ``record`` and its step and loss as its ``chatcore_training.json``) and the run's latest
    state in out_dir/checkpoint (``resume`` continues from it).

    Without held-out blocks (``heldout_stream`` shorter than one block) no held-out loss is
    computed: best/ is the model of the last evaluation, labelled with its training loss.
    The first Ctrl-C (in a single-process run) stops after the step under way and writes
    the checkpoint; the result's ``steps`` is then below its ``total_steps``."""
    import torch
    from tqdm.auto import tqdm

    from chatcore.training.accelerated import (
        CHECKPOINT_DIR,
        Progress,
        checkpoint_to_resume,
        load_checkpoint,
        make_accelerator,
        read_progress,
        save_checkpoint,
    )
    from chatcore.training.data import make_blocks
    from chatcore.training.interrupt import StopRequest
    from chatcore.training.schedule import move_schedule, warmup_cosine

    out_dir = Path(config.out_dir)
    checkpoint = checkpoint_to_resume(out_dir) if resume else out_dir / CHECKPOINT_DIR
    accelerator = make_accelerator(config.device, config.precision, config.grad_accum)
    rank, world_size, is_main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    device = accelerator.device
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    # Rank 0 keeps the single-process seed; other ranks get their own dropout noise.
    torch.manual_seed(config.seed + rank)
    check_trainable(model, config.block_size)
    model.to(device)
    model.train()

    heldout_blocks = None
    heldout_evaluated = heldout_stream.numel() > config.block_size
    if is_main and heldout_evaluated:
        heldout_blocks = make_blocks(heldout_stream, config.block_size)[: config.eval_blocks]
    elif is_main:
        logger.warning(
            "the held-out split has %d tokens, fewer than one block of %d: no held-out loss is computed, "
            "and best/ is the model of the last evaluation (give a larger --heldout to choose on held-out loss)",
            heldout_stream.numel(),
            config.block_size,
        )
    blocks_per_epoch = (train_stream.numel() - 1) // config.block_size
    micro_batches = config.grad_accum * world_size
    if blocks_per_epoch < micro_batches:
        raise ChatcoreError(
            f"the corpus makes {blocks_per_epoch} blocks of {config.block_size} tokens, fewer than the "
            f"{micro_batches} micro-batches of one step ({world_size} device(s) x grad_accum "
            f"{config.grad_accum}): use a smaller block size or a larger corpus"
        )
    global_batch = config.batch_size * micro_batches
    steps_per_epoch = max(1, blocks_per_epoch // global_batch)
    total_steps = max(1, int(config.epochs * steps_per_epoch))

    optimizer = _optimizer(model, config, device)
    schedule = warmup_cosine(optimizer, config.warmup_steps, total_steps, config.min_lr_ratio)
    # Under torchrun the model comes back wrapped in DistributedDataParallel (rank 0's weights).
    train_model, optimizer, _ = accelerator.prepare(model, optimizer, schedule)
    state = Progress()
    accelerator.register_for_checkpointing(state)
    step, tokens_seen, best_val, best_step, elapsed = 0, 0, float("inf"), -1, 0.0
    if resume:
        check_same_shape(read_progress(checkpoint).get("model_shape"), model, checkpoint)
        load_checkpoint(accelerator, checkpoint)
        saved = state.values
        step, tokens_seen = saved["step"], saved["tokens_seen"]
        best_val, best_step, elapsed = saved["best_val"], saved["best_step"], saved["elapsed"]
        if saved["steps_per_epoch"] != steps_per_epoch:
            # Another global batch (device count, batch size or accumulation): continue at
            # the same position in the epochs rather than at the same step number.
            step = round(step * steps_per_epoch / saved["steps_per_epoch"])
            if best_step >= 0:
                best_step = round(best_step * steps_per_epoch / saved["steps_per_epoch"])
            if is_main:
                before = saved.get("config", {}).get("block_size", config.block_size)
                if saved["global_batch"] != global_batch:
                    change = f"{global_batch} blocks per step instead of {saved['global_batch']}"
                else:  # the same count of blocks, of another length: another count of them an epoch
                    change = f"blocks of {config.block_size} tokens instead of {before}"
                logger.warning("resuming with %s: continuing at step %d of %d", change, step, total_steps)
        move_schedule(schedule, step, config.learning_rate)

    show = progress and is_main
    bar = tqdm(total=total_steps, initial=step, disable=not show, unit="step", dynamic_ncols=True)
    started = time.perf_counter() - elapsed
    window_tokens, window_start = 0, time.perf_counter()
    loss_value = float("nan")
    epoch_blocks: "torch.Tensor | None" = None
    order: "torch.Tensor | None" = None

    parameters = sum(p.numel() for p in model.parameters())
    saved_step = step

    def save_state() -> None:
        state.values = {
            "step": step,
            "tokens_seen": tokens_seen,
            "best_val": best_val,
            "best_step": best_step,
            "elapsed": time.perf_counter() - started,
            "steps_per_epoch": steps_per_epoch,
            "global_batch": global_batch,
            "world_size": world_size,
            "config": config.model_dump(),
            "model_shape": model_shape_of(model),
        }
        save_checkpoint(accelerator, checkpoint)  # rank 0's counters; every rank's random state

    # A single process stops at the first Ctrl-C after its step, with a checkpoint. Under
    # torchrun every rank would have to agree on the step: Ctrl-C stops at once there.
    say = bar.write if show else lambda line: logger.warning("%s", line)
    stop = StopRequest(say) if world_size == 1 else None
    with stop or contextlib.nullcontext():
        while step < total_steps:
            if stop is not None and stop.requested:
                if saved_step != step:
                    save_state()
                break
            epoch, within = divmod(step, steps_per_epoch)
            if within == 0 or epoch_blocks is None or order is None:
                # A new random offset each epoch so block boundaries move through the text;
                # seeded by the epoch alone, so every rank shuffles the same way.
                epoch_generator = torch.Generator().manual_seed(config.seed + epoch)
                offset = int(torch.randint(0, config.block_size, (1,), generator=epoch_generator))
                epoch_blocks = make_blocks(train_stream, config.block_size, offset)
                order = torch.randperm(epoch_blocks.size(0), generator=epoch_generator)
            pieces = step_shard(order, within, config.batch_size, config.grad_accum, world_size, rank)
            rows = sum(piece.numel() for piece in pieces)
            step_loss = torch.zeros((), device=device)
            for piece in pieces:
                batch = epoch_blocks[piece].to(device, non_blocking=True)  # (B, T + 1)
                # Gradients are averaged across ranks once per step, on the last micro-batch.
                with accelerator.accumulate(train_model):
                    logits = train_model(input_ids=batch[:, :-1]).logits  # (B, T, V)
                    loss = torch.nn.functional.cross_entropy(
                        logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)
                    )
                    share = piece.numel() / rows  # the micro-batch's weight in this rank's mean
                    # Accelerate divides every micro-batch's loss by grad_accum; weigh it by its share.
                    accelerator.backward(loss * share * config.grad_accum)
                step_loss += loss.detach() * share
            accelerator.clip_grad_norm_(train_model.parameters(), config.grad_clip)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            step_tokens = min(global_batch, order.numel() - within * global_batch) * config.block_size
            tokens_seen += step_tokens
            window_tokens += step_tokens
            if step % 10 == 0 or step == total_steps:
                loss_value = accelerator.reduce(step_loss, "mean").item()
                now = time.perf_counter()
                bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{window_tokens / max(1e-9, now - window_start):,.0f}")
                window_tokens, window_start = 0, now
            bar.update(1)
            if step % config.eval_every == 0 or step == total_steps:
                loss_value = accelerator.reduce(step_loss, "mean").item()  # this step's training loss
                if is_main:
                    if heldout_blocks is not None:
                        val = evaluate_loss(model, heldout_blocks, config.batch_size, device, accelerator.autocast)
                        line = f"held-out loss {val:.4f}  ppl {math.exp(min(val, 50)):.2f}"
                        better = val < best_val
                    else:
                        # Nothing held out to choose on: best/ follows the run, and says so.
                        val, line, better = loss_value, "no held-out split: best/ is this step's model", True
                    if show:
                        bar.write(f"step {step}/{total_steps}  train loss {loss_value:.4f}  {line}")
                    if better:
                        best_val, best_step = val, step
                        seconds = time.perf_counter() - started
                        card = (
                            None
                            if record is None
                            else best_record(record, step, val, heldout_evaluated, seconds, parameters)
                        )
                        _save_best(model, tokenizer, config, card)
                save_state()
                saved_step = step
    bar.close()
    elapsed = time.perf_counter() - started
    if world_size > 1:
        from accelerate.utils import broadcast_object_list

        shared: list[Any] = [best_val, best_step]
        broadcast_object_list(shared, from_process=0)
        best_val, best_step = shared
    result = TrainResult(
        best_val_loss=best_val,
        best_step=best_step,
        steps=step,
        tokens_seen=tokens_seen,
        seconds=elapsed,
        parameters=parameters,
        total_steps=total_steps,
        heldout_evaluated=heldout_evaluated,
    )
    if is_main:
        result_json = {
            **asdict(result),
            "best_val_perplexity": result.best_val_perplexity,
            "world_size": world_size,
            "global_batch": global_batch,
        }
        (out_dir / "result.json").write_text(json.dumps(result_json, indent=2))
    accelerator.wait_for_everyone()
    if world_size > 1 and accelerator.state.backend != "gloo":
        # NCCL wants an explicit teardown. A gloo group is left to process exit: its
        # teardown was seen to hang in a rank whose peer had already exited.
        accelerator.end_training()
    return result
