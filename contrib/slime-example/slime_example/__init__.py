"""A template slime-rl plugin: copy this package to start your own.

It adds `--example-length-target` and a reward function `length-target` that rewards responses whose
length is close to the target. Install with `pip install -e contrib/slime-example`; slime-run loads it
automatically (entry point group `slime`), or explicitly with `--plugin example`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from slime import hookimpl
from slime.specs import RewardFunctionSpec


def length_target_reward(args: Any, sample: Any) -> float:
    """1.0 for a response of exactly the target length, falling linearly to 0 at twice the distance."""
    target = getattr(args, "example_length_target", 8)
    distance = abs(len(sample.response) - target)
    return max(0.0, 1.0 - distance / max(target, 1))


@hookimpl
def slime_addoption(parser) -> None:
    parser.add_argument("--example-length-target", type=int, default=8, help="target response length (characters)")


@hookimpl
def slime_reward_functions() -> Iterable[RewardFunctionSpec]:
    return [RewardFunctionSpec("length-target", length_target_reward, "reward responses near a target length")]
