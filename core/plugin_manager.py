"""Building the plugin manager of one run, and the registry of what its plugins provide.

A run's plugins are described by a small picklable `PluginSelection` (names asked for, names blocked,
whether third-party entry points autoload). The selection travels in `args.plugin_selection` to Ray
actors, which rebuild the same manager from it. Code called without a run gets the built-ins only.

Built-in plugins are entry points of group `slime` declared by the `slime-rl` distribution itself; they
always load (unless blocked with `-p no:NAME`). Entry points of other distributions load when autoload is
on (the default) or when named with `--plugin NAME`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pluggy

from slime import hookspecs
from slime.specs import SPEC_KINDS, ProvidedSpec

PROJECT = "slime"
DISTRIBUTION = "slime-rl"
ENV_PLUGINS = "SLIME_PLUGINS"
ENV_DISABLE_AUTOLOAD = "SLIME_DISABLE_PLUGIN_AUTOLOAD"
#: Built-ins a run cannot do without; `-p no:NAME` of one of them is refused.
ESSENTIAL_PLUGINS = {
    "object_store": "it provides the default transport, object-store",
    "checkpoint_policies": "it provides the checkpoint policies every run saves through",
}


class PluginError(RuntimeError):
    """A plugin could not be found, loaded or validated."""


@dataclass(frozen=True)
class PluginSelection:
    """Which plugins a run uses; picklable so actors can rebuild the run's manager."""

    plugins: tuple[str, ...] = ()
    blocked: tuple[str, ...] = ()
    autoload: bool = True

    @classmethod
    def from_cli(cls, plugins: Iterable[str], *, disable_autoload: bool = False) -> PluginSelection:
        """Combine `-p` values (including `no:NAME`) with `SLIME_PLUGINS` and the autoload switches."""
        names: list[str] = []
        for value in [*os.environ.get(ENV_PLUGINS, "").split(","), *plugins]:
            names.extend(part.strip() for part in value.split(",") if part.strip())
        wanted = tuple(dict.fromkeys(n for n in names if not n.startswith("no:")))
        blocked = tuple(dict.fromkeys(n[3:] for n in names if n.startswith("no:")))
        if clash := set(wanted) & set(blocked):
            raise PluginError(f"Plugins both requested and blocked: {', '.join(sorted(clash))}")
        for name in blocked:
            if name in ESSENTIAL_PLUGINS:
                raise PluginError(f"Cannot block built-in plugin {name!r} with -p no:{name}: {ESSENTIAL_PLUGINS[name]}")
        autoload = not (disable_autoload or os.environ.get(ENV_DISABLE_AUTOLOAD))
        return cls(plugins=wanted, blocked=blocked, autoload=autoload)


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=PROJECT))


def _is_builtin(entry_point: importlib.metadata.EntryPoint) -> bool:
    dist = entry_point.dist
    return dist is not None and dist.metadata["Name"] == DISTRIBUTION


def _load_entry_point(entry_point: importlib.metadata.EntryPoint) -> Any:
    try:
        return entry_point.load()
    except Exception as exc:
        raise PluginError(f"Plugin {entry_point.name!r} ({entry_point.value}) failed to import: {exc}") from exc


