"""Durable rollout queue: the controller that owns a run's straw queue, and the data sources reading from it.

Public facade. Tests and callers patch names on this module (`write_report`, `Coordinator`,
`create_queue_controller`), and the implementation modules look them up here at call time:
`slime.data.queue_controller` (the controller) and `slime.data.queue_reader` (readers and the source).
"""

from __future__ import annotations

import copy
from typing import Any

import ray
from straw.coordinator import Coordinator
from straw.reporting import write_report

from slime.data.checkpoint import RestorePlan
from slime.data.queue_controller import RolloutQueueController
from slime.data.queue_reader import QueueDataSource, QueueReader, QueueReaderConfig
from slime.data.transport import resolve_rollout_data_dir

__all__ = [
    "Coordinator",
    "QueueDataSource",
    "QueueReader",
    "QueueReaderConfig",
    "RolloutQueueController",
    "create_queue_controller",
    "write_report",
]


def create_queue_controller(args: Any, *, restore_plan: RestorePlan | None = None) -> Any:
    """Start the controller as a Ray actor pinned to this node (it holds a node-local flock)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    resolve_rollout_data_dir(args)
    node_id = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(RolloutQueueController)
        .options(
            num_cpus=0,
            max_concurrency=4,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(copy.copy(args), restore_plan=restore_plan)
    )
