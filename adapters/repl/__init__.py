"""The terminal REPL: ``chatcore chat``.

A prompt-toolkit session with input history, completion, a toolbar and multi-line
input; streaming replies; slash commands to switch decoders and steerers, retry,
inspect and resume; every turn logged through the conversation log's plugin.

Modules: ``command`` (the click command, light), ``app`` (start-up), ``state``,
``slash_commands`` (the dispatcher, no terminal needed), ``completion`` (completion
and toolbar text), ``terminal`` (the loop and prompt-toolkit). See docs/repl.md.
"""

from __future__ import annotations

import click

import chatcore


@chatcore.hookimpl(trylast=True)
def register_commands(cli: click.Group) -> None:
    from chatcore.adapters.repl.command import chat

    cli.add_command(chat)
