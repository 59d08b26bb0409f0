"""``chatcore discord``: run the Discord bot.

Options override the settings file; the token comes from ``DISCORD_TOKEN`` or
``--token-file`` and is never printed or logged. Nothing heavy is imported until the
command runs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import click

from chatcore.adapters.discord_bot.config import TOKEN_ENV
from chatcore.cli.options import (
    MODEL_DEFAULT_HELP,
    Seconds,
    device_option,
    max_new_tokens_option,
    persona_option,
    sampling_options,
    threads_option,
)
from chatcore.errors import ChatcoreError

LOG_LEVELS = ("debug", "info", "warning", "error")


def parse_shard_ids(text: str | None) -> tuple[int, ...] | None:
    """``"0,2"`` -> ``(0, 2)``; None when not given."""
    if text is None:
        return None
    try:
        ids = tuple(int(part) for part in text.replace(" ", "").split(","))
    except ValueError:
        raise ChatcoreError(
            f"--shard-ids must list shard numbers separated by commas, e.g. 0,2; got {text!r}"
        ) from None
    if not ids:
        raise ChatcoreError("--shard-ids is empty")
    return ids


@click.command("discord")
@click.option(
    "--settings",
    "settings_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A TOML or JSON settings file (options below override it).",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help=f"A file holding the bot token (default: ${TOKEN_ENV}).",
)
@click.option(
    "-c",
    "--channel",
    "channels",
    multiple=True,
    type=int,
    help="A channel or thread id where every message is answered. Repeatable.",
)
@click.option(
    "-g",
    "--guild",
    "guilds",
    multiple=True,
    type=int,
    help="Sync the slash commands to this guild id at start. Repeatable (default: global).",
)
@click.option(
    "--admin-role",
    "admin_roles",
    multiple=True,
    help="A role id or name that may change decoder and steering. Repeatable.",
)
@click.option(
    "-m", "--model", default=None, help=f"Bundled name, smollm2, GGUF file, folder or hub id [{MODEL_DEFAULT_HELP}]."
)
@device_option
@threads_option
@click.option("-d", "--decoder", default=None, help='Decoder and settings, e.g. "top-k top_k=20" [top-k].')
@click.option("-s", "--steer", "steer", multiple=True, help="Steerer and settings. Repeatable; applied in order.")
@click.option("--system", default=None, help="System prompt (persona) of every conversation; admins may override it.")
@click.option("--system-file", default=None, type=click.Path(), help="Read the system prompt from a UTF-8 text file.")
@persona_option
@sampling_options
@click.option(
    "--format",
    "prompt_format",
    default=None,
    help="Prompt format: auto (the model's chat template if it has one), chat-template, dialogpt ... [auto].",
)
@max_new_tokens_option(64, per_model=True)
@click.option(
    "--max-batch", type=click.IntRange(1), default=None, help="Replies decoded together, from different channels [8]."
)
@click.option("--queue-size", type=click.IntRange(1), default=None, help="Replies that may wait for the batch [8].")
@click.option(
    "--shard-count",
    type=click.IntRange(0),
    default=None,
    help="Run the bot as this many gateway shards (0: as many as Discord recommends).",
)
@click.option(
    "--shard-ids",
    default=None,
    help='The shards this process runs, e.g. "0,2" (with --shard-count; default: all of them).',
)
@click.option(
    "--cooldown",
    "cooldown_s",
    type=Seconds(0),
    default=None,
    help="Seconds between two answered messages of one user [2].",
)
@click.option("--db", default=None, help="Conversation log: SQLAlchemy URL or SQLite file [$CHATCORE_DB or user data].")
@click.option("--log/--no-log", "log", default=None, help="Log conversations, resumed after a restart [on].")
@click.option("--check", is_flag=True, help="Load and check everything, then exit without connecting.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True)
def discord_command(
    settings_file: Path | None,
    token_file: Path | None,
    channels: tuple[int, ...],
    guilds: tuple[int, ...],
    admin_roles: tuple[str, ...],
    model: str | None,
    device: str | None,
    threads: int | None,
    decoder: str | None,
    steer: tuple[str, ...],
    system: str | None,
    system_file: str | None,
    persona: str | None,
    temperature: float | None,
    top_p: float | None,
    prompt_format: str | None,
    max_new_tokens: int | None,
    max_batch: int | None,
    queue_size: int | None,
    shard_count: int | None,
    shard_ids: str | None,
    cooldown_s: float | None,
    db: str | None,
    log: bool | None,
    check: bool,
    log_level: str,
) -> None:
    """Run a Discord bot: it answers DMs, mentions and the listed channels.

    One conversation per channel, thread and DM, kept in the conversation log so a
    restart resumes them. Slash commands: /chat reset, decoder, steer, system, settings, why.
    SIGTERM or Ctrl-C stops it cleanly. See docs/discord.md for setting up the
    application and its permissions.
    """
    import asyncio

    from chatcore.adapters.discord_bot.config import load_settings, read_token
    from chatcore.adapters.discord_bot.run import guard_logging
    from chatcore.cli.options import with_sampling_shortcuts
    from chatcore.cli.specs import parse_spec
    from chatcore.engine import ReplyOptions, validate_options
    from chatcore.personas import read_persona
    from chatcore.prompting import validate_format_name
    from chatcore.registry import registry_of

    if system is not None and system_file is not None:
        raise ChatcoreError("give --system or --system-file, not both")
    if persona is not None:
        if system is not None or system_file is not None:
            raise ChatcoreError("give --persona, --system or --system-file, not two of them")
        system = read_persona(persona)
    settings = load_settings(
        settings_file,
        {
            "channels": channels,
            "guilds": guilds,
            "admin_roles": admin_roles,
            "model": model,
            "device": device,
            "threads": threads,
            "decoder": decoder,
            "steer": steer,
            "system": system,
            "system_file": system_file,
            "prompt_format": prompt_format,
            "max_new_tokens": max_new_tokens,
            "max_batch": max_batch,
            "queue_size": queue_size,
            "shard_count": shard_count,
            "shard_ids": parse_shard_ids(shard_ids),
            "cooldown_s": cooldown_s,
            "db": db,
            "log": log,
        },
    )
    if temperature is not None or top_p is not None:
        settings.decoder = with_sampling_shortcuts(settings.decoder, temperature=temperature, top_p=top_p)
    # Everything that needs no model is checked before the token is read and the model loads.
    validate_format_name(settings.prompt_format, registry_of())
    decoder_name, decoder_settings = parse_spec(settings.decoder)
    steerers = [parse_spec(spec) for spec in settings.steer]
    validate_options(ReplyOptions(decoder=decoder_name, decoder_settings=decoder_settings, steerers=steerers))
    token = read_token(token_file)
    guard_logging(token)
    level = getattr(logging, log_level.upper())
    logging.getLogger("chatcore").setLevel(level)
    # discord.py's debug output is gateway traffic: INFO is as far down as it goes here.
    logging.getLogger("discord").setLevel(max(level, logging.INFO))

    if check:
        from chatcore.adapters.discord_bot.run import check as check_bot

        for line in asyncio.run(check_bot(settings)):
            click.echo(line)
        source = f"the file {str(token_file)!r}" if token_file is not None else f"${TOKEN_ENV}"
        click.echo(f"token: found in {source}")
        return

    from chatcore.adapters.discord_bot.run import serve

    asyncio.run(serve(settings, token))
