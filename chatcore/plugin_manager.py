"""Finding, loading and isolating plugins.

Plugins come from the ``chatcore`` entry-point group; the built-ins are listed there
by chatcore's own package metadata. Unlike pluggy's ``load_setuptools_entrypoints``,
which aborts at the first entry point that fails to import, every entry point is
loaded on its own: a broken plugin is recorded in :attr:`PluginHost.problems`,
logged with its name, and skipped.

``CHATCORE_PLUGINS`` (comma-separated entry-point or distribution names) limits which
third-party plugins load; the built-ins always load. Set it to an empty string to
load none but the built-ins.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from chatcore import hookspecs

ENTRY_POINT_GROUP = "chatcore"
BUILTIN_PREFIX = "chatcore."
ENV_PLUGINS = "CHATCORE_PLUGINS"
LOAD_STAGES = ("import", "register", "validate", "lookup")

logger = logging.getLogger("chatcore.plugins")


@dataclass
class PluginProblem:
    plugin: str
    stage: str  # "import", "register", "validate", "lookup" or "hook <name>"
    message: str

    def __str__(self) -> str:
        return f"plugin {self.plugin!r} failed at {self.stage}: {self.message}"


@dataclass
class PluginInfo:
    name: str
    module: str
    distribution: str | None
    version: str | None
    builtin: bool
    hooks: list[str] = field(default_factory=list)


def first_paragraph(message: str) -> str:
    """``message``'s first paragraph on one line: its lines up to the first blank one, joined
    with "; " (pluggy gives the reason a hook is refused on its last line; pydantic's advice
    runs on in further paragraphs)."""
    lines = []
    for line in message.strip().splitlines():
        if not line.strip():
            break
        lines.append(line.strip())
    return "; ".join(lines) if lines else message


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _allowed_names() -> set[str] | None:
    raw = os.environ.get(ENV_PLUGINS)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


class PluginHost:
    """A pluggy manager plus the bookkeeping that keeps one broken plugin from
    taking the program down."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("chatcore")
        self.pm.add_hookspecs(hookspecs)
        self.problems: list[PluginProblem] = []
        self.infos: dict[str, PluginInfo] = {}
        # Counts registrations and removals, so that the registry (chatcore.registry.registry_of)
        # is rebuilt only when the plugins changed.
        self.changes = 0

    # -- loading -----------------------------------------------------------------
    def report(self, plugin: str, stage: str, error: BaseException | str) -> None:
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        message = first_paragraph(message)
        problem = PluginProblem(plugin, stage, message)
        if problem in self.problems:
            # A hook that fails the same way on every reply is recorded (and said) once: a bot
            # that runs for weeks keeps a short list.
            return
        self.problems.append(problem)
        # Problems found while loading plugins and collecting their names are kept quiet
        # (every command, `--help` included, loads them): `chatcore plugins` lists them,
        # an unknown name points there, and the chat shows their count. A hook failing
        # while the program runs is said at once.
        loading = stage in LOAD_STAGES or stage.startswith("hook register_")
        logger.log(logging.DEBUG if loading else logging.WARNING, "%s", problem)

    def register(self, plugin: Any, name: str, info: PluginInfo | None = None) -> bool:
        """Register one plugin object or module; False (and a recorded problem) if refused."""
        try:
            self.pm.register(plugin, name=name)
        except Exception as error:  # PluginValidationError, ValueError (duplicate name), ...
            self.report(name, "register", error)
            return False
        wrappers = sorted(
            caller.name
            for caller in self.pm.get_hookcallers(plugin) or []
            for impl in caller.get_hookimpls()
            if impl.plugin is plugin and (impl.hookwrapper or impl.wrapper)
        )
        if wrappers:
            # call_each calls implementations one by one (a failing one is skipped): a wrapper
            # around the others would never run, so it is refused rather than ignored.
            self.pm.unregister(plugin)
            self.report(name, "register", f"hook wrappers are not supported on chatcore hooks: {', '.join(wrappers)}")
            return False
        self.changes += 1
        self.infos[name] = info or PluginInfo(
            name=name,
            module=getattr(plugin, "__name__", type(plugin).__name__),
            distribution=None,
            version=None,
            builtin=False,
        )
        return True

    def unregister(self, name: str) -> None:
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin)
            self.changes += 1
        self.infos.pop(name, None)

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        allowed = _allowed_names()
        matched: set[str] = set()
        seen: set[str] = set()
        for entry_point in metadata.entry_points(group=group):
            distribution = entry_point.dist.name if entry_point.dist else None
            # Built-in means shipped by chatcore's own distribution, not merely a module
            # under the chatcore namespace.
            builtin = _normalise(distribution or "") == "chatcore" and entry_point.value.startswith(BUILTIN_PREFIX)
            name = entry_point.name if builtin else f"{distribution or 'unknown'}:{entry_point.name}"
            if name in seen:
                continue  # the same distribution found twice on sys.path
            seen.add(name)
            if allowed is not None:
                names = {entry_point.name, name, *([distribution] if distribution else [])}
                matched |= names & allowed
                if not builtin and not names & allowed:
                    continue
            try:
                plugin = entry_point.load()
            except BaseException as error:  # noqa: BLE001 - SystemExit in a plugin must not exit us
                if isinstance(error, KeyboardInterrupt):
                    raise
                self.report(name, "import", error)
                continue
            info = PluginInfo(
                name=name,
                module=entry_point.value,
                distribution=distribution,
                version=entry_point.dist.version if entry_point.dist else None,
                builtin=builtin,
            )
            self.register(plugin, name, info)
        for unknown in sorted((allowed or set()) - matched):  # a typo would otherwise leave a plugin out silently
            self.report(unknown, "lookup", f"{ENV_PLUGINS} names it, but no installed plugin is called so")
        self.check_pending()

    def load_builtins(self, names: tuple[str, ...]) -> None:
        """Register some of chatcore's own plugins, by their entry-point names ("greedy",
        "prompt_formats"), for a host assembled by hand (tests, embedding programs).

        They are found through the ``chatcore`` entry points as every plugin is, and named by
        their modules as :meth:`load_modules` names them; a name chatcore does not ship is
        reported like a plugin that fails to import.
        """
        shipped = {
            entry_point.name: entry_point.value
            for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP)
            if entry_point.dist is not None
            and _normalise(entry_point.dist.name) == "chatcore"
            and entry_point.value.startswith(BUILTIN_PREFIX)
        }
        for name in names:
            if name not in shipped:
                self.report(name, "import", f"chatcore ships no plugin named {name!r}")
        self.load_modules(tuple(shipped[name] for name in names if name in shipped))

    def load_modules(self, modules: tuple[str, ...]) -> None:
        """Register plugins by module name (for tests and embedding)."""
        for module_name in modules:
            try:
                module = importlib.import_module(module_name)
            except Exception as error:
                self.report(module_name, "import", error)
                continue
            info = PluginInfo(
                name=module_name,
                module=module_name,
                distribution=None,
                version=None,
                builtin=module_name.startswith(BUILTIN_PREFIX),
            )
            self.register(module, module_name, info)
        self.check_pending()

    def check_pending(self) -> None:
        """Unregister plugins whose hookimpls match no hook (a misspelled name)."""
        for name, plugin in list(self.pm.list_name_plugin()):
            for hook_name in self._hookimpl_names(plugin):
                caller = getattr(self.pm.hook, hook_name, None)
                if caller is None or not caller.has_spec():
                    self.report(name, "validate", f"unknown hook {hook_name!r} (misspelled?)")
                    self.unregister(name)
                    break
        self.pm.check_pending()  # anything left is a bug in chatcore itself

    def _hookimpl_names(self, plugin: Any) -> Iterator[str]:
        for attribute in dir(plugin):
            try:
                value = getattr(plugin, attribute)
            except Exception:
                continue
            if self.pm.parse_hookimpl_opts(plugin, attribute) is not None and callable(value):
                yield attribute

    # -- calling -----------------------------------------------------------------
    def call_each(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call every implementation of a hook in pluggy's order, isolating failures.

        Returns (plugin name, result) for each implementation that returned.
        """
        caller = getattr(self.pm.hook, hook_name)
        results = []
        for impl in reversed(caller.get_hookimpls()):  # no wrappers: register() refuses them
            try:
                arguments = {name: kwargs[name] for name in impl.argnames}
                results.append((impl.plugin_name, impl.function(**arguments)))
            except Exception as error:
                self.report(impl.plugin_name, f"hook {hook_name}", error)
        return results

    def plugins(self) -> list[PluginInfo]:
        infos = []
        for name, plugin in self.pm.list_name_plugin():
            info = self.infos.get(name)
            if info is None:
                continue
            info.hooks = sorted(caller.name for caller in self.pm.get_hookcallers(plugin) or [])
            infos.append(info)
        return sorted(infos, key=lambda i: (not i.builtin, i.name))


_default_host: PluginHost | None = None


def get_plugin_host() -> PluginHost:
    """The process-wide host, loaded from entry points on first use."""
    global _default_host
    if _default_host is None:
        host = PluginHost()
        host.load_entry_points()
        _default_host = host
    return _default_host


def set_plugin_host(host: PluginHost | None) -> None:
    """Replace the process-wide host (tests, embedding); None reloads on next use."""
    global _default_host
    _default_host = host


Register = Callable[..., None]
