"""``chatcore plugins``: loaded plugins, their hooks, and what they registered."""

from __future__ import annotations

import json
from typing import Any

import click


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plugins(as_json: bool) -> None:
    """List loaded plugins, their hooks and versions, and the decoders and steerers they registered."""
    from chatcore.plugin_manager import get_plugin_host
    from chatcore.registry import Registry

    host = get_plugin_host()
    registry = Registry.build(host)
    rows: list[dict[str, Any]] = []
    for info in host.plugins():
        rows.append(
            {
                "name": info.name,
                "module": info.module,
                "distribution": info.distribution,
                "version": info.version,
                "builtin": info.builtin,
                "hooks": info.hooks,
                "decoders": sorted(e.name for e in registry.decoders.values() if e.plugin == info.name),
                "steerers": sorted(e.name for e in registry.steerers.values() if e.plugin == info.name),
                "prompt_sets": sorted(e.name for e in registry.prompt_sets.values() if e.plugin == info.name),
            }
        )
    problems = [{"plugin": p.plugin, "stage": p.stage, "message": p.message} for p in host.problems]
    if as_json:
        click.echo(json.dumps({"plugins": rows, "problems": problems}, indent=2))
        return
    for row in rows:
        origin = "built-in" if row["builtin"] else f"{row['distribution']} {row['version']}"
        click.echo(f"{row['name']}  ({origin}; {row['module']})")
        click.echo(f"  hooks: {', '.join(row['hooks']) or '-'}")
        for kind in ("decoders", "steerers", "prompt_sets"):
            if row[kind]:
                click.echo(f"  {kind.replace('_', ' ')}: {', '.join(row[kind])}")
    for problem in problems:
        click.echo(f"problem: plugin {problem['plugin']!r} at {problem['stage']}: {problem['message']}", err=True)
