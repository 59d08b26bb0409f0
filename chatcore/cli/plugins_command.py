"""``chatcore plugins``: loaded plugins, their hooks, and what they registered."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from chatcore.registry import Registry


@click.command()
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plugins(name: str | None, as_json: bool) -> None:
    """List loaded plugins, their hooks and versions, and the decoders and steerers they registered.

    With NAME (a decoder or steerer), show its settings instead: type, default, allowed
    values and help (with --json, their JSON schema).
    """
    from chatcore.plugin_manager import get_plugin_host
    from chatcore.registry import registry_of

    host = get_plugin_host()
    registry = registry_of(host)
    if name is not None:
        show_settings(registry, name, as_json)
        return
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
                "prompt_formats": sorted(e.name for e in registry.prompt_formats.values() if e.plugin == info.name),
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
        for kind in ("decoders", "steerers", "prompt_sets", "prompt_formats"):
            if row[kind]:
                click.echo(f"  {kind.replace('_', ' ')}: {', '.join(row[kind])}")
    for line in model_sampling_lines():
        click.echo(line)
    for problem in problems:
        click.echo(f"problem: plugin {problem['plugin']!r} at {problem['stage']}: {problem['message']}", err=True)


def model_sampling_lines(fields: "set[str] | None" = None) -> list[str]:
    """The known models' recommended sampling (``fields``: only the settings a decoder has),
    which decoders take for the settings not given; a model's own generation config wins."""
    from chatcore.explain import format_settings
    from chatcore.models import KNOWN_MODELS

    lines = []
    for name, known in KNOWN_MODELS.items():
        sampling = {key: value for key, value in known.sampling.items() if fields is None or key in fields}
        if sampling:
            lines.append(f"  {name}: {format_settings(sampling)}")
    if not lines:
        return []
    return [
        "models' recommended sampling (the default for settings not given; a model's generation_config.json "
        "sets its own):",
        *lines,
    ]


def show_settings(registry: "Registry", name: str, as_json: bool) -> None:
    """The settings of decoder or steerer ``name``, as a table or as JSON schema."""
    from chatcore.errors import UnknownNameError
    from chatcore.options import settings_rows

    if name not in registry.decoders and name not in registry.steerers and name not in registry.ambiguous:
        raise UnknownNameError(
            f"unknown decoder or steerer {name!r} (decoders: {', '.join(sorted(registry.decoders))}; "
            f"steerers: {', '.join(sorted(registry.steerers))})"
        )
    kind = "decoder" if name in registry.decoders else "steerer"
    cls = registry.decoder(name) if kind == "decoder" else registry.steerer(name)  # ambiguous: one-line error
    if as_json:
        table = registry.decoders if kind == "decoder" else registry.steerers
        click.echo(json.dumps(table[name].card(kind), indent=2))
        return
    described = f": {cls.description}" if str(cls.description or "").strip() else ""
    click.echo(f"{name}  ({kind}, plugin {registry.plugin_of(kind, name)}){described}")
    rows = settings_rows(cls.Settings)
    if not rows:
        click.echo("  no settings")
        return
    width = max(len(row["name"]) for row in rows)
    for row in rows:
        allowed = row["allowed"]
        choices = [] if allowed else cls.setting_choices(row["name"])
        if choices:  # checked at run time against a list (a topic name): the plugin lists them
            allowed = "one of " + ", ".join(choices)
        limits = f"; {allowed}" if allowed else ""
        click.echo(f"  {row['name']:<{width}}  {row['type']} (default {row['default']}{limits})")
        if row["help"]:
            click.echo(f"  {'':<{width}}  {row['help']}")
    if kind == "decoder":
        for line in model_sampling_lines({row["name"] for row in rows}):
            click.echo(line)
    option = "--decoder" if kind == "decoder" else "--steer"
    click.echo(f'Set them as `{option} "{name} KEY=VALUE ..."`.')
