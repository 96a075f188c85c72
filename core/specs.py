"""Typed, frozen descriptions of what provider hooks yield.

Every provider hook (`slime_transports`, `slime_data_sources`, ...) returns an iterable of one of these
classes. The plugin manager collects them into a `Registry`, keyed by `name`; two plugins providing the
same name of the same kind is an error that names both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: A component's `--deterministic` check: called with the run's arguments when they are parsed; raises ValueError
#: naming the option when the component cannot honour `--deterministic` with them (see `slime.determinism`).
DeterministicCheck = Callable[[Any], None]


@dataclass(frozen=True)
class ProvidedSpec:
    """Common fields: the registered name, what it is for, and the object it resolves to."""

    name: str
    target: Any
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"{type(self).__name__} name must be a non-empty word, got {self.name!r}")


@dataclass(frozen=True)
class TransportSpec(ProvidedSpec):
    """A rollout data transport: `target(args)` builds the run's `slime.interfaces.Transport`.

    `checkpoint_policy`: the name of the checkpoint policy a run on this transport uses by default.
    `data_source`: the data source a run on this transport uses when `--data-source-path` is not given
    (a transport that checkpoints its queue needs a source whose state its checkpoint can bind).
    """

    checkpoint_policy: str = "plain"
    data_source: str = "prompts"


@dataclass(frozen=True)
class DataSourceSpec(ProvidedSpec):
    """A prompt data source class, constructed with the run's `args` (`target(args)`)."""


@dataclass(frozen=True)
class RolloutFunctionSpec(ProvidedSpec):
    """A rollout function `target(args, rollout_id, data_source, evaluation=False)`.

    `deterministic`: None when it cannot take part in a `--deterministic` run (such a run is refused); else its
    check. Under `--deterministic` it must send each sample's `slime.determinism.sample_seed` as `sampling_seed`
    and hand groups to the transport in the order the data source issued them.
    """

    deterministic: DeterministicCheck | None = None


@dataclass(frozen=True)
class BatchFilterSpec(ProvidedSpec):
    """A filter over finished groups.

    Dynamic filters (`--dynamic-sampling-filter-path`) are `target(args, group) -> DynamicFilterOutput` and keep
    or drop one group; batch filters (`--rollout-sample-filter-path`) are `target(args, groups)` and edit the
    step's list of groups in place.
    """


@dataclass(frozen=True)
class CheckpointPolicySpec(ProvidedSpec):
    """How a training step is saved: `target(args, rollout_id, actor, critic, rollout_manager, **kw)`."""


@dataclass(frozen=True)
class RolloutEngineSpec(ProvidedSpec):
    """A rollout engine family: `target(args, num_engines)` launches engine servers for a run.

    `deterministic`: None when its engines cannot take part in a `--deterministic` run (such a run is refused); else
    its check. Under `--deterministic` its engines must sample with each request's `sampling_seed` and answer a
    request with the same tokens and log-probabilities whatever else they serve at the same time.

    `resources`: `resources(args) -> {"CPU": n, "GPU": m}`, what one engine asks Ray for under the run's arguments
    (the launcher must ask for the same, through `slime.ray.layout.engine_actor_options`); the run's layout is
    checked against the cluster with it before anything starts. None: the engines ask for nothing countable.
    """

    deterministic: DeterministicCheck | None = None
    resources: Callable[[Any], Mapping[str, float]] | None = None


@dataclass(frozen=True)
class TrainBackendSpec(ProvidedSpec):
    """A training backend: `target` is the Ray actor class of one training rank.

    `deterministic`: None when it cannot take part in a `--deterministic` run (such a run is refused); else its
    check. Under `--deterministic` it must use deterministic kernels, a fixed micro-batch and reduction order, and
    save and restore every RNG state with its checkpoints, so that the same batches give bitwise the same weights.
    """

    deterministic: DeterministicCheck | None = None


@dataclass(frozen=True)
class RewardFunctionSpec(ProvidedSpec):
    """A reward function `target(args, sample) -> float` (async functions are awaited)."""


@dataclass(frozen=True)
class AdvantageEstimatorSpec(ProvidedSpec):
    """An advantage estimator: `target(args, rewards, group_size, response_lengths) -> advantages`, one per sample
    (every response token of a sample trains with its sample's), from one step's rewards in batch order, grouped
    by prompt in consecutive runs of `group_size`.

    `ratio_level`: the importance ratio the policy loss uses by default with this estimator ("token": one per
    token, as in PPO; "sequence": one per sample, the geometric mean of its tokens', as in GSPO);
    `--importance-ratio-level` overrides it. `needs_critic`: it reads a value model's estimates, so a run must
    train a critic (`--use-critic`); a run with `--use-critic` and an estimator that does not is refused too.
    """

    ratio_level: str = "token"
    needs_critic: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ratio_level not in RATIO_LEVELS:
            raise ValueError(
                f"AdvantageEstimatorSpec {self.name!r}: ratio_level must be one of {', '.join(RATIO_LEVELS)}, "
                f"got {self.ratio_level!r}"
            )


#: The importance-ratio levels a policy loss can use (`AdvantageEstimatorSpec.ratio_level`).
RATIO_LEVELS = ("token", "sequence")

SPEC_KINDS: dict[str, type[ProvidedSpec]] = {
    "slime_transports": TransportSpec,
    "slime_data_sources": DataSourceSpec,
    "slime_rollout_functions": RolloutFunctionSpec,
    "slime_batch_filters": BatchFilterSpec,
    "slime_checkpoint_policies": CheckpointPolicySpec,
    "slime_rollout_engines": RolloutEngineSpec,
    "slime_train_backends": TrainBackendSpec,
    "slime_reward_functions": RewardFunctionSpec,
    "slime_advantage_estimators": AdvantageEstimatorSpec,
}
