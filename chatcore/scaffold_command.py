"""``chatcore new-plugin NAME [--decoder]``: write the skeleton of a steerer or decoder plugin package."""

from __future__ import annotations

from pathlib import Path

import click

import chatcore


@click.command("new-plugin")
@click.argument("name")
@click.option(
    "--dir",
    "parent",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    help="Where to create the package folder (default: the current folder).",
)
@click.option("--decoder", "decoder", is_flag=True, help="A decoder plugin (default: a steerer).")
def new_plugin(name: str, parent: Path, decoder: bool) -> None:
    """Create chatcore-NAME/, a plugin package: pyproject.toml with the chatcore entry
    point, a Steerer (or, with --decoder, a TokenDecoder) named NAME with its hookimpl,
    and tests that use chatcore's pytest fixtures. An existing folder is never
    overwritten."""
    from chatcore.scaffold import Kind, PluginNames, render, write_plugin

    kind: Kind = "decoder" if decoder else "steerer"
    folder = write_plugin(name, parent, kind)
    click.echo(f"created {folder}/")
    for relative in render(PluginNames.from_name(name), kind):
        click.echo(f"  {relative}")
    click.echo(f"\nnext:\n  cd {folder}\n  pip install -e .\n  chatcore plugins\n  pytest")


@chatcore.hookimpl(trylast=True)
def register_commands(cli: click.Group) -> None:
    cli.add_command(new_plugin)
