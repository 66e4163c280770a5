"""Plugin loader and registry.

Every implementation, built-in or third-party, comes from the ``kangaroo`` entry-point group. Loading is forgiving
(a plugin that raises on import or in a hook is reported with its error and the rest keeps working); resolving a
name is strict (unknown names list the known ones, names registered twice name both sources).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import traceback
from typing import Any

import attrs
import pluggy

from kangaroo_core import hookspecs
from kangaroo_core.config import ConfigError, DecodeConfig, unknown_options, unknown_plugin
from kangaroo_core.errors import PluginError
from kangaroo_core.interfaces import Backend, BenchMethod, SelfDrafter, StoppingPolicy, TreeShaper, Verifier

ENTRY_POINT_GROUP = "kangaroo"

#: kind -> (hook name, base class)
KINDS: dict[str, tuple[str, type]] = {
    "backend": ("register_backends", Backend),
    "drafter": ("register_drafters", SelfDrafter),
    "policy": ("register_policies", StoppingPolicy),
    "verifier": ("register_verifiers", Verifier),
    "bench_method": ("register_bench_methods", BenchMethod),
    "tree": ("register_tree_shapers", TreeShaper),
}


@attrs.define
class PluginInfo:
    """One loaded (or failed) plugin, as ``kangaroo plugins`` shows it."""

    name: str
    distribution: str | None = None
    version: str | None = None
    registers: dict[str, list[str]] = attrs.field(factory=dict)
    errors: list[str] = attrs.field(factory=list)

    def describe_source(self) -> str:
        if self.distribution:
            return f"plugin '{self.name}' ({self.distribution} {self.version})"
        return f"plugin '{self.name}'"

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class Registration:
    kind: str
    name: str
    factory: Any
    source: PluginInfo = attrs.field(eq=False)


def _error_line(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


class Registry:
    """The plugins found in one environment and what they registered."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self._entries: dict[str, dict[str, Registration]] = {kind: {} for kind in KINDS}
        self._duplicates: dict[tuple[str, str], list[PluginInfo]] = {}

    # -- loading -------------------------------------------------------------------------------------------------
    def load_entry_points(self) -> "Registry":
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = getattr(ep, "dist", None)
            info = PluginInfo(ep.name, dist.name if dist else None, dist.version if dist else None)
            try:
                module = ep.load()
            except Exception as exc:  # a broken plugin must not take the others down
                info.errors.append(f"failed to import {ep.value}: {_error_line(exc)}")
                self.plugins[info.name] = info
                continue
            self.add(module, info)
        return self

    def add(self, plugin: object, info: PluginInfo | str) -> PluginInfo:
        """Register a plugin object (a module or any object with hookimpls) and collect its registrations."""
        if isinstance(info, str):
            info = PluginInfo(info)
        if info.name in self.plugins:
            raise PluginError(f"a plugin named '{info.name}' is already loaded ({self.plugins[info.name].describe_source()})")
        self.plugins[info.name] = info
        try:
            self.pm.register(plugin, name=info.name)
        except Exception as exc:  # e.g. a hookimpl with a wrong signature
            info.errors.append(f"invalid plugin: {_error_line(exc)}")
            return info
        for kind, (hook_name, _base) in KINDS.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin_name == info.name:
                    self._call_register_hook(kind, hook_name, impl, info)
        return info

    def _call_register_hook(self, kind: str, hook_name: str, impl, info: PluginInfo) -> None:
        def register(name: str, factory: Any) -> None:
            self._register(kind, name, factory, info)

        try:
            impl.function(register=register)
        except Exception as exc:
            info.errors.append(f"{hook_name} raised {_error_line(exc)}")

    def _register(self, kind: str, name: str, factory: Any, info: PluginInfo) -> None:
        base = KINDS[kind][1]
        if not (isinstance(factory, type) and issubclass(factory, base)):
            info.errors.append(f"{kind} '{name}' is not a subclass of {base.__name__}: {factory!r}")
            return
        info.registers.setdefault(kind, []).append(name)
        existing = self._entries[kind].get(name)
        if existing is not None:
            sources = self._duplicates.setdefault((kind, name), [existing.source])
            sources.append(info)
            message = f"{kind} '{name}' is registered twice: by " + " and by ".join(s.describe_source() for s in sources)
            for source in sources:
                if message not in source.errors:
                    source.errors.append(message)
            return
        self._entries[kind][name] = Registration(kind, name, factory, info)

    # -- resolving -----------------------------------------------------------------------------------------------
    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[kind])

    def resolve(self, kind: str, name: str) -> Any:
        """The class registered as ``name`` for ``kind``; a :class:`PluginError` naming the problem otherwise."""
        if kind not in KINDS:
            raise PluginError(f"unknown plugin kind '{kind}'; kinds: {', '.join(KINDS)}")
        sources = self._duplicates.get((kind, name))
        if sources:
            raise PluginError(
                f"{kind} '{name}' is registered twice: by " + " and by ".join(s.describe_source() for s in sources)
            )
        entry = self._entries[kind].get(name)
        if entry is None:
            raise unknown_plugin(kind, name, self.names(kind))
        return entry.factory

    def create(self, kind: str, name: str, config: DecodeConfig, options: dict | None = None) -> Any:
        """The plugin ``name`` of ``kind``, built from ``config`` and its ``options``.

        Options are checked against the plugin's ``create`` signature first: an unknown key, a wrong type or a bad
        value becomes one :class:`ConfigError` line naming the plugin and its valid options, never a traceback."""
        factory = self.resolve(kind, name)
        options = dict(options or {})
        self.check_options(kind, name, options)
        try:
            return factory.create(config, **options)
        except TypeError as exc:
            if "argument" not in str(exc):  # a bug inside the plugin, not a bad option: keep its traceback
                raise
            raise ConfigError(f"{kind} '{name}': {exc}; valid options: {valid_options(factory)}") from None
        except ValueError as exc:
            if isinstance(exc, ConfigError):
                raise ConfigError(f"{kind} '{name}': {exc}") from None
            raise ConfigError(f"{kind} '{name}': bad option value ({exc}); valid options: "
                              f"{valid_options(factory)}") from None

    def check_options(self, kind: str, name: str, options: dict) -> None:
        """Refuse option names that ``name``'s ``create`` does not take (before anything is loaded)."""
        factory = self.resolve(kind, name)
        valid = option_names(factory)
        unknown = sorted(set(options) - set(valid)) if valid is not None else []
        if unknown:
            raise unknown_options(kind, name, unknown, valid)

    def report(self) -> list[dict[str, Any]]:
        return [self.plugins[name].to_dict() for name in sorted(self.plugins)]


