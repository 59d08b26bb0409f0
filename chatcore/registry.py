"""The names every plugin registered: decoders, steerers, prompt formats and eval prompt sets.

The CLI, the REPL and the Discord bot list and validate names here, in one place.

Name clashes follow one rule, whatever order the plugins were discovered in:

- chatcore's built-in names are reserved: a plugin that registers one (``greedy``,
  ``pplm``, ``chat-template`` ...) is refused that registration, and the problem names
  that plugin;
- when two or more other plugins register the same name, none of them gets the bare
  name: each is reachable as ``PLUGIN/NAME`` (e.g. ``acme-steer:acme/vectors``), and
  the bare name fails with a message naming every plugin that wants it. A user picks
  one by writing its qualified name, or keeps one plugin out with ``CHATCORE_PLUGINS``.
- the same plugin registering a name twice keeps its first registration.

A host has one registry (:func:`registry_of`), built when first asked for and again only
after a plugin is registered on the host or taken off it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from chatcore.errors import UnknownNameError
from chatcore.options import Configurable, check_settings_class, settings_schema
from chatcore.plugin_manager import PluginHost, get_plugin_host
from chatcore.text import shown_argument

QUALIFIER = "/"
# The hooks a registry collects; their problems belong to the registry that collected them.
REGISTRATION_HOOKS = ("register_decoders", "register_steerers", "register_prompt_sets", "register_prompt_formats")


@dataclass
class Entry:
    name: str
    value: Any
    plugin: str

    def card(self, kind: str) -> dict[str, Any]:
        """What a decoder or steerer is, for programs (``GET /v1/plugins``, ``chatcore plugins
        NAME --json``): its name, kind, description, plugin and the JSON schema of its settings."""
        return {
            "id": self.name,
            "object": kind,
            "description": getattr(self.value, "description", "") or "",
            "plugin": self.plugin,
            "settings": settings_schema(self.value.Settings),
        }


@dataclass
class Registry:
    decoders: dict[str, Entry] = field(default_factory=dict)
    steerers: dict[str, Entry] = field(default_factory=dict)
    prompt_sets: dict[str, Entry] = field(default_factory=dict)
    prompt_formats: dict[str, Entry] = field(default_factory=dict)
    # Bare names more than one plugin registered -> those plugins (their entries are qualified).
    ambiguous: dict[str, list[str]] = field(default_factory=dict)
    # Plugins that failed to load or to register something (mentioned when a name is not found).
    broken: list[str] = field(default_factory=list)

    @classmethod
    def build(cls, host: PluginHost) -> "Registry":
        from chatcore.decoding import Decoder
        from chatcore.prompting import PromptFormat
        from chatcore.steering import Steerer

        # The problems a previous build of this host's registry found are found again below.
        host.problems[:] = [p for p in host.problems if p.stage not in {f"hook {h}" for h in REGISTRATION_HOOKS}]
        registry = cls(broken=sorted({p.plugin for p in host.problems if not p.stage.startswith("hook ")}))

        def builtin(plugin: str) -> bool:
            info = host.infos.get(plugin)
            return info is not None and info.builtin

        def collect(hook: str, table: dict[str, Entry], base: type | None) -> None:
            current = {"plugin": "?"}
            claims: dict[str, list[Entry]] = {}

            def checked(item: Any, loader: Callable[[], Any] | None) -> tuple[str, Any]:
                if loader is not None:  # register(name, loader) for prompt sets
                    if not callable(loader):
                        raise TypeError(
                            f"{hook}: {item!r}: the loader must be a function returning the set's "
                            f"contexts, got {shown_argument(loader)}"
                        )
                    name, value = str(item), loader
                else:
                    if base is not None and not (isinstance(item, type) and issubclass(item, base)):
                        raise TypeError(f"{hook}: expected a {base.__name__} subclass, got {item!r}")
                    if base is not None and issubclass(item, Configurable):
                        check_settings_class(item.Settings)
                    name, value = getattr(item, "name", ""), item
                if not isinstance(name, str) or not name:
                    raise TypeError(f"{hook}: {item!r} has no name")
                if QUALIFIER in name:
                    raise TypeError(f"{hook}: {name!r}: names cannot contain {QUALIFIER!r}")
                if any(character.isspace() or character in "=\"'" for character in name):
                    # a spec (`--steer "NAME key=value"`) could not name it
                    raise TypeError(f"{hook}: {name!r}: names cannot contain spaces, '=' or quotes")
                return name, value

            def register(item: Any, loader: Callable[[], Any] | None = None) -> None:
                """One registration; a refused one is reported and the hook's others go on."""
                try:
                    name, value = checked(item, loader)
                except Exception as error:
                    host.report(current["plugin"], f"hook {hook}", error)
                    return
                entries = claims.setdefault(name, [])
                if any(entry.plugin == current["plugin"] for entry in entries):
                    host.report(
                        current["plugin"],
                        f"hook {hook}",
                        f"{name!r} is registered twice by this plugin; the first is kept",
                    )
                    return
                entries.append(Entry(name, value, current["plugin"]))

            caller = getattr(host.pm.hook, hook)
            for impl in caller.get_hookimpls():
                current["plugin"] = impl.plugin_name
                try:
                    impl.function(register=register)
                except Exception as error:
                    host.report(impl.plugin_name, f"hook {hook}", error)

            for name, entries in sorted(claims.items()):
                owners = [entry for entry in entries if builtin(entry.plugin)]
                if owners:
                    table[name] = owners[0]
                    for entry in entries:
                        if entry is not owners[0]:
                            host.report(
                                entry.plugin,
                                f"hook {hook}",
                                f"{name!r} is a built-in name (of {owners[0].plugin!r}); "
                                "register it under another name",
                            )
                elif len(entries) == 1:
                    table[name] = entries[0]
                else:
                    plugins = sorted(entry.plugin for entry in entries)
                    registry.ambiguous[name] = plugins
                    for entry in entries:
                        table[f"{entry.plugin}{QUALIFIER}{name}"] = entry
                    for plugin in plugins:  # a problem of each, as `chatcore plugins` lists them
                        others = ", ".join(repr(other) for other in plugins if other != plugin)
                        host.report(
                            plugin,
                            f"hook {hook}",
                            f"{name!r} is registered by {others} too, so by none: use "
                            + " or ".join(f"{p}{QUALIFIER}{name}" for p in plugins),
                        )

        tables = (registry.decoders, registry.steerers, registry.prompt_sets, registry.prompt_formats)
        for hook, table, base in zip(REGISTRATION_HOOKS, tables, (Decoder, Steerer, None, PromptFormat)):
            collect(hook, table, base)
        registering = {f"hook {hook}" for hook in REGISTRATION_HOOKS}
        # A plugin whose registration failed in part may be why a name is missing too.
        registry.broken = sorted({*registry.broken, *(p.plugin for p in host.problems if p.stage in registering)})
        return registry

    def _lookup(self, table: dict[str, Entry], kind: str, name: str, also: Sequence[str] = ()) -> Any:
        def known() -> str:  # for the errors only: lookups are per reply
            return ", ".join([*also, *sorted(table)]) or "none"

        if not isinstance(name, str):
            raise UnknownNameError(f"a {kind} is named by a string (available: {known()}), got {shown_argument(name)}")
        plugin, qualified, bare = name.partition(QUALIFIER)
        if qualified and name not in table and bare in table and table[bare].plugin == plugin:
            return table[bare].value  # a qualified name stays good once its clash is gone
        if name not in table:
            if name in self.ambiguous:
                choices = " or ".join(f"{p}{QUALIFIER}{name}" for p in self.ambiguous[name])
                raise UnknownNameError(f"{kind} {name!r} is registered by several plugins: name one, {choices}")
            hint = (
                f"; plugin(s) {', '.join(self.broken)} failed to load or register: `chatcore plugins` says why"
                if self.broken
                else ""
            )
            raise UnknownNameError(f"unknown {kind} {name!r} (available: {known()}){hint}")
        return table[name].value

    def decoder(self, name: str) -> Any:
        return self._lookup(self.decoders, "decoder", name)

    def steerer(self, name: str) -> Any:
        return self._lookup(self.steerers, "steerer", name)

    def plugin_of(self, kind: str, name: str) -> str:
        """The plugin that registered ``name`` (kind: decoder, steerer, prompt format, prompt
        set), or "?"."""
        table = {
            "decoder": self.decoders,
            "steerer": self.steerers,
            "prompt format": self.prompt_formats,
            "prompt set": self.prompt_sets,
        }[kind]
        return table[name].plugin if name in table else "?"

    def prompt_format(self, name: str, also: Sequence[str] = ()) -> Any:
        """The prompt format class registered as ``name``; ``also``: the names a caller resolves
        itself (``auto``), listed first among the available ones when ``name`` is unknown."""
        return self._lookup(self.prompt_formats, "prompt format", name, also)

    def prompt_set(self, name: str) -> Any:
        return self._lookup(self.prompt_sets, "prompt set", name)


_registries: "weakref.WeakKeyDictionary[PluginHost, tuple[int, Registry]]" = weakref.WeakKeyDictionary()
_registries_lock = threading.RLock()


def registry_of(host: PluginHost | None = None) -> Registry:
    """The registry of ``host`` (default: the process-wide host): built on first use and
    kept until a plugin is registered on the host or taken off it."""
    host = host or get_plugin_host()
    with _registries_lock:
        built = _registries.get(host)
        if built is None or built[0] != host.changes:
            built = (host.changes, Registry.build(host))
            _registries[host] = built
        return built[1]
