"""Typed, frozen descriptions of what provider hooks yield.

Every provider hook (`slime_transports`, `slime_data_sources`, ...) returns an iterable of one of these
classes. The plugin manager collects them into a `Registry`, keyed by `name`; two plugins providing the
same name of the same kind is an error that names both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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
    """A rollout data transport.

    `durable`: payloads are published to shared storage (straw) before a reference travels through Ray;
    rollout groups, batches and shards are then references, and the queue records acceptance.
    `put_shard`: for in-memory transports, how one data-parallel rank's dict enters the object store
    (`target` is unused for them and may be None).
    `checkpoint_policy`: the name of the checkpoint policy a run on this transport uses by default.
    `data_source`: the data source a run on this transport uses when `--data-source-path` is not given
    (a durable transport needs a source whose state the joint checkpoint can bind).
    """

    durable: bool = False
    put_shard: Callable[[dict], Any] | None = None
    checkpoint_policy: str = "plain"
    data_source: str = "prompts"


@dataclass(frozen=True)
class DataSourceSpec(ProvidedSpec):
    """A prompt data source class, constructed with the run's `args` (`target(args)`)."""


@dataclass(frozen=True)
class RolloutFunctionSpec(ProvidedSpec):
    """A rollout function `target(args, rollout_id, data_source, evaluation=False)`."""


@dataclass(frozen=True)
class BatchFilterSpec(ProvidedSpec):
    """A filter over finished groups: `kind` is "dynamic" (per group, keep or drop) or "sample" (whole batch)."""

    kind: str = "dynamic"


@dataclass(frozen=True)
class CheckpointPolicySpec(ProvidedSpec):
    """How a training step is saved: `target(args, rollout_id, actor, critic, rollout_manager, **kw)`."""


@dataclass(frozen=True)
class RolloutEngineSpec(ProvidedSpec):
    """A rollout engine family: `target` launches engine servers for a run; `requires_gpu` gates CPU runs."""

    requires_gpu: bool = False


@dataclass(frozen=True)
class TrainBackendSpec(ProvidedSpec):
    """A training backend: `target` is the Ray actor class of one training rank."""

    requires_gpu: bool = False


@dataclass(frozen=True)
class RewardFunctionSpec(ProvidedSpec):
    """A reward function `target(args, sample) -> float` (async functions are awaited)."""


SPEC_KINDS: dict[str, type[ProvidedSpec]] = {
    "slime_transports": TransportSpec,
    "slime_data_sources": DataSourceSpec,
    "slime_rollout_functions": RolloutFunctionSpec,
    "slime_batch_filters": BatchFilterSpec,
    "slime_checkpoint_policies": CheckpointPolicySpec,
    "slime_rollout_engines": RolloutEngineSpec,
    "slime_train_backends": TrainBackendSpec,
    "slime_reward_functions": RewardFunctionSpec,
}
