"""``chatcore train cocon``: train a CoCon block for a frozen base model (see
:mod:`chatcore.plugins.cocon.training`)."""

from __future__ import annotations

from typing import Any

import click

from chatcore.api import OptionError, options_from_model, removed_if_left_empty, run_folder

from .training import CoconTrainConfig

# The settings the command sets, in the order --help lists them; each option's default,
# bounds and help come from CoconTrainConfig.
OPTIONS = (
    "model",
    "corpus",
    "heldout",
    "prompt_format",
    "split_layer",
    "steps",
    "run_steps",
    "time_limit",
    "batch_size",
    "history_tokens",
    "min_history_tokens",
    "continuation_tokens",
    "content_max_tokens",
    "short_content_share",
    "short_content_max_tokens",
    "span_weight",
    "plain_target",
    "init_block",
    "self_weight",
    "null_weight",
    "cycle_weight",
    "adv_weight",
    "cycle_from_step",
    "adv_from_step",
    "cycle_tokens",
    "learning_rate",
    "warmup_steps",
    "eval_every",
    "eval_windows",
    "seed",
    "device",
    "precision",
    "threads",
    "compile",
)
RENAMES: dict[str, str | tuple[str, ...]] = {
    "model": ("-m", "--model"),
    "prompt_format": "--format",
    "learning_rate": "--lr",
}


@click.command("cocon")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Run folder: checkpoint/, and block/ (the block to load with block=OUT/block).",
)
@options_from_model(CoconTrainConfig, OPTIONS, RENAMES)
@click.option("--resume", is_flag=True, help="Continue from OUT/checkpoint/.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def cocon_command(out_dir: str, resume: bool, quiet: bool, **settings: Any) -> None:
    """Train a CoCon block for a frozen base model on dialogue text.

    Losses: self-reconstruction and null content from the start; cycle reconstruction
    and adversarial from --cycle-from-step / --adv-from-step. Load the result with
    --steer "cocon content=WORD block=OUT/block".
    """
    from chatcore.api import registry_of, validate_format_name

    from .training import train_cocon

    validate_format_name(settings["prompt_format"], registry_of())  # an unknown name fails before the model loads
    try:
        config = CoconTrainConfig(out_dir=out_dir, **settings)
    except ValueError as error:
        raise OptionError(str(error)) from None
    with removed_if_left_empty(out_dir):
        run_folder(out_dir, resume, ("checkpoint", "block"))
        result = train_cocon(config, resume=resume, progress=not quiet)
    losses = ", ".join(f"{name} {value:.4f}" for name, value in result.heldout.items()) or "none yet"
    at = result.heldout_step if result.heldout and result.heldout_step != result.steps else None
    losses += f" (at step {at})" if at else ""
    click.echo(
        f"{result.steps} steps in {result.seconds:.0f} s; held-out loss: {losses}; "
        f"{result.parameters:,} block parameters; block in {result.block_dir}"
    )
    if result.steps < config.steps:
        click.echo(f"stopped at step {result.steps} of {config.steps}: continue with --resume")
