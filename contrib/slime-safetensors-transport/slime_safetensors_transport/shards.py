"""One training rank's shard on disk: a safetensors file (every tensor) and a JSON index (everything else).

Layout under the transport's directory: `<batch_id>/rank_<r>.safetensors` and `<batch_id>/rank_<r>.json`.
The JSON holds the shard's columns with each tensor replaced by `{"tensor": KEY}` (its key in the safetensors
file), tuples as `{"tuple": [...]}` and dicts as `{"dict": {...}}`, so that every JSON object is a tag and
lists, strings, numbers, booleans and None stay themselves; plus the batch identity and the SHA-256 of the
tensors file. Each file is written to a temporary name, fsynced, renamed into place and its directory fsynced
(durable before visible); the JSON comes last, so a visible index always names a complete tensors file.
Directories the transport creates are owner-only (0o700).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from slime.interfaces import ShardReference
from slime.utils.atomic_files import fsync_path, write_atomically

FORMAT = "slime-safetensors-shard"
VERSION = 1


def make_private_dirs(path: Path) -> Path:
    """Create `path` and its missing parents owner-only (0o700), each entry durable in its parent; existing
    directories are left as they are."""
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue
        fsync_path(directory.parent)
    return path


def write_durably(path: Path, data: bytes) -> None:
    """Write `data` to `path` durably before it becomes visible (temporary name, fsync, rename, directory fsync)."""
    write_atomically(path, lambda handle: handle.write(data))


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """`value` as JSON with its tensors moved to `tensors` (see the module docstring)."""
    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        tensor = value.detach().cpu().contiguous()
        # A view would save its whole storage; a tensor seen twice is written twice (no aliasing on disk).
        is_view = tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()
        tensors[key] = tensor.clone() if is_view else tensor
        return {"tensor": key}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode(item, tensors, f"{where}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, tuple):
        return {"tuple": [_encode(item, tensors, f"{where}[{index}]") for index, item in enumerate(value)]}
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {"dict": {key: _encode(item, tensors, f"{where}[{key!r}]") for key, item in value.items()}}
    raise TypeError(
        f"safetensors transport cannot store {where} of type {type(value).__name__} "
        "(shards hold tensors, lists, tuples, dicts with string keys, strings, numbers, booleans and None)"
    )


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(item, tensors) for item in value]
    if isinstance(value, dict):
        (tag, content), *_ = value.items()
        if tag == "tensor":
            return tensors[content]
        if tag == "tuple":
            return tuple(_decode(item, tensors) for item in content)
        return {key: _decode(item, tensors) for key, item in content.items()}
    return value


@dataclass(frozen=True)
class SafetensorsShard(ShardReference):
    """One rank's shard: the JSON index at `path` and the batch identity every rank of the step shares."""

    path: str
    batch_id: str
    plan_digest: str
    rank: int

    def load(self) -> dict:
        """Read the shard (in the trainer's process), checking its identity and the tensors file's digest."""
        index_path = Path(self.path)
        index = json.loads(index_path.read_text())
        identity = (index.get("format"), index.get("version"), index.get("batch_id"), index.get("plan_digest"))
        if identity != (FORMAT, VERSION, self.batch_id, self.plan_digest) or index.get("rank") != self.rank:
            raise ValueError(
                f"{index_path} is not rank {self.rank} of batch {self.batch_id} (plan {self.plan_digest}): "
                f"it names rank {index.get('rank')} of batch {index.get('batch_id')} (plan {index.get('plan_digest')})"
            )
        tensors_path = index_path.with_name(index["tensors"])
        data = tensors_path.read_bytes()
        if hashlib.sha256(data).hexdigest() != index["tensors_sha256"]:
            raise ValueError(f"{tensors_path} is corrupt: its SHA-256 differs from the one recorded in {index_path}")
        return _decode(index["columns"], load_tensors(data))


def write_shard(directory: Path, batch_id: str, plan_digest: str, rank: int, shard: dict) -> SafetensorsShard:
    """Write one rank's shard dict under `directory` (durably, tensors first) and return its reference."""
    tensors: dict[str, torch.Tensor] = {}
    columns = {key: _encode(value, tensors, f"column {key!r}") for key, value in shard.items()}
    data = save_tensors(tensors)
    tensors_path = directory / f"rank_{rank}.safetensors"
    write_durably(tensors_path, data)
    index = {
        "format": FORMAT,
        "version": VERSION,
        "batch_id": batch_id,
        "plan_digest": plan_digest,
        "rank": rank,
        "tensors": tensors_path.name,
        "tensors_sha256": hashlib.sha256(data).hexdigest(),
        "columns": {"dict": columns},
    }
    index_path = directory / f"rank_{rank}.json"
    write_durably(index_path, json.dumps(index).encode())
    return SafetensorsShard(str(index_path), batch_id, plan_digest, rank)
