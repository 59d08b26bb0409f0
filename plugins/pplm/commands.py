"""``chatcore train discriminator``: train a PPLM discriminator head on a frozen model (see
:mod:`chatcore.plugins.pplm.train_discriminator`)."""

from __future__ import annotations

from typing import Any

import click

from chatcore.api import OptionError, options_from_model, output_file

from .train_discriminator import TrainSettings


@click.command("discriminator")
@click.option("-m", "--model", default="chatcore-tiny", show_default=True, help="The frozen base model.")
@click.option(
    "--data", default=None, help='Labelled texts: "label<TAB>text" lines, or JSONL {"label": ..., "text": ...}.'
)
@click.option(
    "--builtin",
    type=click.Choice(["sentiment"]),
    default=None,
    help="Built-in labels instead of --data: chitchat utterances labelled by VADER (needs the vaderSentiment package).",
)
@click.option(
    "--out", "out_path", required=True, type=click.Path(dir_okay=False), help="Head file to write (.safetensors)."
)
@options_from_model(TrainSettings, ("layer", "per_class", "epochs", "learning_rate", "seed"), {"learning_rate": "--lr"})
@click.option("--device", default=None)
@click.option("--force", is_flag=True, help="Replace an existing --out file.")
def train_discriminator_command(
    model: str,
    data: str | None,
    builtin: str | None,
    out_path: str,
    device: str | None,
    force: bool,
    **settings: Any,
) -> None:
    """Train a PPLM discriminator head on a frozen model.

    The head is a linear classifier on the mean hidden state of "EOS + text" at LAYER;
    it is saved with the model's hidden size, layer count and tokenizer fingerprint, and
    `pplm discriminator=FILE class_label=LABEL` refuses it on any other model.
    """
    from chatcore.api import load_model

    from .train_discriminator import (
        read_labelled_file,
        sentiment_examples,
        train_discriminator,
    )

    if (data is None) == (builtin is None):
        raise OptionError("give exactly one of --data FILE and --builtin sentiment")
    training = TrainSettings(**settings)  # out-of-range values fail before the model loads
    if not out_path.endswith(".safetensors"):
        raise OptionError(f"--out {out_path!r}: a head is written as a .safetensors file (name it so)")
    output_file(out_path, replace=force)
    examples = read_labelled_file(data) if data is not None else sentiment_examples()
    loaded = load_model(model, device=device)
    result = train_discriminator(
        loaded,
        examples,
        out_path,
        training,
        source=data if data is not None else f"builtin:{builtin}",
        progress=lambda message: click.echo(message, err=True),
    )
    click.echo(result.summary())
