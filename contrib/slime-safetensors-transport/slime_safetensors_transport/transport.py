"""`SafetensorsTransport`: training shards as safetensors files on a shared directory, groups in memory.

Built on the public plugin interfaces only: it extends `InMemoryTransport` (the object store's `Transport`:
rollout groups stay Python objects in the rollout manager, no service, no state of its own) and replaces how
training shards travel and where storage is checked. Each training batch's per-rank shards are written under
`--safetensors-transport-dir` (default `<--save>/safetensors_batches`), and each rank's `Box` carries a small
`SafetensorsShard` reference that the trainer loads itself. There is no queue: a restarted run starts its
rollouts over from the data source's checkpointed cursor (the `plain` checkpoint policy), so the transport
saves no state of its own; the shard files stay on disk after training.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path
from typing import Any

from slime.transports.object_store import InMemoryTransport
from slime_safetensors_transport.shards import make_private_dirs, write_durably, write_shard

#: Where batches go when `--safetensors-transport-dir` is not given, under `--save`.
DEFAULT_SUBDIR = "safetensors_batches"


def batch_directory(args: Any) -> Path:
    """The absolute batch directory: `--safetensors-transport-dir`, else `<--save>/safetensors_batches`."""
    explicit = getattr(args, "safetensors_transport_dir", None)
    if explicit:
        return Path(explicit).expanduser().resolve()
    save = getattr(args, "save", None)
    if not save:
        raise ValueError(
            "The safetensors transport needs --safetensors-transport-dir or --save: a directory every rollout and "
            "training node mounts"
        )
    return Path(save).expanduser().resolve() / DEFAULT_SUBDIR


def _read_probe(path: str) -> str:
    """On one node: the probe file's content as that node's mount shows it."""
    return Path(path).read_text()


class SafetensorsTransport(InMemoryTransport):
    """See the module docstring."""

    # ------------------------------------------------------------------------------------------ driver

    def prepare_storage(self) -> None:
        """Settle the absolute batch directory in the run's arguments and create it owner-only."""
        directory = batch_directory(self.args)
        self.args.safetensors_transport_dir = str(directory)
        make_private_dirs(directory)

    # ------------------------------------------------------------------------------------------ rollout manager

    def check_storage(self) -> None:
        """Write a probe file durably and read it back on every alive node with CPUs or GPUs."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        directory = batch_directory(self.args)
        marker = uuid.uuid4().hex
        probe = directory / f".probe-{marker}"
        try:
            make_private_dirs(directory)
            write_durably(probe, marker.encode())
        except OSError as exc:
            raise RuntimeError(f"The safetensors transport cannot write to its directory {directory}: {exc}") from exc
        shared = f"Every rollout and training node must share the safetensors transport's directory {directory}"
        try:
            read = ray.remote(num_cpus=0)(_read_probe)
            nodes = [
                node["NodeID"]
                for node in ray.nodes()
                if node.get("Alive") and (node.get("Resources", {}).get("CPU") or node.get("Resources", {}).get("GPU"))
            ]
            strategies = [NodeAffinitySchedulingStrategy(node, soft=False) for node in nodes]
            seen = ray.get([read.options(scheduling_strategy=s).remote(str(probe)) for s in strategies], timeout=60)
        except Exception as exc:
            raise RuntimeError(f"{shared}: {exc}") from exc
        finally:
            probe.unlink(missing_ok=True)
        if any(content != marker for content in seen):
            raise RuntimeError(f"{shared}: a node read other content from the probe file {probe}")

    def shard_batch(self, builder: Any, data: Any) -> list:
        """Write each rank's shard under `<dir>/<batch id>/` and give each rank a `SafetensorsShard` in its `Box`."""
        import ray

        from slime.utils.misc import Box

        schedule = builder.dp_schedule(data)
        batch_id = f"step_{builder.rollout_id}_{uuid.uuid4().hex[:12]}"
        plan = {
            "batch_id": batch_id,
            "partitions": schedule.partitions,
            "micro_batch_indices": schedule.micro_batch_indices,
            "num_microbatches": schedule.num_microbatches,
            "global_batch_sizes": schedule.global_batch_sizes,
            "total_lengths": schedule.total_lengths,
        }
        plan_digest = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()
        directory = make_private_dirs(batch_directory(self.args) / batch_id)
        boxes = []
        for rank in range(len(schedule.partitions)):
            reference = write_shard(directory, batch_id, plan_digest, rank, schedule.rank_shard(data, rank))
            boxes.append(Box(ray.put(reference)))
        return boxes
