"""The object-store transport: rollout data travels through Ray's object store, in memory, not durable.

Groups stay Python objects in the rollout manager; each data-parallel rank's shard is `ray.put` into the
object store. Nothing survives the manager or a trainer: a restart starts the data over (checkpoints save
models and the data source's cursor, `plain` policy). `InMemoryTransport` is also the base of the NIXL
transport, which only changes how a shard enters the object store.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from slime import hookimpl
from slime.interfaces import OpenedSource, RolloutSession, Transport
from slime.specs import TransportSpec
from slime.utils.misc import Box


def _groups_list(groups: Any) -> list:
    if not isinstance(groups, (list, tuple)):
        raise TypeError(f"Expected a list of rollout groups, got {type(groups).__name__}")
    return list(groups)


class InMemorySession(RolloutSession):
    """Groups stay in memory: publishing hands them back unchanged, discarding forgets them."""

    async def publish_group(self, group: list, rollout_id: Any) -> Any:
        return group

    def publish_group_now(self, group: list, rollout_id: Any) -> Any:
        return group

    def discard_group(self, group: Any, reason: str) -> None:
        """Nothing is stored, so nothing is released; the filter metrics record the reason."""

    def load_groups(self, groups: Any) -> list:
        return _groups_list(groups)

    def publish_batch(self, groups: list, rollout_id: Any, *, dropped: list | None = None) -> Any:
        return groups


class InMemoryTransport(Transport):
    """Shards are `ray.put` dicts; no storage, no service, nothing to checkpoint but the data source."""

    def put_shard(self, shard: dict) -> Any:
        """Put one rank's training dict into the Ray object store."""
        import ray

        return ray.put(shard)

    def resolve_restore(self) -> tuple[Any, Any]:
        from slime.data.checkpoint import RestorePlan

        return self.args, RestorePlan()

    def prepare_storage(self) -> None:
        """Nothing is stored outside Ray's memory."""

    def check_storage(self) -> None:
        """Ray's object store is reachable from every node by construction."""

    def open_data_source(self, source_cls: Any, *, restore_plan: Any, serving: Any, service: Any) -> OpenedSource:
        return OpenedSource(source_cls(self.args))

    def rollout_session(self, service: Any) -> RolloutSession:
        return InMemorySession()

    def adopt_generated(self, source: Any, produced: Any) -> None:
        """Samples carry no transport bookkeeping in memory."""

    def accept_rollout(self, output: Any, rollout_id: int, *, service: Any) -> tuple[Any, dict | None, Any]:
        return _groups_list(output.samples), output.metrics, None

    def replay_archive(self, template: str, rollout_id: int, *, service: Any) -> tuple[list, Any] | None:
        return None

    def shard_batch(self, builder: Any, data: Any) -> list:
        schedule = builder.dp_schedule(data)
        return [Box(self.put_shard(schedule.rank_shard(data, rank))) for rank in range(len(schedule.partitions))]

    def save_state(self, builder: Any, rollout_id: int) -> None:
        """No transport state: the rollout manager saves the data source itself."""

    def load_state(self, builder: Any, rollout_id: int | None, source_restore: Any) -> None:
        """No transport state to restore."""

    def seal(self) -> None:
        """Nothing open."""


@hookimpl
def slime_transports() -> Iterable[TransportSpec]:
    return [
        TransportSpec(
            "object-store",
            InMemoryTransport,
            "In-memory Ray object store; fast, lost when a trainer or the driver dies",
            checkpoint_policy="plain",
        )
    ]
