"""The ``chatcore`` command line.

The group is built once: chatcore's own commands, then every plugin's
``register_commands(cli)``. Nothing here imports torch; commands import what they
need when they run.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from chatcore import __version__
from chatcore.errors import ChatcoreError

DEBUG_ENV = "CHATCORE_DEBUG"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class ChatcoreGroup(click.Group):
    """Turns ChatcoreError into a one-line message (tracebacks only with CHATCORE_DEBUG)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ChatcoreError as error:
            if debug_enabled():
                raise
            raise click.ClickException(str(error)) from None


@click.group(cls=ChatcoreGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="chatcore")
def cli() -> None:
    """chatcore: a plugin-based chatbot framework.

    Talk to a model, generate replies, train and evaluate models, and manage
    plugins. The default model is the bundled chatcore-tiny.
    """


def build_cli() -> click.Group:
    from chatcore.cli import generate, models_command, plugins_command
    from chatcore.plugin_manager import get_plugin_host

    cli.add_command(generate.generate)
    cli.add_command(plugins_command.plugins)
    cli.add_command(models_command.models)
    host = get_plugin_host()
    host.call_each("register_commands", cli=cli)
    return cli


def main(argv: list[str] | None = None) -> Any:
    import logging

    logging.basicConfig(format="chatcore: %(message)s", level=logging.WARNING)
    group = build_cli()
    return group.main(args=argv if argv is not None else sys.argv[1:], prog_name="chatcore")
