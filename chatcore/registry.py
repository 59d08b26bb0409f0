"""The names every plugin registered: decoders, steerers, prompt formats and eval prompt sets.

The CLI, the REPL and the Discord bot list and validate names here, in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chatcore.errors import UnknownNameError
from chatcore.plugin_manager import PluginHost


@dataclass
class Entry:
    name: str
    value: Any
    plugin: str


@dataclass
class Registry:
    decoders: dict[str, Entry] = field(default_factory=dict)
    steerers: dict[str, Entry] = field(default_factory=dict)
    prompt_sets: dict[str, Entry] = field(default_factory=dict)
    prompt_formats: dict[str, Entry] = field(default_factory=dict)

    @classmethod
    def build(cls, host: PluginHost) -> "Registry":
        from chatcore.decoding import Decoder
        from chatcore.prompting import PromptFormat
        from chatcore.steering import Steerer

        registry = cls()

        def collect(hook: str, table: dict[str, Entry], base: type | None) -> None:
            current = {"plugin": "?"}

            def register(item: Any, loader: Callable[[], Any] | None = None) -> None:
                if loader is not None:  # register(name, loader) for prompt sets
                    name, value = str(item), loader
                else:
                    if base is not None and not (isinstance(item, type) and issubclass(item, base)):
                        raise TypeError(f"{hook}: expected a {base.__name__} subclass, got {item!r}")
                    name, value = getattr(item, "name", ""), item
                if not isinstance(name, str) or not name:
                    raise TypeError(f"{hook}: {item!r} has no name")
                if name in table:
                    host.report(current["plugin"], f"hook {hook}",
                                f"{name!r} is already registered by {table[name].plugin!r}; ignored")
                    return
                table[name] = Entry(name, value, current["plugin"])

            caller = getattr(host.pm.hook, hook)
            for impl in reversed(caller.get_hookimpls()):
                current["plugin"] = impl.plugin_name
                try:
                    impl.function(register=register)
                except Exception as error:
                    host.report(impl.plugin_name, f"hook {hook}", error)

        collect("register_decoders", registry.decoders, Decoder)
        collect("register_steerers", registry.steerers, Steerer)
        collect("register_prompt_sets", registry.prompt_sets, None)
        collect("register_prompt_formats", registry.prompt_formats, PromptFormat)
        return registry

    @staticmethod
    def _lookup(table: dict[str, Entry], kind: str, name: str) -> Any:
        if name not in table:
            known = ", ".join(sorted(table)) or "none"
            raise UnknownNameError(f"unknown {kind} {name!r} (available: {known})")
        return table[name].value

    def decoder(self, name: str) -> Any:
        return self._lookup(self.decoders, "decoder", name)

    def steerer(self, name: str) -> Any:
        return self._lookup(self.steerers, "steerer", name)

    def plugin_of(self, kind: str, name: str) -> str:
        """The plugin that registered ``name`` (kind: decoder, steerer, prompt format), or "?"."""
        table = {"decoder": self.decoders, "steerer": self.steerers, "prompt format": self.prompt_formats}[kind]
        return table[name].plugin if name in table else "?"

    def prompt_format(self, name: str) -> Any:
        return self._lookup(self.prompt_formats, "prompt format", name)

    def prompt_set(self, name: str) -> Any:
        return self._lookup(self.prompt_sets, "prompt set", name)
