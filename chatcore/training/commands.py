"""``chatcore train``: data filtering, tokenizer, forward model and reverse (MMI) model training."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

import chatcore
from chatcore.cli.options import options_from_model
from chatcore.cli.train import train, train_group
from chatcore.training.trainer import ModelShape, TrainConfig

if TYPE_CHECKING:
    from chatcore.training.filtering import FilterConfig, FilterReport


# What `train model` sets of the model's shape and of its training, in the order --help
# lists them; each option's default, bounds and help come from the model's field.
SHAPE_OPTIONS = ("n_layer", "n_embd", "n_head", "n_positions", "dropout")
TRAIN_OPTIONS = (
    "epochs",
    "batch_size",
    "grad_accum",
    "block_size",
    "learning_rate",
    "warmup_steps",
    "eval_every",
    "eval_blocks",
    "seed",
    "device",
    "precision",
    "save_dtype",
)

corpus_option = click.option("--corpus", default="chitchat", show_default=True, help='"chitchat" or a JSONL file.')
heldout_option = click.option(
    "--heldout",
    type=click.FloatRange(0, 0.5),
    default=0.05,
    show_default=True,
    help="Share of dialogues held out for evaluation.",
)


def filter_options(with_switch: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options that configure the filtering stage, shared by the train commands."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        options = [
            click.option(
                "--filter-config",
                type=click.Path(dir_okay=False),
                default=None,
                help="JSON or TOML file of filter settings (see docs/training-data.md).",
            ),
            click.option(
                "--filter-disable",
                default="",
                metavar="RULES",
                help="Comma list of rules to turn off: community, url, markup, length, repeat, "
                "blocklist, top-words, bland.",
            ),
            click.option(
                "--filter-set",
                multiple=True,
                metavar="KEY=VALUE",
                help="One filter setting, e.g. max_words=300 or blocklist_path=words.txt (repeatable).",
            ),
            click.option(
                "--filter-report",
                type=click.Path(dir_okay=False),
                default=None,
                help="Write the full filter report (counts and examples) to this JSON file.",
            ),
        ]
        if with_switch:
            options.insert(0, click.option("--no-filter", is_flag=True, help="Train on the corpus unfiltered."))
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def build_filter_config(config_file: str | None, disable: str, settings: tuple[str, ...]) -> FilterConfig:
    from chatcore.errors import OptionError
    from chatcore.training.filtering import FilterConfig, load_filter_config

    config = load_filter_config(config_file) if config_file else FilterConfig()
    values: dict[str, Any] = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise OptionError(f"--filter-set expects KEY=VALUE, got {item!r}")
        values[key.strip()] = value.strip()
    if disable:
        extra = [name.strip() for name in disable.split(",") if name.strip()]
        values["disable"] = tuple(dict.fromkeys([*config.disable, *extra]))
    return config.updated(values, origin="--filter-set / --filter-disable") if values else config


force_option = click.option("--force", is_flag=True, help="Replace an existing --out or --filter-report.")

# The files a tokenizer folder holds (save_pretrained of a fast tokenizer, or a slow GPT-2 one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def check_output(path: str, option: str, corpus: str, replace: bool) -> Path:
    """``path`` as an output file (see :func:`chatcore.cli.files.output_file`), never the corpus
    being read, even with ``--force``: refused in one line before any work."""
    from chatcore.cli.files import output_file
    from chatcore.errors import OptionError

    target = Path(path)
    source = Path(corpus)
    if source.is_file() and target.is_file() and target.samefile(source):
        raise OptionError(f"{option} {path!r} is the corpus being read: give another {option}")
    return output_file(path, option, replace=replace)


def check_tokenizer_folder(path: str, replace: bool) -> None:
    """Refuse, in one line, an ``--out`` that already holds a tokenizer (a trained model's
    best/ does), unless ``replace`` (``--force``)."""
    from chatcore.cli.files import output_folder
    from chatcore.errors import OptionError

    held = [name for name in TOKENIZER_FILES if (Path(path) / name).exists()]
    if held and not replace:
        raise OptionError(
            f"--out {path!r} already holds a tokenizer ({held[0]}): give --force to replace it, or another --out"
        )
    output_folder(path)


def report_writer(path: str | None, examples: int = 2) -> Callable[[FilterReport], None]:
    """Print the report's table (with a few examples) and write the full report to ``path``."""

    def write(report: FilterReport) -> None:
        import json

        click.echo(report.format(examples=examples))
        if path:
            Path(path).write_text(json.dumps(report.to_dict(), indent=2, ensure_ascii=False), encoding="utf-8")
            click.echo(f"filter report written to {path}")

    return write


@train.command("tokenizer")
@corpus_option
@heldout_option
@click.option("--vocab-size", type=click.IntRange(300, 1_000_000), default=8192, show_default=True)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder to write.")
@filter_options(with_switch=True)
@force_option
def train_tokenizer(
    corpus: str,
    heldout: float,
    vocab_size: int,
    out_dir: str,
    no_filter: bool,
    filter_config: str | None,
    filter_disable: str,
    filter_set: tuple[str, ...],
    filter_report: str | None,
    force: bool,
) -> None:
    """Train a byte-level BPE tokenizer on the (filtered) training split."""
    from chatcore.cli.files import removed_if_left_empty
    from chatcore.training.pipeline import train_tokenizer_command

    config = None if no_filter else build_filter_config(filter_config, filter_disable, filter_set)
    if filter_report:
        check_output(filter_report, "--filter-report", corpus, replace=force)
    with removed_if_left_empty(out_dir):  # a run that fails leaves no empty --out behind
        check_tokenizer_folder(out_dir, replace=force)
        path = train_tokenizer_command(
            corpus, out_dir, vocab_size, heldout, filter_config=config, on_filter_report=report_writer(filter_report)
        )
    click.echo(f"tokenizer saved to {path}")


