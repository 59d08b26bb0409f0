"""The training loop for chatcore's chat models.

One loop serves forward and reverse models, from scratch (a GPT-2-architecture model)
or fine-tuned from any Hugging Face causal LM (``init_from``: GPT-2, Llama, Qwen2,
Gemma ...). Checkpoints hold the model, the optimizer, the scheduler and
the RNG state, so ``resume`` continues exactly. The best model by held-out loss is
saved as an ordinary Hugging Face folder.

The same loop runs on one device or on several under ``torchrun`` (WORLD_SIZE > 1):
the model is wrapped in DistributedDataParallel (NCCL on GPUs, gloo on CPUs), every
optimizer step takes ``batch_size * grad_accum * world_size`` blocks, and each rank
trains on its own share of them. Only rank 0 evaluates, saves and prints. A checkpoint
holds no per-device state, so it resumes on any number of devices: with the same global
batch exactly where it stopped, otherwise at the same position in the epochs.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatcore.errors import ChatcoreError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("chatcore.training")


@dataclass
class ModelShape:
    n_layer: int = 6
    n_embd: int = 384
    n_head: int = 6
    n_positions: int = 512
    dropout: float = 0.1

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "n_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"`n_embd` ({self.n_embd}) must be divisible by `n_head` ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout}")


@dataclass
class TrainConfig:
    out_dir: str
    epochs: float = 10.0
    batch_size: int = 32
    block_size: int = 256
    learning_rate: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 200
    seed: int = 1234
    device: str | None = None
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    grad_accum: int = 1
    save_dtype: str = "float16"
    max_shard_size: str = "15MB"
    # Held-out blocks evaluated (None: all). A 100M-parameter model on a CPU reads about
    # 300 tokens/s, so the full held-out split of a corpus can take longer than the steps
    # between two evaluations; the first N blocks are the same at every evaluation.
    eval_blocks: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.epochs <= 0:
            raise ValueError(f"`epochs` must be positive, got {self.epochs}")
        for name in ("batch_size", "block_size", "eval_every", "grad_accum"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        if self.learning_rate <= 0:
            raise ValueError(f"`learning_rate` must be positive, got {self.learning_rate}")
        if self.eval_blocks is not None and (not isinstance(self.eval_blocks, int) or self.eval_blocks < 1):
            raise ValueError(f"`eval_blocks` must be a positive integer, got {self.eval_blocks!r}")
        if self.precision not in ("auto", "fp32", "bf16", "fp16"):
            raise ValueError(f"`precision` must be one of auto, fp32, bf16, fp16, got {self.precision!r}")


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
    positions = max_positions_of(config)
    if block_size > positions:
        raise ChatcoreError(
            f"block size {block_size} exceeds the model's {positions} positions: use --block-size {positions} or less"
        )


def _lr_at(step: int, total: int, config: TrainConfig) -> float:
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, total - config.warmup_steps))
    floor = config.learning_rate * config.min_lr_ratio
    return floor + 0.5 * (config.learning_rate - floor) * (1 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    best_val_loss: float
    best_step: int
    steps: int
    tokens_seen: int
    seconds: float
    parameters: int

    @property
    def best_val_perplexity(self) -> float:
        return math.exp(self.best_val_loss)


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands in a torchrun launch (rank 0 of 1 when run plainly)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def distributed_context() -> DistributedContext:
    """Read the rank and world size that torchrun (or any env:// launcher) exports."""
    import os

    try:
        return DistributedContext(
            rank=int(os.environ.get("RANK", "0")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
        )
    except ValueError as error:
        raise ChatcoreError(f"bad RANK / LOCAL_RANK / WORLD_SIZE in the environment: {error}") from None


_OWNED_GROUP = False  # whether init_distributed created the process group (and so ends it)


def init_distributed(device: str | None = None) -> tuple[DistributedContext, str]:
    """Join the launcher's process group if there is one; return the context and the
    device this rank trains on. Safe to call more than once."""
    global _OWNED_GROUP
    import torch

    context = distributed_context()
    if not context.enabled:
        return context, device or ("cuda" if torch.cuda.is_available() else "cpu")
    import torch.distributed as dist

    use_cuda = device.startswith("cuda") if device else torch.cuda.is_available()
    if use_cuda:
        device = f"cuda:{context.local_rank}"
        torch.cuda.set_device(context.local_rank)
    else:
        device = device or "cpu"
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        _OWNED_GROUP = True
    return context, device


def finish_distributed() -> None:
    """End the process group if :func:`init_distributed` started it."""
    global _OWNED_GROUP
    if _OWNED_GROUP:
        import torch.distributed as dist

        # NCCL wants an explicit teardown. A gloo group is left to process exit: its
        # destroy_process_group() was seen to hang in a rank whose peer had already
        # torn down and exited, after the final barrier both had passed.
        if dist.is_initialized() and dist.get_backend() != "gloo":
            dist.destroy_process_group()
        _OWNED_GROUP = False


def barrier() -> None:
    """Wait for every rank (nothing to wait for in a single process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


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


def evaluate_loss(model: Any, blocks: "torch.Tensor", batch_size: int, device: str, autocast: Any) -> float:
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


def train(
    model: Any,
    tokenizer: Any,
    train_stream: "torch.Tensor",
    heldout_stream: "torch.Tensor",
    config: TrainConfig,
    resume: bool = False,
    progress: bool = True,
) -> TrainResult:
    """Train ``model`` on ``train_stream``; keep the best held-out checkpoint in out_dir/best."""
    import contextlib

    import torch
    from tqdm.auto import tqdm

    from chatcore.training.data import make_blocks

    context, device = init_distributed(config.device)
    out_dir = Path(config.out_dir)
    checkpoint_path = out_dir / "checkpoint.pt"
    if context.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    # Rank 0 keeps the single-process seed; other ranks get their own dropout noise.
    torch.manual_seed(config.seed + context.rank)
    raw_model = model
    raw_model.to(device)
    raw_model.train()

    precision = config.precision
    if precision == "auto":
        precision = "bf16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "fp32":
        autocast = contextlib.nullcontext
    else:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        autocast = lambda: torch.autocast(device_type=device.split(":")[0], dtype=dtype)  # noqa: E731
    scaler = torch.amp.GradScaler(enabled=precision == "fp16")

    check_trainable(raw_model, config.block_size)
    heldout_blocks = None
    if context.is_main and heldout_stream.numel() > config.block_size:
        heldout_blocks = make_blocks(heldout_stream, config.block_size)[: config.eval_blocks]
    blocks_per_epoch = (train_stream.numel() - 1) // config.block_size
    micro_batches = config.grad_accum * context.world_size
    if blocks_per_epoch < micro_batches:
        raise ChatcoreError(
            f"the corpus makes {blocks_per_epoch} blocks of {config.block_size} tokens, fewer than the "
            f"{micro_batches} micro-batches of one step ({context.world_size} device(s) x grad_accum "
            f"{config.grad_accum}): use a smaller block size or a larger corpus"
        )
    global_batch = config.batch_size * micro_batches
    steps_per_epoch = max(1, blocks_per_epoch // global_batch)
    total_steps = max(1, int(config.epochs * steps_per_epoch))

    decay = [p for n, p in raw_model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in raw_model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate,
        betas=(0.9, 0.95),
        fused=device.startswith("cuda"),
    )
    step, tokens_seen, best_val, best_step, elapsed = 0, 0, float("inf"), -1, 0.0
    generator = torch.Generator().manual_seed(config.seed)
    if resume:
        if not checkpoint_path.exists():
            raise ChatcoreError(f"--resume: no checkpoint at {checkpoint_path}")
        state = torch.load(checkpoint_path, map_location=device, weights_only=False)
        raw_model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, tokens_seen = state["step"], state["tokens_seen"]
        best_val, best_step, elapsed = state["best_val"], state["best_step"], state["elapsed"]
        generator.set_state(state["generator"])
        if context.is_main:
            torch.set_rng_state(state["torch_rng"])
        saved_steps_per_epoch = state.get("steps_per_epoch", steps_per_epoch)
        if saved_steps_per_epoch != steps_per_epoch:
            # Another global batch (device count, batch size or accumulation): continue at
            # the same position in the epochs rather than at the same step number.
            step = round(step * steps_per_epoch / saved_steps_per_epoch)
            best_step = round(best_step * steps_per_epoch / saved_steps_per_epoch) if best_step >= 0 else best_step
            if context.is_main:
                logger.warning(
                    "resuming with %d blocks per step instead of %s: continuing at step %d of %d",
                    global_batch,
                    state.get("global_batch"),
                    step,
                    total_steps,
                )

    train_model = raw_model
    if context.enabled:
        from torch.nn.parallel import DistributedDataParallel

        # Wrapping broadcasts rank 0's weights, so every rank starts from the same model.
        device_ids = [context.local_rank] if device.startswith("cuda") else None
        train_model = DistributedDataParallel(raw_model, device_ids=device_ids)

    def save_checkpoint() -> None:
        torch.save(
            {
                "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "tokens_seen": tokens_seen,
                "best_val": best_val,
                "best_step": best_step,
                "elapsed": elapsed,
                "generator": generator.get_state(),
                "torch_rng": torch.get_rng_state(),
                "steps_per_epoch": steps_per_epoch,
                "global_batch": global_batch,
                "world_size": context.world_size,
                "config": asdict(config),
            },
            checkpoint_path,
        )

    def save_best() -> None:
        save_dtype = getattr(torch, config.save_dtype)
        best_dir = out_dir / "best"
        copy = type(raw_model)(raw_model.config)
        copy.load_state_dict({k: v.detach().cpu() for k, v in raw_model.state_dict().items()})
        copy.to(save_dtype)
        copy.config.dtype = config.save_dtype
        copy.save_pretrained(str(best_dir), max_shard_size=config.max_shard_size)
        tokenizer.save_pretrained(str(best_dir))

    def mean_over_ranks(value: "torch.Tensor") -> float:
        if context.enabled:
            import torch.distributed as dist

            value = value.detach().clone()
            dist.all_reduce(value)
            value /= context.world_size
        return value.item()

    show = progress and context.is_main
    bar = tqdm(total=total_steps, initial=step, disable=not show, unit="step", dynamic_ncols=True)
    started = time.perf_counter() - elapsed
    window_tokens, window_start = 0, time.perf_counter()
    loss_value = float("nan")
    epoch_blocks: "torch.Tensor | None" = None
    order: "torch.Tensor | None" = None
    while step < total_steps:
        epoch, within = divmod(step, steps_per_epoch)
        if within == 0 or epoch_blocks is None:
            # A new random offset each epoch so block boundaries move through the text;
            # seeded by the epoch alone, so every rank shuffles the same way.
            epoch_generator = torch.Generator().manual_seed(config.seed + epoch)
            offset = int(torch.randint(0, config.block_size, (1,), generator=epoch_generator))
            epoch_blocks = make_blocks(train_stream, config.block_size, offset)
            order = torch.randperm(epoch_blocks.size(0), generator=epoch_generator)
        assert order is not None
        pieces = step_shard(order, within, config.batch_size, config.grad_accum, context.world_size, context.rank)
        rows = sum(piece.numel() for piece in pieces)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, total_steps, config)
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=device)
        for number, piece in enumerate(pieces):
            batch = epoch_blocks[piece].to(device, non_blocking=True)  # (B, T + 1)
            last = number == len(pieces) - 1
            # Gradients are averaged across ranks once per step, on the last micro-batch.
            sync = contextlib.nullcontext() if last or not context.enabled else train_model.no_sync()
            with sync:
                with autocast():
                    logits = train_model(input_ids=batch[:, :-1]).logits  # (B, T, V)
                loss = torch.nn.functional.cross_entropy(
                    logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)
                )
                share = piece.numel() / rows  # the micro-batch's weight in this rank's mean
                scaler.scale(loss * share).backward()
            step_loss += loss.detach() * share
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), config.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        step += 1
        step_tokens = min(global_batch, order.numel() - within * global_batch) * config.block_size
        tokens_seen += step_tokens
        window_tokens += step_tokens
        if step % 10 == 0 or step == total_steps:
            loss_value = mean_over_ranks(step_loss)
            now = time.perf_counter()
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{window_tokens / max(1e-9, now - window_start):,.0f}")
            window_tokens, window_start = 0, now
        bar.update(1)
        if step % config.eval_every == 0 or step == total_steps:
            if context.is_main:
                if heldout_blocks is not None:
                    val = evaluate_loss(raw_model, heldout_blocks, config.batch_size, device, autocast)
                else:
                    val = loss_value
                if show:
                    bar.write(
                        f"step {step}/{total_steps}  train loss {loss_value:.4f}  held-out loss {val:.4f}  "
                        f"ppl {math.exp(min(val, 50)):.2f}"
                    )
                if val < best_val:
                    best_val, best_step = val, step
                    save_best()
                elapsed = time.perf_counter() - started
                save_checkpoint()
            barrier()  # the other ranks wait for rank 0's evaluation and checkpoint
    bar.close()
    elapsed = time.perf_counter() - started
    if context.enabled:
        import torch.distributed as dist

        shared = [best_val, best_step]
        dist.broadcast_object_list(shared, src=0)
        best_val, best_step = shared
    result = TrainResult(
        best_val_loss=best_val,
        best_step=best_step,
        steps=step,
        tokens_seen=tokens_seen,
        seconds=elapsed,
        parameters=sum(p.numel() for p in raw_model.parameters()),
    )
    if context.is_main:
        result_json = {
            **asdict(result),
            "best_val_perplexity": result.best_val_perplexity,
            "world_size": context.world_size,
            "global_batch": global_batch,
        }
        (out_dir / "result.json").write_text(json.dumps(result_json, indent=2))
    barrier()
    finish_distributed()
    return result
