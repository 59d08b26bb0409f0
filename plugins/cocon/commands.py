"""``chatcore train cocon``: train a CoCon block for a frozen base model (see
:mod:`chatcore.plugins.cocon.training`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from chatcore.api import OptionError

if TYPE_CHECKING:
    from .training import CoconPrecision


@click.command("cocon")
@click.option(
    "-m",
    "--model",
    default="chatcore-tiny",
    show_default=True,
    help="The frozen base model (bundled name, folder or hub id; GPT-2 or Llama family).",
)
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Run folder: checkpoint/, and block/ (the block to load with block=OUT/block).",
)
@click.option("--corpus", default="chitchat", show_default=True, help='"chitchat" or a JSONL file of dialogues.')
@click.option("--heldout", type=click.FloatRange(0, 0.5), default=0.05, show_default=True)
@click.option(
    "--format",
    "prompt_format",
    default="auto",
    show_default=True,
    help="Prompt format the dialogues are rendered in, as chat renders prompts: auto (the model's chat "
    "template if it has one), chat-template, dialogpt, ...",
)
@click.option(
    "--split-layer",
    type=click.IntRange(1, 1000),
    default=None,
    help="LM-alpha is blocks [0, split). Default: a third of the depth.",
)
@click.option("--steps", type=click.IntRange(1, 10**9), default=2000, show_default=True)
@click.option("--batch-size", type=click.IntRange(1, 65536), default=16, show_default=True)
@click.option(
    "--history-tokens",
    type=click.IntRange(1, 8192),
    default=32,
    show_default=True,
    help="The longest history (prompt) before a continuation.",
)
@click.option(
    "--min-history-tokens",
    type=click.IntRange(1, 8192),
    default=None,
    help="Draw each batch's history length log-uniformly from [this, --history-tokens] "
    "(default: every history --history-tokens long).",
)
@click.option("--continuation-tokens", type=click.IntRange(2, 8192), default=24, show_default=True)
@click.option(
    "--content-max-tokens",
    type=click.IntRange(1, 8192),
    default=None,
    help="Longest content (default: the whole continuation).",
)
@click.option(
    "--short-content-share",
    type=click.FloatRange(0, 1),
    default=0.5,
    show_default=True,
    help="Share of batches whose content is a short span (a word, a phrase) of the continuation.",
)
@click.option(
    "--short-content-max-tokens",
    type=click.IntRange(1, 8192),
    default=4,
    show_default=True,
    help="Longest short content span.",
)
@click.option(
    "--span-weight",
    type=click.FloatRange(0),
    default=1.0,
    show_default=True,
    help="Weight, relative to the other positions, of the self loss at the positions a short content holds.",
)
@click.option(
    "--plain-target",
    type=click.FloatRange(0, 1),
    default=0.0,
    show_default=True,
    help="Share of the target taken from the plain model's next-token distribution instead of the "
    "text, where no content token is due (the null loss; outside a short content's span).",
)
@click.option(
    "--init-block",
    default=None,
    help="Start from this block's weights (a block folder or bundled name for the same model): fine-tune it.",
)
@click.option(
    "--self-weight",
    type=click.FloatRange(0),
    default=1.0,
    show_default=True,
    help="Weight of the self-reconstruction loss.",
)
@click.option(
    "--null-weight",
    type=click.FloatRange(0),
    default=1.0,
    show_default=True,
    help="Weight of the null-content (plain LM) loss.",
)
@click.option(
    "--cycle-weight",
    type=click.FloatRange(0),
    default=1.0,
    show_default=True,
    help="Weight of the cycle-reconstruction loss.",
)
@click.option(
    "--adv-weight", type=click.FloatRange(0), default=0.2, show_default=True, help="Weight of the adversarial loss."
)
@click.option("--cycle-from-step", type=click.IntRange(0), default=500, show_default=True)
@click.option("--adv-from-step", type=click.IntRange(0), default=500, show_default=True)
@click.option(
    "--cycle-tokens",
    type=click.IntRange(1, 512),
    default=8,
    show_default=True,
    help="Tokens generated for the cycle and adversarial losses.",
)
@click.option("--lr", "learning_rate", type=click.FloatRange(1e-8, 1.0), default=5e-4, show_default=True)
@click.option("--warmup-steps", type=click.IntRange(0), default=100, show_default=True)
@click.option(
    "--eval-every",
    type=click.IntRange(1),
    default=200,
    show_default=True,
    help="Steps between held-out evaluations (each also writes the checkpoint and the block).",
)
@click.option(
    "--eval-windows",
    type=click.IntRange(1),
    default=128,
    show_default=True,
    help="Held-out windows each evaluation scores.",
)
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--device", default=None, help="cpu, cuda ... (default: cuda when present).")
@click.option(
    "--precision",
    type=click.Choice(["auto", "fp32", "bf16"]),
    default="auto",
    show_default=True,
    help="auto: bf16 autocast on CUDA, fp32 elsewhere.",
)
@click.option(
    "--threads", type=click.IntRange(1, 1024), default=None, help="torch CPU threads (default: torch's own choice)."
)
@click.option("--resume", is_flag=True, help="Continue from OUT/checkpoint/.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def cocon_command(
    model: str,
    out_dir: str,
    corpus: str,
    heldout: float,
    prompt_format: str,
    split_layer: int | None,
    steps: int,
    batch_size: int,
    history_tokens: int,
    min_history_tokens: int | None,
    continuation_tokens: int,
    content_max_tokens: int | None,
    short_content_share: float,
    short_content_max_tokens: int,
    span_weight: float,
    plain_target: float,
    init_block: str | None,
    self_weight: float,
    null_weight: float,
    cycle_weight: float,
    adv_weight: float,
    cycle_from_step: int,
    adv_from_step: int,
    cycle_tokens: int,
    learning_rate: float,
    warmup_steps: int,
    eval_every: int,
    eval_windows: int,
    seed: int,
    device: str | None,
    precision: "CoconPrecision",
    threads: int | None,
    resume: bool,
    quiet: bool,
) -> None:
    """Train a CoCon block for a frozen base model on dialogue text.

    Losses: self-reconstruction and null content from the start; cycle reconstruction
    and adversarial from --cycle-from-step / --adv-from-step. Load the result with
    --steer "cocon content=WORD block=OUT/block".
    """
    from chatcore.api import registry_of, validate_format_name

    from .training import CoconTrainConfig, train_cocon

    validate_format_name(prompt_format, registry_of())  # an unknown name fails before the model loads
    try:
        config = CoconTrainConfig(
            out_dir=out_dir,
            model=model,
            corpus=corpus,
            heldout=heldout,
            prompt_format=prompt_format,
            split_layer=split_layer,
            steps=steps,
            batch_size=batch_size,
            history_tokens=history_tokens,
            min_history_tokens=min_history_tokens,
            continuation_tokens=continuation_tokens,
            content_max_tokens=content_max_tokens,
            short_content_share=short_content_share,
            short_content_max_tokens=short_content_max_tokens,
            span_weight=span_weight,
            plain_target=plain_target,
            init_block=init_block,
            self_weight=self_weight,
            null_weight=null_weight,
            cycle_weight=cycle_weight,
            adv_weight=adv_weight,
            cycle_from_step=cycle_from_step,
            adv_from_step=adv_from_step,
            cycle_tokens=cycle_tokens,
            learning_rate=learning_rate,
            warmup_steps=warmup_steps,
            eval_every=eval_every,
            eval_windows=eval_windows,
            seed=seed,
            device=device,
            precision=precision,
            threads=threads,
        )
    except ValueError as error:
        raise OptionError(str(error)) from None
    result = train_cocon(config, resume=resume, progress=not quiet)
    losses = ", ".join(f"{name} {value:.4f}" for name, value in result.heldout.items())
    click.echo(
        f"{result.steps} steps in {result.seconds:.0f} s; held-out loss: {losses}; "
        f"{result.parameters:,} block parameters; block in {result.block_dir}"
    )