@train.command("filter")
@corpus_option
@filter_options(with_switch=False)
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the kept dialogues here as JSONL (a corpus for --corpus).",
)
@click.option(
    "--examples", type=click.IntRange(0, 1000), default=3, show_default=True, help="Examples to show per rule."
)
@force_option
def train_filter(
    corpus: str,
    filter_config: str | None,
    filter_disable: str,
    filter_set: tuple[str, ...],
    filter_report: str | None,
    out_path: str | None,
    examples: int,
    force: bool,
) -> None:
    """Filter a whole corpus and print what each rule removed (no training).

    Training commands filter their training split the same way; use this to tune the
    settings first.
    """
    import json

    from chatcore.errors import OptionError
    from chatcore.training.filtering import filter_dialogues
    from chatcore.training.threads import load_dialogues

    config = build_filter_config(filter_config, filter_disable, filter_set)
    if out_path:
        check_output(out_path, "--out", corpus, replace=force)
    if filter_report:
        check_output(filter_report, "--filter-report", corpus, replace=force)
        if out_path and Path(filter_report).resolve() == Path(out_path).resolve():
            raise OptionError(f"--filter-report {filter_report!r} is also the --out: give two files")
    if examples > config.examples:
        config = config.updated({"examples": examples})
    result = filter_dialogues(load_dialogues(corpus), config)
    report_writer(filter_report, examples=examples)(result.report)
    if out_path:
        with Path(out_path).open("w", encoding="utf-8") as handle:
            for dialogue in result.dialogues:
                record: dict[str, Any] = {"id": dialogue.id, "turns": list(dialogue.turns)}
                if dialogue.community is not None:
                    record["community"] = dialogue.community
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        click.echo(f"{len(result.dialogues):,} dialogues written to {out_path}")


@train.command("model")
@corpus_option
@heldout_option
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Run folder: checkpoint/, and best/ (a Hugging Face model folder).",
)
@click.option("--reverse", is_flag=True, help="Train the reverse model P(source | response) for MMI.")
@click.option(
    "--tokenizer",
    "tokenizer_path",
    default=None,
    help="Tokenizer folder, or a model whose tokenizer to share (smollm2, a GGUF file ...; default: train one).",
)
@click.option("--init-from", default=None, help="Fine-tune this model (bundled name, folder or hub id).")
@click.option("--vocab-size", type=click.IntRange(300, 1_000_000), default=8192, show_default=True)
@options_from_model(ModelShape, SHAPE_OPTIONS)
@options_from_model(TrainConfig, TRAIN_OPTIONS, {"learning_rate": "--lr"})
@click.option("--resume", is_flag=True, help="Continue from OUT/checkpoint/.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@filter_options(with_switch=True)
@click.option("--force", is_flag=True, help="Replace an existing --filter-report.")
def train_model(
    corpus: str,
    heldout: float,
    out_dir: str,
    reverse: bool,
    tokenizer_path: str | None,
    init_from: str | None,
    vocab_size: int,
    resume: bool,
    quiet: bool,
    no_filter: bool,
    filter_config: str | None,
    filter_disable: str,
    filter_set: tuple[str, ...],
    filter_report: str | None,
    force: bool,
    **settings: Any,
) -> None:
    """Train a GPT-2-architecture dialogue model from scratch, or fine-tune any causal LM
    (--init-from: GPT-2, Llama, Qwen2, Gemma ..., a folder, GGUF file or known name).

    On several GPUs (or CPU processes, with --device cpu), launch it with torchrun:

    \b
        torchrun --nproc_per_node=N -m chatcore.cli train model ...
    """
    from chatcore.cli.files import removed_if_left_empty, run_folder
    from chatcore.errors import OptionError
    from chatcore.training.pipeline import train_model_command
    from chatcore.training.trainer import distributed_context

    try:
        shape = ModelShape(**{name: settings.pop(name) for name in SHAPE_OPTIONS})
        config = TrainConfig(out_dir=out_dir, **settings)
    except ValueError as error:
        raise OptionError(str(error)) from None
    filtering = None if no_filter else build_filter_config(filter_config, filter_disable, filter_set)
    if filter_report:
        # Under torchrun the first process writes it: another may only come here once it has.
        check_output(filter_report, "--filter-report", corpus, replace=force or not distributed_context().is_main)
    with removed_if_left_empty(out_dir):
        run_folder(out_dir, resume, ("checkpoint", "best"))
        result = train_model_command(
            corpus,
            config,
            shape,
            tokenizer_path=tokenizer_path,
            init_from=init_from,
            reverse=reverse,
            heldout=heldout,
            vocab_size=vocab_size,
            resume=resume,
            progress=not quiet,
            filter_config=filtering,
            on_filter_report=report_writer(filter_report),
        )
    if not distributed_context().is_main:
        return
    if result.best_step < 0:
        click.echo(f"no evaluation yet; {result.parameters:,} parameters; checkpoint in {out_dir}/checkpoint")
    elif result.heldout_evaluated:
        click.echo(
            f"best held-out loss {result.best_val_loss:.4f} (perplexity {result.best_val_perplexity:.2f}) "
            f"at step {result.best_step}; {result.parameters:,} parameters; model in {out_dir}/best"
        )
    else:
        click.echo(
            f"no held-out split: model in {out_dir}/best is step {result.best_step}'s (training loss "
            f"{result.best_val_loss:.4f}); {result.parameters:,} parameters"
        )
    if result.steps < result.total_steps:
        click.echo(f"stopped at step {result.steps} of {result.total_steps}: continue with --resume")


@chatcore.hookimpl(trylast=True)
def register_commands(cli: click.Group) -> None:
    train_group(cli)
