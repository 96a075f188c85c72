"""Reward dispatch: `--custom-rm-path` or `--rm-type`, each a registered reward function name (registry kind
"reward_functions") or a dotted path. A reward function is `fn(args, sample) -> float`; async functions are
awaited. Scoring a batch needs no special function: `batched_async_rm` scores samples concurrently."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from slime.utils.types import Sample


def resolve_reward_function(args: Any, sample: Sample | None = None) -> Any:
    """The reward function for `sample`: its own `custom_rm_path`, `--custom-rm-path`, else `--rm-type`."""
    from slime.utils import misc

    path = getattr(sample, "custom_rm_path", None) or getattr(args, "custom_rm_path", None)
    if path:
        return misc.load_function(misc.plugin_name("reward_functions", path, args))
    rm_type = getattr(args, "rm_type", None)
    if not rm_type:
        raise ValueError("No reward function configured: set --rm-type NAME (a registered reward) or --custom-rm-path")
    return misc.load_function(misc.plugin_name("reward_functions", rm_type, args))


async def async_rm(args: Any, sample: Sample) -> float:
    """Score one sample."""
    reward = resolve_reward_function(args, sample)(args, sample)
    if inspect.isawaitable(reward):
        reward = await reward
    return reward


async def batched_async_rm(args: Any, samples: list[Sample]) -> list[float]:
    """Score samples concurrently, in order."""
    return list(await asyncio.gather(*(async_rm(args, sample) for sample in samples)))
