"""The NIXL transport: training shards move over Ray's NIXL tensor transport (GPU/RDMA), not durable."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from slime import hookimpl
from slime.specs import TransportSpec
from slime.transports.object_store import InMemoryTransport


class NixlTransport(InMemoryTransport):
    """The object-store transport, with each shard's tensors sent over NIXL instead of through the object store."""

    def put_shard(self, shard: dict) -> Any:
        import ray

        return ray.put(shard, _tensor_transport="nixl")


@hookimpl
def slime_transports() -> Iterable[TransportSpec]:
    return [
        TransportSpec(
            "nixl",
            NixlTransport,
            "Ray object refs whose tensors move over NIXL (needs NIXL and GPUs/RDMA); not durable",
            checkpoint_policy="plain",
        )
    ]
