"""The straw transport: every rollout group, batch and tensor is durable on shared storage first.

Payloads are published through straw-queue to a pool directory every node mounts
(`--rollout-data-dir`); only small frozen references travel through Ray. A durable queue records what
was generated, accepted and trained, and checkpoints are joint commits of model, critic, queue and
batch-builder state. Naming this plugin (`slime-run --plugin straw`) makes straw the default transport.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from slime import hookimpl
from slime.specs import DataSourceSpec, TransportSpec


@hookimpl
def slime_transports() -> Iterable[TransportSpec]:
    return [
        TransportSpec(
            "straw",
            None,
            "Durable straw-queue pool on a shared filesystem; survives crashes, resumable, replayable",
            durable=True,
            checkpoint_policy="joint",
            data_source="queue",
        )
    ]


@hookimpl
def slime_data_sources() -> Iterable[DataSourceSpec]:
    from slime.data.queue_data_source import QueueDataSource

    return [
        DataSourceSpec(
            "queue",
            QueueDataSource,
            "Prompts as durable queue tasks with leases; its cursor and pending work are part of joint checkpoints",
        )
    ]


@hookimpl
def slime_cli_defaults() -> dict[str, Any]:
    return {"rollout_data_transport": "straw"}
