"""The plugin contract of slime-rl.

Every hook is named `slime_*`. Provider hooks return an iterable of the frozen spec classes in
`slime.specs`; the plugin manager collects the results of all plugins (each plugin's iterable is one
result) into a `slime.plugin_manager.Registry`. Initialization hooks shape the command line and the
run's arguments; lifecycle hooks let observers watch a run without changing it.

A plugin is a module or object with functions decorated with `slime.hookimpl`:

    from slime import hookimpl
    from slime.specs import RewardFunctionSpec

    @hookimpl
    def slime_reward_functions():
        return [RewardFunctionSpec("length", lambda args, sample: len(sample.response) / 100)]

Install it with an entry point in group `slime` (`[project.entry-points.slime] foo = "slime_foo"`), or
load it by dotted module name with `slime-run --plugin slime_foo`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

import pluggy

from slime.specs import (
    AdvantageEstimatorSpec,
    BatchFilterSpec,
    CheckpointPolicySpec,
    DataSourceSpec,
    RewardFunctionSpec,
    RolloutEngineSpec,
    RolloutFunctionSpec,
    TrainBackendSpec,
    TransportSpec,
)

hookspec = pluggy.HookspecMarker("slime")


@hookspec(historic=True)
def slime_addoption(parser: argparse.ArgumentParser) -> None:
    """Add command-line options. Called once per plugin when the plugin is registered (historic).

    Example (the built-in CPU engine): `parser.add_argument("--cpu-engine-num-threads", type=int, default=1)`.
    """


@hookspec
def slime_cli_defaults() -> dict[str, Any] | None:
    """Option defaults a plugin sets when it is named on the command line with `--plugin NAME`.

    Called only on plugins named explicitly (not on every autoloaded one). Keys are argparse
    destinations; the run logs each default a plugin set. Example: `{"rollout_data_transport": "straw"}`.
    """


@hookspec
def slime_configure(args: argparse.Namespace) -> None:
    """Validate or adjust the parsed arguments of a run, after all plugins are loaded.

    Called once by `slime-run` after parsing; raise `ValueError` with the flag to fix on bad input.
    """


@hookspec
def slime_transports() -> Iterable[TransportSpec]:
    """Rollout data transports, selected by `--rollout-data-transport NAME`.

    Called when a registry is built; all results collected. Example:
    `[TransportSpec("object-store", None, put_shard=ray.put)]`.
    """


@hookspec
def slime_data_sources() -> Iterable[DataSourceSpec]:
    """Prompt data sources, selected by `--data-source-path NAME` (or a dotted class path).

    All results collected. Example: `[DataSourceSpec("jsonl", MyJsonlSource)]`.
    """


@hookspec
def slime_rollout_functions() -> Iterable[RolloutFunctionSpec]:
    """Rollout functions, selected by `--rollout-function-path NAME` / `--eval-function-path NAME`.

    All results collected. Example: `[RolloutFunctionSpec("sglang", generate_rollout)]`.
    """


@hookspec
def slime_batch_filters() -> Iterable[BatchFilterSpec]:
    """Batch filters, selected by `--dynamic-sampling-filter-path NAME` or `--rollout-sample-filter-path NAME`.

    All results collected. Example: `[BatchFilterSpec("nonzero-std", check_reward_nonzero_std)]`.
    """


@hookspec
def slime_checkpoint_policies() -> Iterable[CheckpointPolicySpec]:
    """Checkpoint policies; a transport names its default, `--checkpoint-policy NAME` overrides it.

    All results collected. Example: `[CheckpointPolicySpec("joint", save_joint)]`.
    """


@hookspec
def slime_rollout_engines() -> Iterable[RolloutEngineSpec]:
    """Rollout engine families, selected by `--rollout-engine NAME`.

    All results collected. Example: `[RolloutEngineSpec("cpu", launch_cpu_engines)]`.
    """


@hookspec
def slime_train_backends() -> Iterable[TrainBackendSpec]:
    """Training backends, selected by `--train-backend NAME`.

    All results collected. Example: `[TrainBackendSpec("torch", TorchTrainRayActor)]`.
    """


@hookspec
def slime_reward_functions() -> Iterable[RewardFunctionSpec]:
    """Reward functions, selected by `--rm-type NAME` or `--custom-rm-path NAME`.

    All results collected. Example: `[RewardFunctionSpec("exact-match", exact_match)]`.
    """


@hookspec
def slime_advantage_estimators() -> Iterable[AdvantageEstimatorSpec]:
    """Advantage estimators, selected by `--advantage-estimator NAME`.

    All results collected. Example: `[AdvantageEstimatorSpec("grpo", grpo_advantages)]`.
    """


@hookspec
def slime_run_start(args: argparse.Namespace) -> None:
    """Prepare what a run needs on disk (build a model, write prompts) before Ray starts.

    Called once by `slime-run` after checkpoint resolution. `slime_configure` must stay free of side
    effects (tools and tests parse arguments without running); do file work here.
    """


@hookspec
def slime_after_rollout(
    args: argparse.Namespace, rollout_id: int, metrics: dict[str, Any], samples: list[dict[str, Any]]
) -> None:
    """Observer: a rollout step's data was generated and accepted; `metrics` holds what the rollout manager
    logged for it (`rollout/reward`, `rollout/response_length`, phase times, ...) and `samples` a few of its
    answers, one per group for the first groups: `{"group", "prompt", "response", "reward"}` (for sample tables).
    Called by the driver; an implementation may leave out the arguments it does not read."""


@hookspec
def slime_after_train_step(args: argparse.Namespace, rollout_id: int, metrics: dict[str, Any]) -> None:
    """Observer: the trainers finished a step. Called by the driver; results ignored."""


@hookspec
def slime_step_end(args: argparse.Namespace, rollout_id: int, metrics: dict[str, Any]) -> None:
    """Observer: a rollout step is done (trained, checkpointed when due, weights sent to the engines).

    `metrics` holds the driver's phase times in seconds: `perf/train_time`, `perf/save_time` (steps that
    saved), `perf/update_weights_time` and `perf/step_time` (the whole step). Called by the driver.
    """


@hookspec
def slime_after_eval(args: argparse.Namespace, rollout_id: int, metrics: dict[str, Any]) -> None:
    """Observer: the engines' weights after step `rollout_id` were evaluated (before the first step: step 0).

    `metrics` holds what was logged: `eval/<name>/reward` per `--eval-prompt-data` dataset, `eval/<name>/pass@k`
    when prompts were sampled more than once, and the eval rollout function's own metrics. Called by the driver.
    """


@hookspec
def slime_checkpoint_committed(args: argparse.Namespace, rollout_id: int, path: str) -> None:
    """Observer: a checkpoint of `rollout_id` is durable at `path`. Called by the driver; results ignored."""
