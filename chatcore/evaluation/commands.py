"""``chatcore eval`` and its built-in prompt sets."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import click

import chatcore
from chatcore.cli.options import (
    device_option,
    dtype_option,
    max_new_tokens_option,
    model_option,
    plugin_options,
    prompt_options,
    sampling_options,
    threads_option,
    with_sampling_shortcuts,
)
from chatcore.errors import ChatcoreError, OptionError

STDOUT = "-"  # --json - writes the report to standard output


@click.command("eval")
@model_option
@plugin_options
@sampling_options
@click.option(
    "-p",
    "--prompts",
    default="chitchat-heldout",
    show_default=True,
    help="A prompt set name (see `chatcore plugins`) or a .jsonl / .txt file.",
)
@click.option(
    "--limit",
    type=click.IntRange(1, 100_000),
    default=100,
    show_default=True,
    help="Use at most this many contexts, the set's first.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Context i uses seed + i.")
@max_new_tokens_option(40)
@click.option(
    "--attribute",
    default=None,
    help="Word list for the attribute column: a built-in topic (food, sports, ...) or a word file.",
)
@click.option(
    "--samples", type=click.IntRange(0, 100_000), default=5, show_default=True, help="Sample replies to print."
)
@device_option
@threads_option
@dtype_option
@prompt_options("System prompt (persona) for every reply.")
@click.option(
    "--json",
    "json_path",
    default=None,
    help="Also write the full report (with every reply) to this file; - writes it to standard output.",
)
@click.option(
    "--batch",
    type=click.IntRange(1, 256),
    default=1,
    show_default=True,
    help="Replies decoded at once by the serving scheduler (the same replies; tok/s is then the set's).",
)
def eval_command(
    model: str,
    decoder_spec: str,
    steer_specs: tuple[str, ...],
    temperature: float | None,
    top_p: float | None,
    prompts: str,
    limit: int,
    seed: int,
    max_new_tokens: int,
    attribute: str | None,
    samples: int,
    device: str | None,
    threads: int | None,
    dtype: str | None,
    system_text: str | None,
    system_file: str | None,
    prompt_format: str,
    json_path: str | None,
    batch: int,
) -> None:
    """Measure a decoder and steerer configuration over a prompt set.

    Prints perplexity of the replies under the plain model, distinct-1/2/3, mean
    length in words, share of degenerate replies, the attribute share, and tokens/s;
    with a "human" row for prompt sets that carry the human replies.
    """

    from chatcore.cli.files import check_output_path, open_output
    from chatcore.cli.specs import parse_spec
    from chatcore.cpu import use_threads
    from chatcore.engine import Engine, ReplyOptions, validate_options
    from chatcore.evaluation.runner import evaluate
    from chatcore.prompting import system_prompt_option, validate_format_name
    from chatcore.registry import registry_of

    decoder, decoder_settings = parse_spec(with_sampling_shortcuts(decoder_spec, temperature=temperature, top_p=top_p))
    steerers = [parse_spec(spec) for spec in steer_specs]
    options = ReplyOptions(
        decoder=decoder, decoder_settings=decoder_settings, steerers=steerers, max_new_tokens=max_new_tokens
    )
    # Everything that needs no model fails before the model loads.
    validate_options(options)
    validate_format_name(prompt_format, registry_of())
    if json_path is not None and json_path != STDOUT:
        if not json_path.strip():
            raise OptionError(f"--json must name a file to write the report to, got {json_path!r}")
        check_output_path(json_path)
    system = system_prompt_option(system_text, system_file)
    contexts = prompt_source(prompts)()[:limit]
    check_seeds(seed, len(contexts))
    vocabulary = load_vocabulary(attribute) if attribute is not None else None
    use_threads(threads)
    engine = Engine(model, device=device, dtype=dtype, prompt_format=prompt_format)
    label = " + ".join([decoder] + [name for name, _ in steerers])
    if batch > 1:
        from chatcore.serving import Scheduler

        with Scheduler(engine, max_batch=batch, max_waiting=len(contexts)) as scheduler:
            report = evaluate(
                engine,
                contexts,
                options,
                label=label,
                vocabulary=vocabulary,
                seed=seed,
                system=system,
                scheduler=scheduler,
            )
    else:
        report = evaluate(engine, contexts, options, label=label, vocabulary=vocabulary, seed=seed, system=system)
    errors = [s for s in report.samples if "error" in s]
    if json_path is not None:  # written even when every context failed: it holds each one's error
        write_report(report.to_dict(), json_path, open_output)
    if errors and len(errors) == len(report.samples):
        # One line: the failure itself, which every context met (a table of no replies says nothing more).
        raise ChatcoreError(f"every context failed ({len(errors)}), e.g.: {errors[0]['error']}")
    to_stderr = json_path == STDOUT  # standard output then holds the JSON alone
    click.echo(report.table(), err=to_stderr)
    shown = [s for s in report.samples if "reply" in s][:samples]
    for sample in shown:
        click.echo(f"\n> {sample['context'][-1]}\n{sample['reply']}", err=to_stderr)
    if errors:
        click.echo(f"\n{len(errors)} context(s) failed, e.g.: {errors[0]['error']}", err=True)


def check_seeds(seed: int, count: int) -> None:
    """``--seed``: context i uses seed + i, so every one of them must be a seed a reply takes;
    checked before the model loads."""
    from chatcore.engine import MAX_SEED

    if seed < 0 or seed + count - 1 > MAX_SEED:
        raise OptionError(
            f"--seed: context i uses seed + i, which must lie from 0 to {MAX_SEED}; got {seed} for {count} context(s)"
        )


def write_report(report: dict[str, Any], json_path: str, open_output: Callable[[str], TextIO]) -> None:
    """``--json``: the report to the file ``json_path``, or to standard output for ``-``."""
    text = json.dumps(report, indent=2, ensure_ascii=False)
    if json_path == STDOUT:
        click.echo(text)
        return
    with open_output(json_path) as stream:
        stream.write(text)


def prompt_source(prompts: str) -> Callable[[], list[Any]]:
    """``--prompts``, a prompt file or a registered prompt set's name, as what loads its
    contexts; a folder, a path to no file or an unknown name is refused in one line before
    the model loads. A plugin's loader that fails, or returns anything but a non-empty list
    of contexts, is a PluginError naming the plugin."""
    from chatcore.evaluation.prompts import check_prompt_set, load_prompt_file
    from chatcore.registry import registry_of

    path = Path(prompts)
    if path.is_file():
        return lambda: load_prompt_file(path)
    if path.is_dir():
        raise OptionError(f"--prompts: {prompts} is a folder, not a prompt file (a .jsonl or .txt file)")
    if "/" in prompts or "\\" in prompts or path.suffix in (".jsonl", ".txt"):
        raise OptionError(f"--prompts: no such file: {prompts}")
    registry = registry_of()
    loader: Callable[[], Any] = registry.prompt_set(prompts)  # an unknown name: one line
    return lambda: check_prompt_set(prompts, registry.plugin_of("prompt set", prompts), loader)


def load_vocabulary(attribute: str) -> set[str]:
    """``--attribute``'s words: a built-in topic's or a word file's; a file that is missing, a
    folder or holds no words is refused in one line, as the word-list steerers refuse it."""
    from chatcore.wordlists import WORDLIST_DIR, builtin_topics, read_word_file

    if attribute in builtin_topics():
        return set(read_word_file(WORDLIST_DIR / f"{attribute}.txt", "--attribute"))
    path = Path(attribute).expanduser()
    if not attribute.strip() or not path.exists():
        raise OptionError(f"--attribute: no topic or word file {attribute!r} (topics: {', '.join(builtin_topics())})")
    words = set(read_word_file(path, "--attribute"))
    if not words:
        raise OptionError(f"--attribute: the word file {attribute!r} holds no words (one word or phrase per line)")
    return words


@chatcore.hookimpl(trylast=True)
def register_commands(cli: click.Group) -> None:
    cli.add_command(eval_command)


@chatcore.hookimpl(trylast=True)
def register_prompt_sets(register: Callable[[str, Callable[[], list[Any]]], None]) -> None:
    from chatcore.evaluation import prompts

    register("openers", prompts.openers)
    register("chitchat-heldout", prompts.chitchat_heldout)
