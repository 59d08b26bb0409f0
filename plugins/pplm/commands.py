"""``chatcore train discriminator``: train a PPLM discriminator head on a frozen model (see
:mod:`chatcore.plugins.pplm.train_discriminator`)."""

from __future__ import annotations

import click

from chatcore.api import OptionError


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
@click.option(
    "--layer",
    type=int,
    default=-1,
    show_default=True,
    help="Hidden-state layer the head reads (-1: the last, after the final norm).",
)
@click.option(
    "--per-class",
    type=click.IntRange(10, 10**7),
    default=3000,
    show_default=True,
    help="At most this many examples per class (classes are balanced).",
)
@click.option("--epochs", type=click.IntRange(1, 100_000), default=300, show_default=True)
@click.option("--lr", "learning_rate", type=click.FloatRange(1e-6, 10.0), default=0.01, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default=None)
def train_discriminator_command(
    model: str,
    data: str | None,
    builtin: str | None,
    out_path: str,
    layer: int,
    per_class: int,
    epochs: int,
    learning_rate: float,
    seed: int,
    device: str | None,
) -> None:
    """Train a PPLM discriminator head on a frozen model.

    The head is a linear classifier on the mean hidden state of "EOS + text" at LAYER;
    it is saved with the model's hidden size, layer count and tokenizer fingerprint, and
    `pplm discriminator=FILE class_label=LABEL` refuses it on any other model.
    """
    from chatcore.api import load_model

    from .train_discriminator import (
        TrainSettings,
        read_labelled_file,
        sentiment_examples,
        train_discriminator,
    )

    if (data is None) == (builtin is None):
        raise OptionError("give exactly one of --data FILE and --builtin sentiment")
    examples = read_labelled_file(data) if data is not None else sentiment_examples()
    loaded = load_model(model, device=device)
    settings = TrainSettings(layer=layer, per_class=per_class, epochs=epochs, learning_rate=learning_rate, seed=seed)
    result = train_discriminator(
        loaded,
        examples,
        out_path,
        settings,
        source=data if data is not None else f"builtin:{builtin}",
        progress=lambda message: click.echo(message, err=True),
    )
    click.echo(result.summary())
