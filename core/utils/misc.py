"""Small helpers shared across the framework: name resolution, the Ray box, periodic actions."""

from __future__ import annotations

import importlib
from typing import Any

#: Registry kinds whose names `load_function` resolves (the objects the `--*-path` flags select).
FUNCTION_KINDS = ("data_sources", "rollout_functions", "batch_filters", "reward_functions", "checkpoint_policies")


def load_function(spec: Any, args: Any = None) -> Any:
    """Resolve a registered plugin name or a dotted `module.attribute` path to the object it names.

    `None` stays None and callables pass through, so `--*-path` flags may be unset or set in code.
    Registered names come from the run's plugins (`args.plugin_selection`) or the built-ins.
    """
    if spec is None or callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"Expected a registered name or a dotted path, got {spec!r}")
    from slime.plugin_manager import registry_for

    found = registry_for(args).find(spec, FUNCTION_KINDS)
    if found is not None:
        return found.target
    module_name, _, attribute = spec.rpartition(".")
    if not module_name:
        raise ValueError(f"{spec!r} is neither a registered plugin name nor a dotted path like 'package.module.name'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"Cannot import {module_name!r} to load {spec!r}: {exc}", name=exc.name) from exc
    try:
        return getattr(module, attribute)
    except AttributeError as exc:
        raise AttributeError(f"Module {module_name!r} has no attribute {attribute!r} (from {spec!r})") from exc


class Box:
    """Wraps a Ray ObjectRef so that passing it to a remote call does not dereference it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"Box({self.inner!r})"


def should_run_periodic_action(
    rollout_id: int, interval: int | None, num_rollout_per_epoch: int | None = None, num_rollout: int | None = None
) -> bool:
    """True after every `interval`-th step, at each epoch end and at the last step."""
    if interval is None:
        return False
    step = rollout_id + 1
    if num_rollout is not None and step == num_rollout:
        return True
    if num_rollout_per_epoch is not None and num_rollout_per_epoch > 0 and step % num_rollout_per_epoch == 0:
        return True
    return step % interval == 0
