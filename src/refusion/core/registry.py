"""The plugin registry: one pluggy manager, filled by built-ins and entry points alike.

``get_registry()`` builds (once) a :class:`Registry` mapping ``(kind, name)`` to a part class and
the plugin it came from. Built-in modules in :data:`DEFAULT_PLUGINS` are registered first, then
every entry point of the group ``refusion`` unless the environment variable
``REFUSION_DISABLE_PLUGIN_AUTOLOAD`` is set (the test suite sets it). ``check_pending`` catches
hook implementations with misspelled names. Two plugins registering the same name for the same
kind is an error naming both.
"""

from __future__ import annotations

import difflib
import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Iterable

import pluggy

from refusion.core import hookspecs

#: kind -> hook name. The kind is what configs and `refusion plugins` call a part.
KINDS: dict[str, str] = {
    "decoder": "register_decoders",
    "scorer": "register_scorers",
    "drafter": "register_drafters",
    "selector": "register_selectors",
    "verifier": "register_verifiers",
    "extender": "register_extenders",
    "cache": "register_caches",
    "remasker": "register_remaskers",
    "proposer": "register_proposers",
    "acceptance": "register_acceptance_rules",
    "objective": "register_objectives",
}

DEFAULT_PLUGINS: tuple[str, ...] = (
    "refusion.plugins.scorers",
    "refusion.plugins.drafters",
    "refusion.plugins.selectors",
    "refusion.plugins.token_selectors",
    "refusion.plugins.verifiers",
    "refusion.plugins.extenders",
    "refusion.plugins.caches",
    "refusion.plugins.remasking",
    "refusion.plugins.objectives",
    "refusion.plugins.proposers",
    "refusion.plugins.acceptance",
    "refusion.decoders.refusion",
    "refusion.decoders.ar",
    "refusion.decoders.llada",
    "refusion.decoders.block",
    "refusion.decoders.speculative",
)

AUTOLOAD_ENV = "REFUSION_DISABLE_PLUGIN_AUTOLOAD"

#: kind -> the interface every class registered under it subclasses ("module:Class", imported on use)
INTERFACES: dict[str, str] = {
    "decoder": "refusion.core.interfaces:Decoder",
    "scorer": "refusion.core.interfaces:Scorer",
    "drafter": "refusion.core.interfaces:Drafter",
    "selector": "refusion.core.interfaces:Selector",
    "verifier": "refusion.core.interfaces:Verifier",
    "extender": "refusion.core.interfaces:Extender",
    "cache": "refusion.core.interfaces:CacheManager",
    "remasker": "refusion.core.interfaces:Remasker",
    "proposer": "refusion.core.interfaces:Proposer",
    "acceptance": "refusion.core.interfaces:AcceptanceRule",
    "objective": "refusion.core.objective:Objective",
}


def interface(kind: str) -> type:
    """The base class of ``kind`` (:data:`INTERFACES`)."""
    module, _, name = INTERFACES[kind].partition(":")
    return getattr(importlib.import_module(module), name)


class PluginError(ValueError):
    """A plugin could not be registered or a registered name could not be found."""


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    cls: type
    origin: str  # "builtin refusion.plugins.scorers" or "entry point x (dist y 1.0)"


class Registry:
    """Registered parts by kind and name."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], Entry] = {}

    def add(self, kind: str, name: str, cls: type, origin: str) -> None:
        if kind not in KINDS:
            raise PluginError(f"unknown part kind {kind!r}; allowed: {', '.join(KINDS)}")
        if not isinstance(name, str) or not name:
            raise PluginError(f"{origin} registered a {kind} with an invalid name {name!r}")
        base = interface(kind)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise PluginError(f"{origin} registered {cls!r} as {kind} {name!r}, but a {kind} must be a subclass "
                              f"of {base.__module__}.{base.__qualname__}")
        if (kind, name) in self._entries:
            first = self._entries[(kind, name)].origin
            raise PluginError(f"duplicate {kind} name {name!r}: registered by {first} and by {origin}")
        self._entries[(kind, name)] = Entry(kind, name, cls, origin)

    def get(self, kind: str, name: str) -> type:
        """The class registered as ``name`` for ``kind``; unknown names suggest close matches."""
        if kind not in KINDS:
            raise PluginError(f"unknown part kind {kind!r}; allowed: {', '.join(KINDS)}")
        entry = self._entries.get((kind, name))
        if entry is None:
            known = self.names(kind)
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise PluginError(f"unknown {kind} {name!r}{hint} (registered: {', '.join(known) or 'none'})")
        return entry.cls

    def names(self, kind: str) -> list[str]:
        return sorted(n for (k, n) in self._entries if k == kind)

    def entries(self, kind: str | None = None) -> list[Entry]:
        rows = [e for e in self._entries.values() if kind is None or e.kind == kind]
        return sorted(rows, key=lambda e: (list(KINDS).index(e.kind), e.name))


def _origin(pm: pluggy.PluginManager, plugin: object) -> str:
    name = pm.get_name(plugin) or repr(plugin)
    for p, dist in pm.list_plugin_distinfo():
        if p is plugin:
            return f"entry point {name} ({dist.metadata['name']} {dist.version})"
    if isinstance(plugin, ModuleType) and plugin.__name__ in DEFAULT_PLUGINS:
        return f"builtin {plugin.__name__}"
    return f"plugin {name}"


def make_plugin_manager(extra_plugins: Iterable[object] = (), autoload: bool | None = None) -> pluggy.PluginManager:
    """A plugin manager with the built-ins, ``extra_plugins`` and (unless disabled) entry points."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for mod in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(mod), mod)
    for plugin in extra_plugins:
        pm.register(plugin, name=getattr(plugin, "__name__", None) or type(plugin).__qualname__)
    if autoload is None:
        autoload = not os.environ.get(AUTOLOAD_ENV)
    if autoload:
        pm.load_setuptools_entrypoints(hookspecs.PROJECT)
    pm.check_pending()  # a hookimpl whose name matches no spec (a typo) raises here
    return pm


def build_registry(pm: pluggy.PluginManager) -> Registry:
    """Call every ``register_*`` hook implementation, one plugin at a time, recording origins."""
    reg = Registry()
    for kind, hook_name in KINDS.items():
        hook = getattr(pm.hook, hook_name)
        for impl in hook.get_hookimpls():  # registration order
            origin = _origin(pm, impl.plugin)
            impl.function(register=lambda name, cls, _k=kind, _o=origin: reg.add(_k, name, cls, _o))
    return reg


_REGISTRY: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = build_registry(make_plugin_manager())
    return _REGISTRY


def set_registry(registry: Registry | None) -> None:
    """Replace the process-wide registry (``None`` rebuilds it on next use); tests use this."""
    global _REGISTRY
    _REGISTRY = registry
