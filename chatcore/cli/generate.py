"""``chatcore generate``: a one-shot reply to a message or a scripted conversation."""

from __future__ import annotations

import json
import sys

import click

from chatcore.cli.options import max_new_tokens_option, model_option, plugin_options, prompt_options, threads_option
from chatcore.cli.specs import parse_spec


def read_turns(data: bytes) -> tuple[str, ...]:
    """Turns from standard input, one per non-blank line; bytes that are not UTF-8 are an error, not dropped."""
    from chatcore.errors import ChatcoreError

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ChatcoreError(f"the input is not UTF-8 text (bad byte at position {error.start})") from None
    return tuple(line for line in text.splitlines() if line.strip())


@click.command()
@click.argument("turns", nargs=-1, required=True)
@model_option
@plugin_options
@prompt_options("System prompt (persona) for the reply.")
@click.option("--seed", type=int, default=None, help="Seed for reproducible sampling.")
@max_new_tokens_option(64)
@click.option("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when present).")
@threads_option
@click.option(
    "--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto", show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="Print the reply with its provenance as JSON.")
def generate(
    turns: tuple[str, ...],
    model: str,
    decoder_spec: str,
    steer_specs: tuple[str, ...],
    system_text: str | None,
    system_file: str | None,
    prompt_format: str,
    seed: int | None,
    max_new_tokens: int,
    device: str | None,
    threads: int | None,
    dtype: str,
    as_json: bool,
) -> None:
    """Reply once to TURNS (oldest first; the last is the user's message).

    A single TURN is one message. Several TURNS are a scripted conversation whose
    turns alternate between user and bot, ending with the user. Give "-" to read
    turns from standard input, one per line.
    """
    from chatcore.cpu import use_threads
    from chatcore.engine import Engine, ReplyOptions, validate_options
    from chatcore.prompting import system_prompt_option, validate_format_name
    from chatcore.registry import registry_of

    if turns == ("-",):
        turns = read_turns(sys.stdin.buffer.read())
    decoder, decoder_settings = parse_spec(decoder_spec)
    steerers = [parse_spec(spec) for spec in steer_specs]
    options = ReplyOptions(
        decoder=decoder, decoder_settings=decoder_settings, steerers=steerers, seed=seed, max_new_tokens=max_new_tokens
    )
    # Everything that needs no model fails before the model loads.
    from chatcore.text import clean_message

    for turn in turns:
        clean_message(turn)
    validate_options(options)
    validate_format_name(prompt_format, registry_of())
    system = system_prompt_option(system_text, system_file)
    use_threads(threads)
    engine = Engine(model, device=device, dtype=dtype, prompt_format=prompt_format)
    response = engine.reply_to(list(turns), options, system=system)
    if as_json:
        click.echo(json.dumps(response.to_dict(), indent=2, ensure_ascii=False))
        return
    for delta in response:
        click.echo(delta, nl=False)
    click.echo()