def build_plugin_manager(selection: PluginSelection | None = None) -> pluggy.PluginManager:
    """A fresh manager with the built-ins, autoloaded entry points and the selection's named plugins."""
    selection = selection or PluginSelection()
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in selection.blocked:
        pm.set_blocked(name)
    entry_points = {ep.name: ep for ep in _entry_points()}
    pm.slime_distributions = {}  # plugin name -> "distribution version", for `slime-run plugins`
    if not any(_is_builtin(ep) for ep in entry_points.values()):
        raise PluginError(
            "No built-in slime plugins are registered: the slime-rl distribution is not installed. "
            "Install it with: pip install -e ."
        )
    for name, entry_point in entry_points.items():
        if pm.is_blocked(name) or pm.has_plugin(name):
            continue
        if _is_builtin(entry_point) or selection.autoload or name in selection.plugins:
            pm.register(_load_entry_point(entry_point), name=name)
            dist = entry_point.dist
            if dist is not None:
                pm.slime_distributions[name] = f"{dist.metadata['Name']} {dist.version}"
    for name in selection.plugins:
        if pm.has_plugin(name):
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise PluginError(f"Plugin {name!r} failed to import: {exc}") from exc
            available = ", ".join(sorted(entry_points)) or "none"
            raise PluginError(
                f"Unknown plugin {name!r}: not an installed entry point of group 'slime' ({available}) "
                f"and not an importable module. Install its package (pip install ...) or fix the name."
            ) from exc
        except Exception as exc:
            raise PluginError(f"Plugin {name!r} failed to import: {type(exc).__name__}: {exc}") from exc
        pm.register(module, name=name)
    pm.check_pending()
    return pm


def plugin_module(pm: pluggy.PluginManager, name: str) -> ModuleType | Any:
    """The registered plugin object named `name` (a clear error when it is not loaded)."""
    plugin = pm.get_plugin(name)
    if plugin is None:
        raise PluginError(
            f"Plugin {name!r} is not loaded (loaded: {', '.join(sorted(n for n, _ in pm.list_name_plugin()))})"
        )
    return plugin


def named_plugin_defaults(pm: pluggy.PluginManager, selection: PluginSelection) -> dict[str, tuple[str, Any]]:
    """Defaults declared by plugins named on the command line: `{dest: (plugin name, value)}`."""
    defaults: dict[str, tuple[str, Any]] = {}
    for name in selection.plugins:
        plugin = pm.get_plugin(name)
        impl = getattr(plugin, "slime_cli_defaults", None)
        if plugin is None or impl is None:
            continue
        values = pm.subset_hook_caller(
            "slime_cli_defaults", remove_plugins=[p for p in pm.get_plugins() if p is not plugin]
        )()
        for value in values:
            if not isinstance(value, Mapping):
                raise PluginError(f"Plugin {name!r}: slime_cli_defaults must return a dict, got {type(value).__name__}")
            for dest, default in value.items():
                if dest in defaults and defaults[dest][1] != default:
                    raise PluginError(f"Plugins {defaults[dest][0]!r} and {name!r} set different defaults for {dest!r}")
                defaults[dest] = (name, default)
    return defaults


#: How messages name one thing of each registry kind.
KIND_NAMES = {
    "data_sources": "data source",
    "rollout_functions": "rollout function",
    "batch_filters": "batch filter",
    "reward_functions": "reward function",
    "advantage_estimators": "advantage estimator",
    "checkpoint_policies": "checkpoint policy",
    "transports": "transport",
    "rollout_engines": "rollout engine",
    "train_backends": "train backend",
}


def _plural(kind: str) -> str:
    return KIND_NAMES[kind].removesuffix("y") + "ies" if kind.endswith("ies") else KIND_NAMES[kind] + "s"


def check_kind(kind: str) -> str:
    """`kind` itself, or a ValueError listing the registry kinds."""
    if kind not in KIND_NAMES:
        raise ValueError(f"Unknown registry kind {kind!r}; kinds: {', '.join(KIND_NAMES)}")
    return kind


def import_dotted_path(path: str) -> Any:
    """The attribute `name` of module `package.module` for `path` = "package.module.name"."""
    module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"{path!r} is not a dotted path like 'package.module.name'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"Cannot import {module_name!r} to load {path!r}: {exc}", name=exc.name) from exc
    try:
        return getattr(module, attribute)
    except AttributeError as exc:
        raise AttributeError(f"Module {module_name!r} has no attribute {attribute!r} (from {path!r})") from exc


