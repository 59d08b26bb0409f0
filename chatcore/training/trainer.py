"""The training loop for chatcore's GPT-2-architecture chat models.

One loop serves forward and reverse models, from scratch or fine-tuned from a Hugging
Face model (``init_from``). Checkpoints hold the model, the optimizer, the scheduler and
the RNG state, so ``resume`` continues exactly. The best model by held-out loss is
saved as an ordinary Hugging Face folder.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatcore.errors import ChatcoreError

if TYPE_CHECKING:
    import torch


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
    save_dtype: str = "float16"
    max_shard_size: str = "15MB"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.epochs <= 0:
            raise ValueError(f"`epochs` must be positive, got {self.epochs}")
        for name in ("batch_size", "block_size", "eval_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        if self.learning_rate <= 0:
            raise ValueError(f"`learning_rate` must be positive, got {self.learning_rate}")
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

    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_path = out_dir / "checkpoint.pt"
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(config.seed)
    model.to(device)
    model.train()

    precision = config.precision
    if precision == "auto":
        precision = "bf16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "fp32":
        autocast = contextlib.nullcontext
    else:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        autocast = lambda: torch.autocast(device_type=device.split(":")[0], dtype=dtype)  # noqa: E731
    scaler = torch.amp.GradScaler(enabled=precision == "fp16")

    if config.block_size > model.config.n_positions:
        raise ChatcoreError(
            f"block size {config.block_size} exceeds the model's {model.config.n_positions} positions"
        )
    heldout_blocks = make_blocks(heldout_stream, config.block_size) if heldout_stream.numel() > config.block_size else None
    blocks_per_epoch = (train_stream.numel() - 1) // config.block_size
    steps_per_epoch = max(1, blocks_per_epoch // config.batch_size)
    total_steps = max(1, int(config.epochs * steps_per_epoch))

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
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
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, tokens_seen = state["step"], state["tokens_seen"]
        best_val, best_step, elapsed = state["best_val"], state["best_step"], state["elapsed"]
        generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])

    def save_checkpoint() -> None:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "tokens_seen": tokens_seen,
                "best_val": best_val,
                "best_step": best_step,
                "elapsed": elapsed,
                "generator": generator.get_state(),
                "torch_rng": torch.get_rng_state(),
                "config": asdict(config),
            },
            checkpoint_path,
        )

    def save_best() -> None:
        save_dtype = getattr(torch, config.save_dtype)
        best_dir = out_dir / "best"
        copy = type(model)(model.config)
        copy.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
        copy.to(save_dtype)
        copy.config.dtype = config.save_dtype
        copy.save_pretrained(str(best_dir), max_shard_size=config.max_shard_size)
        tokenizer.save_pretrained(str(best_dir))

    bar = tqdm(total=total_steps, initial=step, disable=not progress, unit="step", dynamic_ncols=True)
    started = time.perf_counter() - elapsed
    window_tokens, window_start = 0, time.perf_counter()
    loss_value = float("nan")
    epoch_blocks: "torch.Tensor | None" = None
    order: "torch.Tensor | None" = None
    while step < total_steps:
        epoch, within = divmod(step, steps_per_epoch)
        if within == 0 or epoch_blocks is None:
            # A new random offset each epoch so block boundaries move through the text.
            epoch_generator = torch.Generator().manual_seed(config.seed + epoch)
            offset = int(torch.randint(0, config.block_size, (1,), generator=epoch_generator))
            epoch_blocks = make_blocks(train_stream, config.block_size, offset)
            order = torch.randperm(epoch_blocks.size(0), generator=epoch_generator)
        assert order is not None
        index = order[within * config.batch_size : (within + 1) * config.batch_size]
        batch = epoch_blocks[index].to(device, non_blocking=True)  # (B, T + 1)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, total_steps, config)
        with autocast():
            logits = model(input_ids=batch[:, :-1]).logits  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        step += 1
        tokens_seen += batch[:, 1:].numel()
        window_tokens += batch[:, 1:].numel()
        if step % 10 == 0 or step == total_steps:
            loss_value = loss.item()
            now = time.perf_counter()
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{window_tokens / max(1e-9, now - window_start):,.0f}")
            window_tokens, window_start = 0, now
        bar.update(1)
        if step % config.eval_every == 0 or step == total_steps:
            if heldout_blocks is not None:
                val = evaluate_loss(model, heldout_blocks, config.batch_size, device, autocast)
            else:
                val = loss_value
            bar.write(f"step {step}/{total_steps}  train loss {loss_value:.4f}  held-out loss {val:.4f}  ppl {math.exp(min(val, 50)):.2f}")
            if val < best_val:
                best_val, best_step = val, step
                save_best()
            elapsed = time.perf_counter() - started
            save_checkpoint()
    bar.close()
    elapsed = time.perf_counter() - started
    result = TrainResult(
        best_val_loss=best_val,
        best_step=best_step,
        steps=step,
        tokens_seen=tokens_seen,
        seconds=elapsed,
        parameters=sum(p.numel() for p in model.parameters()),
    )
    (out_dir / "result.json").write_text(json.dumps({**asdict(result), "best_val_perplexity": result.best_val_perplexity}, indent=2))
    return result
