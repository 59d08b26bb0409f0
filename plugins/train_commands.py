"""``chatcore train``: tokenizer, forward model and reverse (MMI) model training."""

from __future__ import annotations

import click

import chatcore


@click.group()
def train() -> None:
    """Train a tokenizer or a dialogue model (forward, or reverse for MMI).

    Corpora: "chitchat" (built in) or a JSONL file, one dialogue per line:
    {"id": "...", "turns": ["hi", "hello, how are you?", ...]}.
    The held-out split is by dialogue and the same for every command.
    """


corpus_option = click.option("--corpus", default="chitchat", show_default=True, help='"chitchat" or a JSONL file.')
heldout_option = click.option("--heldout", type=click.FloatRange(0, 0.5), default=0.05, show_default=True,
                              help="Share of dialogues held out for evaluation.")


@train.command("tokenizer")
@corpus_option
@heldout_option
@click.option("--vocab-size", type=click.IntRange(300, 1_000_000), default=8192, show_default=True)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder to write.")
def train_tokenizer(corpus: str, heldout: float, vocab_size: int, out_dir: str) -> None:
    """Train a byte-level BPE tokenizer on the training split."""
    from chatcore.training.pipeline import train_tokenizer_command

    path = train_tokenizer_command(corpus, out_dir, vocab_size, heldout)
    click.echo(f"tokenizer saved to {path}")


@train.command("model")
@corpus_option
@heldout_option
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Run folder: checkpoint.pt, and best/ (a Hugging Face model folder).")
@click.option("--reverse", is_flag=True, help="Train the reverse model P(source | response) for MMI.")
@click.option("--tokenizer", "tokenizer_path", default=None, help="Tokenizer folder (default: train one).")
@click.option("--init-from", default=None, help="Fine-tune this model (bundled name, folder or hub id).")
@click.option("--vocab-size", type=click.IntRange(300, 1_000_000), default=8192, show_default=True)
@click.option("--n-layer", type=click.IntRange(1, 96), default=6, show_default=True)
@click.option("--n-embd", type=click.IntRange(8, 8192), default=384, show_default=True)
@click.option("--n-head", type=click.IntRange(1, 128), default=6, show_default=True)
@click.option("--n-positions", type=click.IntRange(16, 8192), default=512, show_default=True)
@click.option("--dropout", type=click.FloatRange(0, 0.9), default=0.1, show_default=True)
@click.option("--epochs", type=click.FloatRange(0.001, 10_000), default=10.0, show_default=True)
@click.option("--batch-size", type=click.IntRange(1, 65536), default=32, show_default=True)
@click.option("--block-size", type=click.IntRange(8, 8192), default=256, show_default=True)
@click.option("--lr", "learning_rate", type=click.FloatRange(1e-8, 1.0), default=1e-3, show_default=True)
@click.option("--warmup-steps", type=click.IntRange(0, 10**9), default=100, show_default=True)
@click.option("--eval-every", type=click.IntRange(1, 10**9), default=200, show_default=True)
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--device", default=None, help="cpu, cuda ... (default: cuda when present).")
@click.option("--precision", type=click.Choice(["auto", "fp32", "bf16", "fp16"]), default="auto", show_default=True)
@click.option("--save-dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float16", show_default=True)
@click.option("--resume", is_flag=True, help="Continue from OUT/checkpoint.pt.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def train_model(corpus: str, heldout: float, out_dir: str, reverse: bool, tokenizer_path: str | None,
                init_from: str | None, vocab_size: int, n_layer: int, n_embd: int, n_head: int, n_positions: int,
                dropout: float, epochs: float, batch_size: int, block_size: int, learning_rate: float,
                warmup_steps: int, eval_every: int, seed: int, device: str | None, precision: str,
                save_dtype: str, resume: bool, quiet: bool) -> None:
    """Train a GPT-2-architecture dialogue model from scratch, or fine-tune one."""
    from chatcore.errors import OptionError
    from chatcore.training.pipeline import train_model_command
    from chatcore.training.trainer import ModelShape, TrainConfig

    try:
        shape = ModelShape(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions, dropout=dropout)
        config = TrainConfig(out_dir=out_dir, epochs=epochs, batch_size=batch_size, block_size=block_size,
                             learning_rate=learning_rate, warmup_steps=warmup_steps, eval_every=eval_every,
                             seed=seed, device=device, precision=precision, save_dtype=save_dtype)
    except ValueError as error:
        raise OptionError(str(error)) from None
    result = train_model_command(corpus, config, shape, tokenizer_path=tokenizer_path, init_from=init_from,
                                 reverse=reverse, heldout=heldout, vocab_size=vocab_size, resume=resume,
                                 progress=not quiet)
    click.echo(f"best held-out loss {result.best_val_loss:.4f} (perplexity {result.best_val_perplexity:.2f}) "
               f"at step {result.best_step}; {result.parameters:,} parameters; model in {out_dir}/best")


@chatcore.hookimpl(trylast=True)
def register_commands(cli: click.Group) -> None:
    cli.add_command(train)