def valid_options(factory: type) -> str:
    """The options a plugin takes, for error messages."""
    names = option_names(factory)
    return "unknown" if names is None else ", ".join(names) or "none"


def option_names(factory: type) -> list[str] | None:
    """The keyword options a plugin class takes: its ``create`` parameters, or its ``__init__`` parameters when
    ``create`` passes ``**options`` on (the base classes' default); None when they cannot be told."""
    def named(function, skip: int) -> tuple[list[str], bool]:
        parameters = list(inspect.signature(function).parameters.values())[skip:]
        keywords = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        return keywords, any(p.kind is p.VAR_KEYWORD for p in parameters)

    try:
        names, open_ended = named(factory.create, 1)  # bound classmethod: (config, ...)
        if open_ended and factory.__init__ is object.__init__:  # no options at all
            open_ended = False
        elif open_ended:
            more, open_ended = named(factory.__init__, 1)
            names = list(dict.fromkeys(names + more))
    except (TypeError, ValueError):
        return None
    return None if open_ended else names


_registry: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, loaded from entry points on first use."""
    global _registry
    if _registry is None:
        _registry = Registry().load_entry_points()
    return _registry


def register_plugin(plugin: object, name: str) -> PluginInfo:
    """Add a plugin object at run time (Python API users, tests) to the process-wide registry."""
    return get_registry().add(plugin, PluginInfo(name))


def unregister_plugin(name: str) -> None:
    """Remove a plugin added with :func:`register_plugin` (rebuilds the registry from entry points)."""
    global _registry
    extras = {n: p for n, p in get_registry().pm.list_name_plugin() if n != name}
    entry_names = {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    _registry = Registry().load_entry_points()
    for n, plugin in extras.items():
        if n not in entry_names:
            _registry.add(plugin, PluginInfo(n))
