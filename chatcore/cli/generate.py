"""``chatcore generate``: a one-shot reply to a message or a scripted conversation."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import click

from chatcore.cli.options import reply_options
from chatcore.cli.specs import parse_spec

if TYPE_CHECKING:
    from chatcore.engine import Engine
    from chatcore.response import Response

SETTING_TURN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\S*")


def read_turns(data: bytes) -> tuple[str, ...]:
    """Turns from standard input, one per non-blank line; bytes that are not UTF-8 are an error, not dropped."""
    from chatcore.errors import ChatcoreError

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ChatcoreError(f"the input is not UTF-8 text (bad byte at position {error.start})") from None
    return tuple(line for line in text.splitlines() if line.strip())


def check_unquoted_settings(turns: tuple[str, ...]) -> None:
    """``--decoder top-k top_k=20 hi`` typed without quotes makes ``top_k=20`` a turn: say so."""
    from chatcore.errors import OptionError

    if len(turns) > 1 and SETTING_TURN.fullmatch(turns[0]):
        raise OptionError(
            f"the first turn is {turns[0]!r}, which reads like a setting: a decoder or steerer with settings is "
            f'one quoted argument, e.g. --decoder "top-k {turns[0]}" (a turn that really is so: give it with "-")'
        )


def budget_note(response: "Response") -> str | None:
    """The line that says a reply stopped at its token budget, not where the model ended it."""
    if not response.cut_by_budget:
        return None
    budget = response.provenance.get("max_new_tokens")
    return f"[cut at {budget} {'token' if budget == 1 else 'tokens'}: -n/--max-tokens raises the budget]"


def said_by_the_error(record: logging.LogRecord) -> bool:
    """False for a plugin problem that a reply's error says (a decoder or steerer failing
    while generating), True for the others (a hook failing)."""
    problem = record.args[0] if isinstance(record.args, tuple) and record.args else None
    stage = str(getattr(problem, "stage", ""))
    return not stage.startswith(("decoder ", "steerer "))


@click.command()
@click.argument("turns", nargs=-1, required=True)
@reply_options("System prompt (persona) for the reply.")
@click.option("--seed", type=int, default=None, help="Seed for reproducible sampling.")
@click.option("--json", "as_json", is_flag=True, help="Print the reply with its provenance as JSON.")
@click.option(
    "-c",
    "--continue",
    "continue_last",
    is_flag=True,
    help="Add the message as a turn to the most recent logged conversation (its turns are the context); log both.",
)
@click.option(
    "--cid",
    "conversation_id",
    default=None,
    metavar="ID",
    help="As --continue, for this logged conversation (any unique prefix of its id).",
)
@click.option("--db", "db_url", default=None, metavar="URL", help="The conversation log, with --continue or --cid.")
def generate(
    turns: tuple[str, ...],
    model: str,
    decoder_spec: str,
    steer_specs: tuple[str, ...],
    temperature: float | None,
    top_p: float | None,
    system_text: str | None,
    system_file: str | None,
    persona: str | None,
    prompt_format: str,
    seed: int | None,
    max_new_tokens: int | None,
    device: str | None,
    threads: int | None,
    dtype: str,
    as_json: bool,
    continue_last: bool,
    conversation_id: str | None,
    db_url: str | None,
) -> None:
    """Reply once to TURNS (oldest first; the last is the user's message).

    A single TURN is one message. Several TURNS are a scripted conversation whose
    turns alternate between user and bot, ending with the user. Give "-" to read
    turns from standard input, one per line (blank lines are skipped).

    With --continue (or --cid ID), the one message is added as a turn to the latest
    (or that) logged conversation, with its earlier turns as context, and the message
    and the reply are written to the log.
    """
    from chatcore.cli.continuing import check_continue_options
    from chatcore.cli.options import reply_budget, with_sampling_shortcuts
    from chatcore.cpu import use_threads
    from chatcore.engine import Engine, ReplyOptions, validate_options
    from chatcore.personas import system_prompt_with_persona
    from chatcore.prompting import validate_format_name
    from chatcore.registry import registry_of

    # A decoder or steerer failing while generating ends this command with its error as the
    # last line: the warning that says so in a long-running process would say it twice here.
    # A hook failing (on_response raising) ends nothing, and is said.
    plugins_log = logging.getLogger("chatcore.plugins")
    plugins_log.addFilter(said_by_the_error)
    click.get_current_context().call_on_close(lambda: plugins_log.removeFilter(said_by_the_error))
    if turns == ("-",):
        turns = read_turns(sys.stdin.buffer.read())
    else:
        check_unquoted_settings(turns)
    continuing = check_continue_options(turns, continue_last, conversation_id)
    decoder_spec = with_sampling_shortcuts(decoder_spec, temperature=temperature, top_p=top_p)
    decoder, decoder_settings = parse_spec(decoder_spec)
    steerers = [parse_spec(spec) for spec in steer_specs]
    options = ReplyOptions(
        decoder=decoder,
        decoder_settings=decoder_settings,
        steerers=steerers,
        seed=seed,
        max_new_tokens=reply_budget(max_new_tokens, model, 64),
    )
    # Everything that needs no model fails before the model loads.
    from chatcore.errors import ChatcoreError
    from chatcore.text import clean_message, undecodable_at

    for number, turn in enumerate(turns, start=1):
        # Of several turns, the one at fault is named: "turn 2 of 3 is empty".
        which = f"turn {number} of {len(turns)}" if len(turns) > 1 else "the message"
        bad = undecodable_at(turn)  # Python decodes arguments with surrogateescape: a bad byte is no character
        if bad is not None:
            raise ChatcoreError(f"{which} is not UTF-8 text (bad byte at position {bad})")
        try:
            clean_message(turn)
        except ChatcoreError as error:
            raise ChatcoreError(str(error).replace("the message", which, 1)) from error
    validate_options(options)
    validate_format_name(prompt_format, registry_of())
    system = system_prompt_with_persona(system_text, system_file, persona)
    if not continuing:
        use_threads(threads)
        engine = Engine(model, device=device, dtype=dtype, prompt_format=prompt_format)
        note_plugin_problems(engine)
        show(engine.reply_to(list(turns), options, system=system), as_json)
        return
    from chatcore.cli.continuing import find_conversation_id, logged_conversation, open_store

    def say(message: str) -> None:
        click.echo(message, err=True)

    store = open_store(db_url)  # a log that cannot be opened, or an unknown id, fails before the model loads
    try:
        found = find_conversation_id(store, conversation_id)
        use_threads(threads)
        engine = Engine(model, device=device, dtype=dtype, prompt_format=prompt_format)
        note_plugin_problems(engine)
        with logged_conversation(engine, store, found, system, say) as conversation:
            show(engine.send(conversation, turns[0], options), as_json)
    finally:
        store.close()


def note_plugin_problems(engine: "Engine") -> None:
    """:func:`chatcore.cli.plugin_problems_note` on standard error, as the chat's first lines say it."""
    from chatcore.cli import plugin_problems_note

    note = plugin_problems_note(engine.host)
    if note is not None:
        click.echo(note, err=True)


@contextmanager
def log_lines_held() -> Iterator[None]:
    """Lines logged inside the block are said when it ends (to the handlers there were): a
    reply streamed on standard output never shares its line with one."""
    root = logging.getLogger()
    handlers, held = root.handlers[:], []

    class Holding(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    root.handlers = [Holding()]
    try:
        yield
    finally:
        root.handlers = handlers
        for record in held:
            for handler in handlers:
                if record.levelno >= handler.level:
                    handler.handle(record)


def show(response: "Response", as_json: bool) -> None:
    """Print the reply (streamed, control characters escaped) or, with ``as_json``, the reply and its provenance;
    a reply cut by its budget says so (on standard error, so the reply stays clean)."""
    if as_json:
        click.echo(json.dumps(response.to_dict(), indent=2, ensure_ascii=False))
        return
    from chatcore.text import display_safe

    started = False
    with log_lines_held():  # a hook's failure, said as the reply ends, goes on a line of its own
        try:
            for delta in response:
                # Shown, not acted on: a reply's ESC or bidi override must not drive the terminal
                # (as the chat and `logs show` show them).
                click.echo(display_safe(delta), nl=False)
                started = started or bool(delta)
        except Exception:
            if started:  # the error goes on a line of its own, after what was shown of the reply
                click.echo()
            raise
        click.echo()
    note = budget_note(response)
    if note is not None:
        click.echo(note, err=True)
