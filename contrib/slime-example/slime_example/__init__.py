"""A template slime-rl plugin: copy this package to start your own.

It provides one thing of each kind most plugins start with, each selected by name on the command line:

- `--rm-type length-target` (reward function): rewards responses whose length is close to
  `--example-length-target`.
- `--data-source-path example-prompts` (data source): the built-in `prompts` source (`--prompt-data`) that
  stamps every sample's `metadata["source"] = "example-prompts"`.
- `--dynamic-sampling-filter-path example-filter` (dynamic batch filter): drops a finished group whose rewards
  spread (max - min) is at most `--example-min-reward-spread` (default 0: all rewards equal); the step's
  metrics count the drops as `rollout/dynamic_filter/drop_example_low_spread`.
- `--rollout-function-path example-rollout` (rollout function): the built-in "sglang" rollout function that
  adds `example/groups` (groups in the step's batch) and `example/stamped_samples` (of those, samples the
  `example-prompts` source served) to the step's metrics.

Install with `pip install -e contrib/slime-example`; slime-run loads it automatically (entry point group `slime`),
or explicitly with `--plugin example`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from slime import hookimpl
from slime.data.data_source import RolloutDataSourceWithBuffer
from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.specs import BatchFilterSpec, DataSourceSpec, RewardFunctionSpec, RolloutFunctionSpec
from slime.utils.types import Sample

SOURCE = "example-prompts"
DROP_REASON = "example_low_spread"


def length_target_reward(args: Any, sample: Sample) -> float:
    """1.0 for a response of exactly the target length, falling linearly to 0 at twice the distance."""
    target = getattr(args, "example_length_target", 8)
    distance = abs(len(sample.response) - target)
    return max(0.0, 1.0 - distance / max(target, 1))


class ExamplePrompts(RolloutDataSourceWithBuffer):
    """The built-in prompt source (`--prompt-data`, resumable cursor, buffer of handed-back groups) that stamps
    `metadata["source"]` on every sample it serves, so later stages can tell where a sample came from."""

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = super().get_samples(num_samples)
        for group in groups:
            for sample in group:
                sample.metadata["source"] = SOURCE
        return groups


def drop_low_spread(args: Any, group: list[Sample]) -> DynamicFilterOutput:
    """Keep a finished group only if its rewards differ by more than `--example-min-reward-spread`."""
    rewards = [sample.get_reward_value(args) for sample in group]
    spread = max(rewards) - min(rewards)
    if spread > float(getattr(args, "example_min_reward_spread", 0.0) or 0.0):
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason=DROP_REASON)


def example_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """The built-in "sglang" rollout function, with the number of groups it produced (and of samples the
    `example-prompts` source stamped) added to the step's metrics."""
    from slime.interfaces import current_session
    from slime.rollout.base_types import iter_samples
    from slime.rollout.sglang_rollout import generate_rollout

    output = generate_rollout(args, rollout_id, data_source, evaluation=evaluation)
    if evaluation:
        return output
    # The batch may be a transport reference (straw); the run's transport session reads its groups back.
    groups = current_session(args).load_groups(output.samples)
    stamped = sum(1 for sample in iter_samples(groups) if sample.metadata.get("source") == SOURCE)
    metrics = {**(output.metrics or {}), "example/groups": len(groups), "example/stamped_samples": stamped}
    return dataclasses.replace(output, metrics=metrics)


@hookimpl
def slime_addoption(parser) -> None:
    group = parser.add_argument_group("slime-example plugin")
    group.add_argument("--example-length-target", type=int, default=8, help="target response length (characters)")
    group.add_argument(
        "--example-min-reward-spread",
        type=float,
        default=0.0,
        help="example-filter keeps a group only if max - min of its rewards exceeds this",
    )


@hookimpl
def slime_reward_functions() -> Iterable[RewardFunctionSpec]:
    return [RewardFunctionSpec("length-target", length_target_reward, "reward responses near a target length")]


@hookimpl
def slime_data_sources() -> Iterable[DataSourceSpec]:
    return [DataSourceSpec(SOURCE, ExamplePrompts, "the prompts source, stamping metadata['source']")]


@hookimpl
def slime_batch_filters() -> Iterable[BatchFilterSpec]:
    return [BatchFilterSpec("example-filter", drop_low_spread, "drop groups whose rewards spread is too small")]


@hookimpl
def slime_rollout_functions() -> Iterable[RolloutFunctionSpec]:
    return [RolloutFunctionSpec("example-rollout", example_rollout, "sglang rollout plus example/* metrics")]
