"""Training a CoCon block on a frozen base model (``chatcore train cocon``).

Data: dialogue text (chitchat by default) as one token stream, turns ending in EOS, cut
into windows of ``history_tokens + continuation_tokens``: a history (the prompt) and
its continuation. With ``min_history_tokens`` each batch keeps only the last h tokens of
the history, h drawn log-uniformly from [min_history_tokens, history_tokens], so the
block sees histories as long as chat prompts get, mostly short ones as in chat. Most
windows start their continuation at a turn start, as a reply does. Only the block (and,
for the adversarial loss, a small discriminator) learns.

The losses (Chan et al., 2021, section 3), each with its weight:

- self-reconstruction: the content is the continuation itself (or, in a share of the
  batches, a short random span of it, so that a word or a phrase, the content people
  give in chat, is in the training distribution too); the block must make LM-beta
  predict the continuation. For the whole-continuation content a self-token mask
  hides, from the position that predicts a token, the content position holding that
  very token, so that the block cannot simply copy position by position.
- null content: no content at all; plain language modelling through the block, so an
  empty content leaves the model's replies as they were.
- plain target (``plain_target``, not in the paper): at the positions where no content
  token is to be predicted (every position of the null loss, those outside a short
  content's span), that share of the target is the plain model's next-token
  distribution instead of the text's token. The text alone teaches the block to be
  another language model of the corpus, one whose replies the plain model finds
  less likely; the plain model's distribution teaches it to leave those positions as
  the plain model would write them and to change only what the content asks for.
- cycle reconstruction (from ``cycle_from_step``): generate a few tokens with the
  content of sample i after the history of sample i+1 (soft tokens, so gradients
  flow), then use that generation as the content to reconstruct sample i's own
  continuation after its own history.
- adversarial (from ``adv_from_step``): a discriminator tells the block's outputs
  during that generation from LM-alpha's hidden states of real text; the block is
  trained to fool it (the non-saturating form of the paper's minimax loss).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt, model_validator

from chatcore.api import ChatcoreError, Settings
from chatcore.training.interrupt import StopRequest

if TYPE_CHECKING:
    from .block import CoconBlock

BLOCK_DIR = "block"


Share = Annotated[float, Field(ge=0.0, le=1.0)]
Tokens = Annotated[int, Field(ge=1, le=8192)]
CoconPrecision = Literal["auto", "fp32", "bf16"]


class CoconTrainConfig(Settings):
    """How a CoCon block is trained (`chatcore train cocon`)."""

    out_dir: str
    model: str = "chatcore-tiny"
    """The frozen base model (bundled name, folder or hub id; GPT-2 or Llama family)."""
    corpus: str = "chitchat"
    """"chitchat" or a JSONL file of dialogues."""
    heldout: Annotated[float, Field(ge=0.0, le=0.5)] = 0.05
    """Share of the dialogues held out for evaluation."""
    prompt_format: str = "auto"
    """Prompt format the dialogues are rendered in, as chat renders prompts: auto (the model's chat
    template if it has one), chat-template, dialogpt, ..."""
    split_layer: Annotated[int, Field(ge=1, le=1000)] | None = None
    """The layer the block sits at: LM-alpha is blocks [0, split). Default: a third of the depth."""
    steps: Annotated[int, Field(ge=1, le=10**9)] = 2000
    """Steps of the whole run (the learning-rate schedule spans them)."""
    run_steps: Annotated[int, Field(ge=1, le=10**9)] | None = None
    """Stop after this many steps of this invocation and write the checkpoint (default: run to --steps);
    continue with --resume. A run trained in such chunks ends with the weights of one trained at once."""
    time_limit: Annotated[float, Field(gt=0.0)] | None = None
    """Stop once this invocation has trained this many minutes, after the step under way, and write the
    checkpoint; continue with --resume."""
    batch_size: Annotated[int, Field(ge=1, le=65536)] = 16
    history_tokens: Tokens = 32
    """The longest history (prompt) before a continuation."""
    min_history_tokens: Tokens | None = None
    """Draw each batch's history length log-uniformly from [this, history_tokens] (default:
    every history history_tokens long)."""
    continuation_tokens: Annotated[int, Field(ge=2, le=8192)] = 24
    content_max_tokens: Tokens | None = None
    """Longest content (default: the whole continuation)."""
    short_content_share: Share = 0.5
    """Share of batches whose content is a short span (a word, a phrase) of the continuation."""
    short_content_max_tokens: Tokens = 4
    """Longest short content span."""
    span_rarity: NonNegativeFloat = 1.0
    """Short spans start at token t with weight count(t) ** -span_rarity."""
    span_weight: NonNegativeFloat = 1.0
    """Weight, relative to the other positions, of the self loss at the positions a short content holds."""
    plain_target: Share = 0.0
    """Share of the target taken from the plain model's next-token distribution instead of the text,
    where no content token is due (the null loss; outside a short content's span)."""
    init_block: str | None = None
    """Start from this block's weights (a block folder or bundled name for the same model): fine-tune it."""
    turn_start_share: Share = 0.75
    """Share of windows whose continuation starts a turn."""
    no_history_share: Share = 0.05
    """Share of batches trained with the start vector, no history."""
    content_mask_prob: Share = 0.1
    """Content hidden states replaced by the mask vector."""
    self_token_mask: bool = True
    self_weight: NonNegativeFloat = 1.0
    """Weight of the self-reconstruction loss."""
    null_weight: NonNegativeFloat = 1.0
    """Weight of the null-content (plain LM) loss."""
    cycle_weight: NonNegativeFloat = 1.0
    """Weight of the cycle-reconstruction loss."""
    adv_weight: NonNegativeFloat = 0.2
    """Weight of the adversarial loss."""
    cycle_from_step: NonNegativeInt = 500
    adv_from_step: NonNegativeInt = 500
    cycle_tokens: Annotated[int, Field(ge=1, le=512)] = 8
    """Tokens generated for the cycle and adversarial losses."""
    cycle_batch_size: PositiveInt = 8
    disc_every: PositiveInt = 5
    learning_rate: Annotated[float, Field(ge=1e-8, le=1.0)] = 5e-4
    min_lr_ratio: float = 0.1
    warmup_steps: NonNegativeInt = 100
    weight_decay: NonNegativeFloat = 0.01
    grad_clip: float = 1.0
    dropout: float = 0.1
    eval_every: PositiveInt = 200
    """Steps between held-out evaluations (each also writes the checkpoint and the block)."""
    eval_windows: PositiveInt = 128
    """Held-out windows each evaluation scores."""
    seed: int = 1234
    device: str | None = None
    """cpu, cuda ... (default: cuda when present)."""
    precision: CoconPrecision = "auto"
    """auto: bf16 autocast on CUDA, fp32 elsewhere."""
    save_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    threads: Annotated[int, Field(ge=1, le=1024)] | None = None
    """torch CPU threads (default: torch's own choice)."""
    compile: bool = False
    """Run the frozen model's passes through torch.compile (on a GPU: fewer, fused kernels; the first steps wait)."""

    # Built once per run and never assigned afterwards, so the validator below may fill in
    # the defaults that follow other settings without running itself again.
    model_config = ConfigDict(validate_assignment=False)

    @model_validator(mode="after")
    def _lengths_fit(self) -> CoconTrainConfig:
        if self.content_max_tokens is None:
            self.content_max_tokens = self.continuation_tokens
        if self.min_history_tokens is None:
            self.min_history_tokens = self.history_tokens
        if self.min_history_tokens > self.history_tokens:
            raise ValueError(
                f"`min_history_tokens` ({self.min_history_tokens}) must not exceed "
                f"`history_tokens` ({self.history_tokens})"
            )
        if self.content_max_tokens > self.continuation_tokens:
            raise ValueError(
                f"`content_max_tokens` ({self.content_max_tokens}) must not exceed "
                f"`continuation_tokens` ({self.continuation_tokens})"
            )
        self.short_content_max_tokens = min(self.short_content_max_tokens, self.content_max_tokens)
        return self


# Settings that change how a run is cut or where it runs, not what it computes: a chunk may differ in them.
CHUNK_SETTINGS = frozenset({"out_dir", "run_steps", "time_limit", "threads", "device", "compile", "eval_every"})


def settings_changed(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """The settings that differ between a checkpoint's run and this one, as ``name a -> b, ...``
    (those of :data:`CHUNK_SETTINGS` left out); empty when none does."""
    return ", ".join(
        f"{name} {saved[name]!r} -> {now[name]!r}"
        for name in sorted(set(saved) & set(now) - CHUNK_SETTINGS)
        if saved[name] != now[name]
    )


@dataclass
class CoconTrainResult:
    steps: int
    seconds: float
    parameters: int
    heldout: dict[str, float]  # the latest held-out evaluation's losses (none before the first)
    block_dir: str
    heldout_step: int = 0  # the step of that evaluation


def norm_epsilon(model_config: Any) -> float:
    """The base model's norm epsilon (GPT-2's layer norm, the Llama family's RMSNorm), for
    the block's own layer norms."""
    for name in ("layer_norm_epsilon", "layer_norm_eps", "rms_norm_eps"):
        value = getattr(model_config, name, None)
        if isinstance(value, float) and value > 0:
            return value
    return 1e-5


def default_split_layer(n_layer: int) -> int:
    """About a third of the depth (the paper: after block 7 of GPT-2 medium's 24)."""
    return max(1, min(n_layer - 1, n_layer // 3))


# -- the loop ----------------------------------------------------------------------------


def _init_from_block(block: CoconBlock, name: str, model: Any, tokenizer: Any, model_name: str) -> dict[str, Any]:
    """Copy the weights of block ``name`` (trained for this very model) into ``block``;
    returns that block's training record (its config's ``training``)."""
    from .store import check_compatible, load_block, model_fingerprint, resolve_block

    fingerprint = model_fingerprint(model, tokenizer)
    folder = resolve_block(name, fingerprint, model_name)
    source, info = load_block(folder)
    check_compatible(info, fingerprint, name, model_name)
    shape = ("n_embd", "n_head", "split_layer", "n_inner")
    theirs = {key: getattr(source.config, key) for key in shape}
    ours = {key: getattr(block.config, key) for key in shape}
    if theirs != ours:
        raise ChatcoreError(
            f"--init-block {name!r} has another shape ({theirs}) than this run's block ({ours}); "
            f"give the same --split-layer"
        )
    block.load_state_dict({key: value.float() for key, value in source.state_dict().items()})
    return dict(info.get("training") or {})


def train_cocon(config: CoconTrainConfig, resume: bool = False, progress: bool = True) -> CoconTrainResult:
    """Train a CoCon block for ``config.model``; writes OUT/checkpoint/ and OUT/block/.

    Accelerate places the block, runs bf16 autocast, clips gradients and checkpoints the
    run (block, discriminator, both optimizers, the learning-rate scheduler, the random
    state, the window generator and the loop's counters), so ``resume`` continues exactly."""
    import torch
    from torch.nn import functional as F
    from tqdm.auto import tqdm

    from chatcore.api import anatomy_of, load_model
    from chatcore.training.accelerated import (
        CHECKPOINT_DIR,
        Progress,
        checkpoint_to_resume,
        distributed_context,
        load_checkpoint,
        make_accelerator,
        partial_folder,
        read_progress,
        replace_folder,
        save_checkpoint,
    )
    from chatcore.training.corpus import load_corpus, split_heldout
    from chatcore.training.data import encode_dialogues
    from chatcore.training.formats import prompt_format_for
    from chatcore.training.schedule import move_schedule, warmup_cosine

    from .block import CoconBlock, CoconConfig
    from .compiled import compile_halves, uncompile_halves
    from .heldout import heldout_losses
    from .losses import CoconLosses, HiddenDiscriminator
    from .model_split import SplitModel
    from .pipeline import CoconPipeline
    from .store import model_fingerprint, save_block
    from .windows import WindowSampler, render_dialogues

    if distributed_context().enabled:
        raise ChatcoreError("chatcore train cocon runs in one process: start it without torchrun")
    if config.threads:
        torch.set_num_threads(config.threads)
    out_dir = Path(config.out_dir)
    checkpoint = checkpoint_to_resume(out_dir) if resume else out_dir / CHECKPOINT_DIR
    accelerator = make_accelerator(config.device, config.precision)
    device = str(accelerator.device)
    autocast = accelerator.autocast
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)

    loaded = load_model(config.model, device=device, dtype="float32")
    model, tokenizer = loaded.model, loaded.tokenizer
    model.eval()
    model.requires_grad_(False)
    n_layer = anatomy_of(model).n_layer
    split_layer = config.split_layer or default_split_layer(n_layer)
    if split_layer >= n_layer:
        raise ChatcoreError(
            f"--split-layer {split_layer} leaves no blocks for LM-beta: model {config.model!r} has "
            f"{n_layer}; give 1 to {n_layer - 1}"
        )
    split = SplitModel(model, split_layer)
    if config.compile:
        compile_halves(split)
    block_config = CoconConfig(
        n_embd=split.n_embd,
        n_head=split.n_head,
        split_layer=split_layer,
        layer_norm_epsilon=norm_epsilon(model.config),
        dropout=config.dropout,
    )
    block = CoconBlock(block_config).to(device)
    init_training: dict[str, Any] | None = None  # the starting block's own record, kept with the new one
    if config.init_block is not None and not resume:
        init_training = _init_from_block(block, config.init_block, model, tokenizer, config.model)
    block.train()
    pipeline = CoconPipeline(split, block)
    discriminator = HiddenDiscriminator(split.n_embd).to(device)
    window_length = config.history_tokens + config.continuation_tokens
    if window_length > loaded.max_positions:
        raise ChatcoreError(f"windows of {window_length} tokens exceed the model's {loaded.max_positions} positions")

    train_set, heldout_set = split_heldout(load_corpus(config.corpus), config.heldout)
    if not train_set:
        raise ChatcoreError("the training split is empty: lower the held-out fraction or add dialogues")
    eos = loaded.eos_token_id
    prompt_format = prompt_format_for(config.prompt_format, model, tokenizer, config.model)
    if prompt_format.name == "dialogpt":  # turns joined by EOS: every turn start is a reply start
        train_stream, train_starts = encode_dialogues(train_set, tokenizer), None
        heldout_stream, heldout_starts = (
            (encode_dialogues(heldout_set, tokenizer), None) if heldout_set else (train_stream, None)
        )
    else:
        train_stream, train_starts = render_dialogues(train_set, prompt_format)
        heldout_stream, heldout_starts = (
            render_dialogues(heldout_set, prompt_format) if heldout_set else (train_stream, train_starts)
        )
    if heldout_set and heldout_stream.numel() < window_length + 1:
        raise ChatcoreError(
            f"the held-out split (--heldout {config.heldout}) has {heldout_stream.numel()} tokens, too few for "
            f"one window of {window_length}: give a larger --heldout or a longer corpus"
        )
    sampler = WindowSampler(
        train_stream, eos, config.history_tokens, config.continuation_tokens, config.turn_start_share, train_starts
    )
    heldout_sampler = WindowSampler(
        heldout_stream, eos, config.history_tokens, config.continuation_tokens, config.turn_start_share, heldout_starts
    )
    heldout_windows = heldout_sampler.sample(config.eval_windows, torch.Generator().manual_seed(config.seed + 1))

    decay = [p for p in block.parameters() if p.dim() >= 2]
    no_decay = [p for p in block.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate,
        betas=(0.9, 0.98),
    )
    disc_optimizer = torch.optim.AdamW(discriminator.parameters(), lr=config.learning_rate, betas=(0.5, 0.98))
    schedule = warmup_cosine(optimizer, config.warmup_steps, config.steps, config.min_lr_ratio)
    block, discriminator, optimizer, disc_optimizer, _ = accelerator.prepare(
        block, discriminator, optimizer, disc_optimizer, schedule
    )
    state = Progress()
    accelerator.register_for_checkpointing(state)
    generator = torch.Generator().manual_seed(config.seed)
    step, elapsed = 0, 0.0
    history: list[dict[str, float]] = []
    if resume:
        saved_block = read_progress(checkpoint)["block_config"]
        differences = settings_changed(saved_block, block_config.to_dict())
        if differences:
            raise ChatcoreError(
                f"--resume: the checkpoint in {checkpoint} holds a block of other settings ({differences}): "
                f"give the settings it was started with"
            )
        load_checkpoint(accelerator, checkpoint)
        saved = state.values
        step, elapsed, history = saved["step"], saved["elapsed"], saved["history"]
        init_training = saved["init_training"]
        changed = settings_changed(saved.get("config") or {}, config.model_dump())
        if changed:
            print(
                f"chatcore: resuming with other settings than the run had: {changed} (its chunks then "
                f"do not end as one uncut run would)",
                file=sys.stderr,
            )
        generator.set_state(saved["generator"])
        move_schedule(schedule, step, config.learning_rate)

    base_model = {"name": config.model, "fingerprint": model_fingerprint(model, tokenizer)}
    token_counts = torch.bincount(train_stream, minlength=int(model.get_input_embeddings().weight.shape[0]))
    losses_fn = CoconLosses(pipeline, config, token_counts)

    def save(heldout: dict[str, float]) -> None:
        state.values = {
            "step": step,
            "elapsed": elapsed,
            "history": history,
            "generator": generator.get_state(),
            "block_config": block_config.to_dict(),
            "config": config.model_dump(),
            "init_training": init_training,
        }
        save_checkpoint(accelerator, checkpoint)
        training = {
            "corpus": config.corpus,
            "steps": step,
            "seconds": round(elapsed, 1),
            "heldout_loss": {k: round(v, 4) for k, v in heldout.items()},
            "settings": {k: v for k, v in config.model_dump().items() if k not in ("out_dir", "extra", "device")},
        }
        if init_training is not None:
            training["init_block_training"] = init_training
        # Whole or not at all, as the checkpoint: a stop leaves the previous block/ or the new one.
        written = partial_folder(out_dir / BLOCK_DIR)
        save_block(block, written, base_model, training, dtype=config.save_dtype)
        replace_folder(written, out_dir / BLOCK_DIR)

    weights = {"self": config.self_weight, "null": config.null_weight, "cycle": config.cycle_weight}
    weights["adv"] = config.adv_weight

    def cuda_rng_state() -> Any:
        return torch.cuda.get_rng_state(device) if device.startswith("cuda") else None

    def block_gradients(with_cycle: bool, with_adv: bool) -> Any:
        """Draw a batch, compute its losses and leave their gradients on the block."""
        windows = sampler.sample(config.batch_size, generator).to(device)
        with autocast():
            batch = losses_fn(windows, generator, with_cycle, with_adv)
            if batch.fake is not None:
                # Non-saturating generator loss: the block's outputs should look real.
                batch.losses["adv"] = F.binary_cross_entropy_with_logits(
                    discriminator(batch.fake).float(), torch.ones(batch.fake.size(0), device=device)
                )
        total = sum(weights[name] * value for name, value in batch.losses.items())
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(total)
        return batch

    bar = tqdm(total=config.steps, initial=step, disable=not progress, unit="step", dynamic_ncols=True)
    started = time.perf_counter() - elapsed
    heldout: dict[str, float] = history[-1] if history else {}
    running: dict[str, float] = {}
    # A chunk ends at its step or time limit with a checkpoint and no evaluation, so the
    # random state, the generator and the weights are those an uncut run has at that step.
    chunk_end = config.steps if config.run_steps is None else min(config.steps, step + config.run_steps)
    deadline = None if config.time_limit is None else time.perf_counter() + 60.0 * config.time_limit
    # Ctrl-C ends the run as a chunk does: after the step, with a checkpoint.
    with StopRequest(bar.write if progress else lambda line: print(line, file=sys.stderr)) as stop:
        while step < config.steps:
            if step >= chunk_end or stop.requested or (deadline is not None and time.perf_counter() >= deadline):
                elapsed = time.perf_counter() - started
                if not history or history[-1]["step"] != step:
                    save(heldout)
                break
            with_cycle = config.cycle_weight > 0 and step >= config.cycle_from_step
            with_adv = config.adv_weight > 0 and step >= config.adv_from_step
            for group in disc_optimizer.param_groups:  # the discriminator follows the block's schedule
                group["lr"] = schedule.get_last_lr()[0]
            drawn = (generator.get_state(), torch.random.get_rng_state(), cuda_rng_state())  # windows, dropout
            try:
                batch = block_gradients(with_cycle, with_adv)
            except Exception as error:
                # --compile: a backward kernel that fails to compile fails here, after its forward.
                if not (config.compile and uncompile_halves(split, error)):
                    raise
                generator.set_state(drawn[0])  # the step again, uncompiled, as it was drawn
                torch.random.set_rng_state(drawn[1])
                if drawn[2] is not None:
                    torch.cuda.set_rng_state(drawn[2], device)
                batch = block_gradients(with_cycle, with_adv)
            losses, fake = batch.losses, batch.fake
            accelerator.clip_grad_norm_(block.parameters(), config.grad_clip)
            optimizer.step()
            discriminator.zero_grad(set_to_none=True)  # the generator loss above left gradients there

            if fake is not None and step % config.disc_every == 0:
                with autocast():
                    assert batch.real is not None
                    real_logits = discriminator(batch.real.detach()).float()
                    fake_logits = discriminator(fake.detach()).float()
                    disc_loss = F.binary_cross_entropy_with_logits(
                        real_logits, torch.ones_like(real_logits)
                    ) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))
                disc_optimizer.zero_grad(set_to_none=True)
                accelerator.backward(disc_loss)
                disc_optimizer.step()
                losses["disc"] = disc_loss

            schedule.step()
            step += 1
            for name, value in losses.items():
                current = float(value.detach())
                running[name] = 0.9 * running.get(name, current) + 0.1 * current
            bar.set_postfix({name: f"{value:.3f}" for name, value in running.items()})
            bar.update(1)
            if step % config.eval_every == 0 or step == config.steps:
                elapsed = time.perf_counter() - started
                heldout = heldout_losses(pipeline, heldout_windows, config, autocast, token_counts)
                history.append({"step": step, **heldout})
                bar.write(
                    f"step {step}/{config.steps}  held-out loss: plain {heldout['plain']:.4f}  "
                    f"no content {heldout['null']:.4f}  self-reconstruction {heldout['self']:.4f}  "
                    f"one-token content {heldout['word']:.4f}  KL(plain || no content) {heldout['null_kl']:.4f}"
                )
                save(heldout)
    bar.close()
    elapsed = time.perf_counter() - started
    result = CoconTrainResult(
        steps=step,
        seconds=elapsed,
        parameters=sum(p.numel() for p in block.parameters()),
        heldout={k: v for k, v in heldout.items() if k != "step"},
        block_dir=str(out_dir / BLOCK_DIR),
        heldout_step=int(history[-1]["step"]) if history else 0,
    )
    (out_dir / "result.json").write_text(json.dumps(asdict(result), indent=2) + "\n")
    return result
