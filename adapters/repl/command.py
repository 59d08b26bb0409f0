"""``chatcore chat``: the click command. Only click is imported here, so ``--help`` is instant."""

from __future__ import annotations

from pathlib import Path

import click

from chatcore.cli.options import reply_options
from chatcore.log.commands import DB_HELP


@click.command("chat")
@reply_options("System prompt (persona) of the conversation.")
@click.option(
    "--seed",
    type=click.IntRange(0, 2**63 - 1),
    default=None,
    help="Seed of the first reply; each later reply uses the next number.",
)
@click.option(
    "-c",
    "--continue",
    "continue_last",
    is_flag=True,
    help="Continue the most recent terminal conversation from the log.",
)
@click.option(
    "--cid",
    "conversation_id",
    default=None,
    metavar="ID",
    help="Continue this logged conversation (any unique prefix of its id).",
)
@click.option("--no-log", is_flag=True, help="Do not write this chat to the conversation log.")
@click.option("--db", "db_url", default=None, metavar="URL", help=DB_HELP)
@click.option(
    "--history-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Input history file (default: repl_history in the user data folder).",
)
def chat(
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
    continue_last: bool,
    conversation_id: str | None,
    no_log: bool,
    db_url: str | None,
    history_file: Path | None,
) -> None:
    """Talk with a model in the terminal.

    Replies stream as they are generated. Ctrl-C stops a reply (the partial reply is
    kept), Ctrl-D or /quit exits, /help lists the slash commands (/decoder, /steer,
    /system, /format, /retry, /why, /resume ...). Every turn is written to the conversation log (see
    `chatcore logs`) unless --no-log.
    """
    from chatcore.adapters.repl.app import ChatConfig, start_chat
    from chatcore.errors import OptionError
    from chatcore.prompting import validate_format_name
    from chatcore.registry import registry_of

    # A bad file or format name fails before the log opens and the model loads.
    if conversation_id is not None and not conversation_id.strip():
        raise OptionError("`--cid` is empty: give a conversation id (`chatcore logs list` shows them)")
    if conversation_id is not None and continue_last:
        raise OptionError("give --cid ID or --continue, not both")
    from chatcore.cli.options import reply_budget, with_sampling_shortcuts
    from chatcore.personas import system_prompt_with_persona

    validate_format_name(prompt_format, registry_of())
    decoder_spec = with_sampling_shortcuts(decoder_spec, temperature=temperature, top_p=top_p)
    system = system_prompt_with_persona(system_text, system_file, persona)
    start_chat(
        ChatConfig(
            model=model,
            decoder_spec=decoder_spec,
            sampling_shortcuts={
                name: value for name, value in (("temperature", temperature), ("top_p", top_p)) if value is not None
            },
            steer_specs=steer_specs,
            system=system,
            prompt_format=prompt_format,
            seed=seed,
            max_new_tokens=reply_budget(max_new_tokens, model, 64),
            device=device,
            threads=threads,
            dtype=dtype,
            continue_last=continue_last,
            conversation_id=conversation_id,
            no_log=no_log,
            db_url=db_url,
            history_file=history_file,
        )
    )