@dataclass(frozen=True)
class Registry:
    """What the loaded plugins provide, by kind (`transports`, `data_sources`, ...) and name."""

    kinds: Mapping[str, Mapping[str, ProvidedSpec]]
    providers: Mapping[tuple[str, str], str] = field(default_factory=dict)

    def get(self, kind: str, name: str) -> ProvidedSpec:
        """The spec of `kind` (e.g. "transports") named `name`; a clear error lists what exists."""
        specs = self.kinds[kind]
        if name not in specs:
            available = ", ".join(sorted(specs)) or "none"
            raise PluginError(f"No {KIND_NAMES[kind]} named {name!r}; available: {available}")
        return specs[name]

    def resolve(self, kind: str, value: str) -> Any:
        """The object `value` names as a `kind`: a name registered under `kind`, else a dotted path, imported.

        A name registered only under other kinds is refused, naming what it is and which plugin provides it,
        so that a reward function given as a filter fails at parse time rather than mid-rollout.
        """
        specs = self.kinds[check_kind(kind)]
        if value in specs:
            return specs[value].target
        others = [other for other, named in self.kinds.items() if value in named]
        if others:
            what = " and ".join(f"a {KIND_NAMES[other]}" for other in others)
            plugins = list(dict.fromkeys(repr(self.providers[(other, value)]) for other in others))
            raise PluginError(
                f"{value!r} is {what}, not a {KIND_NAMES[kind]} "
                f"(provided by plugin{'s' * (len(plugins) > 1)} {' and '.join(plugins)}); "
                f"registered {_plural(kind)}: {', '.join(sorted(specs)) or 'none'}"
            )
        if "." in value:
            return import_dotted_path(value)
        raise PluginError(
            f"No {KIND_NAMES[kind]} named {value!r}; registered {_plural(kind)}: {', '.join(sorted(specs)) or 'none'} "
            f"(or give a dotted path package.module.name)"
        )


def collect_registry(pm: pluggy.PluginManager) -> Registry:
    """Call every provider hook, validate each result's type and reject duplicate names naming both plugins."""
    kinds: dict[str, dict[str, ProvidedSpec]] = {}
    providers: dict[tuple[str, str], str] = {}
    for hook_name, spec_cls in SPEC_KINDS.items():
        kind = hook_name.removeprefix("slime_")
        specs: dict[str, ProvidedSpec] = {}
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            plugin_name = impl.plugin_name
            try:
                provided = list(impl.function() or ())
            except Exception as exc:
                raise PluginError(f"Plugin {plugin_name!r}: {hook_name}() failed: {exc}") from exc
            for spec in provided:
                if not isinstance(spec, spec_cls):
                    raise PluginError(
                        f"Plugin {plugin_name!r}: {hook_name}() must yield {spec_cls.__name__}, "
                        f"got {type(spec).__name__}"
                    )
                if spec.name in specs:
                    other = providers[(kind, spec.name)]
                    raise PluginError(
                        f"{spec_cls.__name__} {spec.name!r} is provided by both plugins {other!r} and {plugin_name!r}; "
                        f"block one with --plugin no:NAME"
                    )
                specs[spec.name] = spec
                providers[(kind, spec.name)] = plugin_name
        kinds[kind] = specs
    return Registry(kinds=kinds, providers=providers)


@functools.lru_cache(maxsize=8)
def _registry(selection: PluginSelection) -> Registry:
    return collect_registry(build_plugin_manager(selection))


def registry_of(selection: PluginSelection | None) -> Registry:
    """The registry of a plugin selection; None means the built-ins alone."""
    selection = selection or PluginSelection(autoload=False)
    if not isinstance(selection, PluginSelection):
        raise TypeError(f"plugin selection must be a PluginSelection, got {type(selection).__name__}")
    return _registry(selection)


def registry_for(args: Any = None) -> Registry:
    """The registry of a run's selection (`args.plugin_selection`), or of the built-ins alone."""
    return registry_of(getattr(args, "plugin_selection", None))
