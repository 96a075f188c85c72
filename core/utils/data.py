"""Training-side intake of a rollout batch: fetch this rank's share and localise its global columns.

A rank's `Box` holds whatever the run's transport put there: a Ray object ref of the shard dict, or of a
`slime.interfaces.ShardReference` that loads the shard itself (the straw transport's `TrainBatchRef`).
"""

from __future__ import annotations

import ray

from slime.data.refs import DiskPayloadRef
from slime.data.transport import unpack_rollout_payload
from slime.interfaces import ShardReference


def _check_batch_identities(refs: list, dp_size: int) -> None:
    """Every rank must train on the same conversion and plan; a mix would silently corrupt the step."""
    values = [ray.get(box.inner) for box in refs]
    identities = {
        (value.batch_id, value.plan_digest) if isinstance(value, ShardReference) else None for value in values
    }
    ranks = [value.rank if isinstance(value, ShardReference) else None for value in values]
    if len(identities) != 1 or None in identities or ranks != list(range(dp_size)):
        raise ValueError(
            "Data-parallel ranks received inconsistent batch identities "
            f"(batch id, plan digest per rank: {sorted(map(str, identities))}, ranks {ranks}); "
            "all ranks must load shares of one durable batch plan"
        )


def process_rollout_data(rollout_data_refs: list, dp_rank: int, dp_size: int) -> dict:
    """This rank's rollout data as a dict; `total_lengths`/`raw_reward` are localised to its partition.

    The global columns stay available as `global_total_lengths` and `raw_reward`.
    """
    if len(rollout_data_refs) != dp_size:
        raise ValueError(f"Expected {dp_size} rollout data references (one per rank), got {len(rollout_data_refs)}")
    value = ray.get(rollout_data_refs[dp_rank].inner)
    if isinstance(value, ShardReference):
        _check_batch_identities(rollout_data_refs, dp_size)
        value = value.load()
    elif isinstance(value, DiskPayloadRef):
        value = unpack_rollout_payload(value)
    partition = value["partition"]
    global_lengths = value["total_lengths"]
    value["global_total_lengths"] = global_lengths
    value["total_lengths"] = [global_lengths[i] for i in partition]
    if value.get("raw_reward") is not None:
        value["local_raw_reward"] = [value["raw_reward"][i] for i in partition]
    return value
