"""Result type of dynamic-sampling filters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slime.utils.misc import plugin_name


@dataclass
class DynamicFilterOutput:
    """Whether a finished group is kept; `reason` names why it was dropped (for metrics)."""

    keep: bool
    reason: str | None = None


def dynamic_filter_verdict(args: Any, group: list, load_function: Callable[[Any], Any]) -> DynamicFilterOutput:
    """Run `--dynamic-sampling-filter-path` on a finished group (kept when none is set).

    `load_function` is passed by the caller so that the rollout module's own resolver is used; it gets the
    flag's value as a `PluginName` of kind "batch_filters", so a registered name of another kind is refused.
    A filter may return a `DynamicFilterOutput` or a plain truth value.
    """
    path = getattr(args, "dynamic_sampling_filter_path", None)
    if not path:
        return DynamicFilterOutput(keep=True)
    verdict = load_function(plugin_name("batch_filters", path, args))(args, group)
    return verdict if isinstance(verdict, DynamicFilterOutput) else DynamicFilterOutput(keep=bool(verdict))
