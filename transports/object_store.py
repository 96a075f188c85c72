"""The object-store transport: rollout data travels through Ray's object store, in memory, not durable."""

from __future__ import annotations

from collections.abc import Iterable

from slime import hookimpl
from slime.specs import TransportSpec


def put_in_object_store(shard: dict) -> object:
    """Put one data-parallel rank's training dict into the Ray object store."""
    import ray

    return ray.put(shard)


@hookimpl
def slime_transports() -> Iterable[TransportSpec]:
    return [
        TransportSpec(
            "object-store",
            None,
            "In-memory Ray object store; fast, lost when a trainer or the driver dies",
            put_shard=put_in_object_store,
            checkpoint_policy="plain",
        )
    ]
