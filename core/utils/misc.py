"""Small helpers shared across the framework: name resolution, the Ray box, periodic actions."""

from __future__ import annotations

from typing import Any

#: Registry kinds a plain string given to `load_function` may name (the objects the `--*-path` flags select).
FUNCTION_KINDS = ("data_sources", "rollout_functions", "batch_filters", "reward_functions", "checkpoint_policies")


class PluginName(str):
    """A flag's value (a registered name or a dotted path) that names a thing of one registry `kind`.

    It compares, hashes and prints as the user's text; `load_function` resolves it only among `kind`, with the
    run's plugin `selection` (a `PluginSelection`, or None for the built-ins alone), in any process it reaches.
    """

    kind: str
    selection: Any

    def __new__(cls, value: str, kind: str, selection: Any = None) -> PluginName:
        from slime.plugin_manager import check_kind

        name = super().__new__(cls, value)
        name.kind = check_kind(kind)
        name.selection = selection
        return name

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.kind, self.selection)


def plugin_name(kind: str, value: Any, args: Any = None) -> Any:
    """`value` as a `PluginName` of `kind` with the run's selection (`args.plugin_selection`).

    None and callables (set in code rather than on the command line) come back unchanged.
    """
    if value is None or callable(value):
        return value
    if not isinstance(value, str):
        raise TypeError(f"Expected a registered {kind} name or a dotted path, got {value!r}")
    return PluginName(value, kind, getattr(args, "plugin_selection", None))


def load_function(spec: Any, args: Any = None) -> Any:
    """Resolve a registered plugin name or a dotted `module.attribute` path to the object it names.

    `None` stays None and callables pass through, so `--*-path` flags may be unset or set in code.
    A `PluginName` resolves among its own kind with its own selection. A plain string is a name registered
    under exactly one of `FUNCTION_KINDS` (by the run's plugins, `args.plugin_selection`, or the built-ins),
    else a dotted path.
    """
    if spec is None or callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"Expected a registered name or a dotted path, got {spec!r}")
    from slime.plugin_manager import KIND_NAMES, PluginError, import_dotted_path, registry_for, registry_of

    if isinstance(spec, PluginName):
        return registry_of(spec.selection).resolve(spec.kind, str(spec))
    registry = registry_for(args)
    kinds = [kind for kind in FUNCTION_KINDS if spec in registry.kinds[kind]]
    if len(kinds) > 1:
        raise PluginError(
            f"{spec!r} is registered as several kinds ({', '.join(KIND_NAMES[kind] for kind in kinds)}); "
            f"resolve it with load_function(plugin_name(KIND, value, args))"
        )
    if kinds:
        return registry.kinds[kinds[0]][spec].target
    if "." not in spec:
        raise ValueError(f"{spec!r} is neither a registered plugin name nor a dotted path like 'package.module.name'")
    return import_dotted_path(spec)


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
