"""The NIXL transport: training shards move over Ray's NIXL tensor transport (GPU/RDMA), not durable."""

from __future__ import annotations

from collections.abc import Iterable

from slime import hookimpl
from slime.specs import TransportSpec


def put_over_nixl(shard: dict) -> object:
    """Put one rank's training dict into Ray with its tensors sent over NIXL."""
    import ray

    return ray.put(shard, _tensor_transport="nixl")


@hookimpl
def slime_transports() -> Iterable[TransportSpec]:
    return [
        TransportSpec(
            "nixl",
            None,
            "Ray object refs whose tensors move over NIXL (needs NIXL and GPUs/RDMA); not durable",
            put_shard=put_over_nixl,
            checkpoint_policy="plain",
        )
    ]
