"""``chatcore personas``: list, show, add and remove saved system prompts (see :mod:`chatcore.personas`)."""

from __future__ import annotations

import click


@click.group(invoke_without_command=True)
@click.pass_context
def personas(ctx: click.Context) -> None:
    """Saved system prompts, used with `--persona NAME` on chat, generate, serve and discord.

    Without a subcommand: list them, each with the start of its text (its lines joined).
    """
    if ctx.invoked_subcommand is not None:
        return
    from chatcore.errors import ChatcoreError
    from chatcore.personas import persona_names, personas_folder, read_persona
    from chatcore.text import one_line

    names = persona_names()
    if not names:
        click.echo(f'no personas yet in {personas_folder()}; `chatcore personas add NAME "TEXT"` saves one')
        return
    width = max(len(name) for name in names)
    for name in names:
        try:  # one file that cannot be read (empty, not UTF-8) does not hide the others
            shown = one_line(read_persona(name), 70)
        except ChatcoreError as error:
            shown = f"(cannot be used: {error})"
        click.echo(f"{name:<{width}}  {shown}")


@personas.command("show")
@click.argument("name")
def show(name: str) -> None:
    """Print persona NAME's system prompt."""
    from chatcore.personas import read_persona

    click.echo(read_persona(name))


@personas.command("add")
@click.argument("name")
@click.argument("text", required=False)
@click.option("--file", "text_file", type=click.Path(), default=None, help="Read the text from a UTF-8 file.")
@click.option("--force", is_flag=True, help="Replace a persona of that name.")
def add(name: str, text: str | None, text_file: str | None, force: bool) -> None:
    """Save TEXT (or --file's text) as persona NAME (--force replaces one of that name)."""
    from chatcore.errors import OptionError
    from chatcore.personas import persona_path, save_persona
    from chatcore.prompting import read_system_file

    if (text is None) == (text_file is None):
        raise OptionError('give the persona\'s text, or --file PATH: chatcore personas add NAME "TEXT"')
    existed = persona_path(name).is_file()
    if existed and not force:
        raise OptionError(
            f"persona {name!r} exists: give --force to replace it (`chatcore personas show {name}` prints it)"
        )
    path = save_persona(name, text if text is not None else read_system_file(str(text_file)))
    click.echo(f"{'replaced' if existed else 'saved'} persona {name!r} in {path}")


@personas.command("rm")
@click.argument("name")
def remove(name: str) -> None:
    """Remove persona NAME."""
    from chatcore.personas import remove_persona

    path = remove_persona(name)
    click.echo(f"removed persona {name!r} ({path})")
