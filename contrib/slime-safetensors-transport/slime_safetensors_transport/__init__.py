"""slime-safetensors-transport: a third-party rollout data transport for slime-rl, built on its `Transport` interface.

`slime-run --rollout-data-transport safetensors` writes every training batch's per-rank shards as safetensors
files (tensors) plus a JSON index (the other columns and the rank's schedule) under `--safetensors-transport-dir`
(default `<--save>/safetensors_batches`); trainers load their own shard from the file a small reference names.
Rollout groups stay in the rollout manager's memory. Installed, it loads automatically (entry point
`safetensors_transport` of group `slime`).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from slime import hookimpl
from slime.specs import TransportSpec
from slime_safetensors_transport.shards import SafetensorsShard
from slime_safetensors_transport.transport import SafetensorsTransport, batch_directory

__all__ = ["SafetensorsShard", "SafetensorsTransport", "batch_directory"]


@hookimpl
def slime_addoption(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("slime-safetensors-transport plugin")
    group.add_argument(
        "--safetensors-transport-dir",
        default=None,
        help="directory every node mounts for the safetensors transport's training shards "
        "(default: <--save>/safetensors_batches)",
    )


@hookimpl
def slime_transports() -> Iterable[TransportSpec]:
    return [
        TransportSpec(
            "safetensors",
            SafetensorsTransport,
            "Training shards as safetensors files on a shared directory (durable, no queue); groups in memory",
            checkpoint_policy="plain",
            data_source="prompts",
        )
    ]
