"""The Discord adapter: ``chatcore discord`` runs chatcore as a Discord bot.

Modules, each with one job: ``config`` (settings and token), ``worker`` (the thread
that owns the conversation log), ``conversations`` and ``persistence`` (one conversation per
channel, kept in the conversation log), ``routing`` (which messages, which
conversation, message text), ``bot`` (the client), ``slash`` (``/chat`` commands),
``run`` (start, signals, stop) and ``cli`` (the command). Only ``cli`` is imported
when the command line is built; discord.py and torch load when the command runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import chatcore

if TYPE_CHECKING:
    import click


@chatcore.hookimpl(trylast=True)
def register_commands(cli: "click.Group") -> None:
    from chatcore.adapters.discord_bot.cli import discord_command

    cli.add_command(discord_command)
