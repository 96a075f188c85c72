"""Read back what an offline wandb run wrote: the history rows in its `run-<id>.wandb` files.

wandb (0.19 and later) has no public reader for these files. They are a LevelDB-style log (a 7-byte header, then
32 KiB blocks of records, each `crc32 (4) | length (2) | type (1) | data`, a record split across blocks as
FIRST/MIDDLE/LAST) of `wandb.proto.wandb_internal_pb2.Record` messages. Used by the tests and to check a run's
offline files before `wandb sync`; a torn last record (a killed run) ends the read.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HEADER_BYTES = 7
BLOCK_BYTES = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[bytes]:
    """The serialized records of one `.wandb` file, in order."""
    data = Path(path).read_bytes()
    position, pending = HEADER_BYTES, b""
    while position + 7 <= len(data):
        left = BLOCK_BYTES - position % BLOCK_BYTES
        if left < 7:  # the block's zero padding
            position += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        if kind == 0 or len(chunk) < length:  # padding or a torn tail
            break
        position += 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk


def offline_run_files(wandb_dir: Path, run_id: str) -> list[Path]:
    """The `.wandb` files of every offline segment of run `run_id` under `--wandb-dir`, oldest first."""
    return sorted(Path(wandb_dir).glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))


def history(wandb_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """Every history row of run `run_id`'s offline segments, oldest first, as `{key: value}` (with `_step`)."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in offline_run_files(wandb_dir, run_id):
        for raw in records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") != "history":
                continue
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


def config(wandb_dir: Path, run_id: str) -> dict[str, Any]:
    """Run `run_id`'s configuration as its offline segments recorded it (the latest value of each key)."""
    from wandb.proto import wandb_internal_pb2

    found: dict[str, Any] = {}
    for path in offline_run_files(wandb_dir, run_id):
        for raw in records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
            for item in updates:
                found[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return found
