"""Small frozen references to durable rollout payloads; they travel through Ray instead of the payloads.

A reference names a straw manifest and the pool root it lives in. `load()` reads through the process's
reader on that root (no writer, no environment variables), so any process that mounts the pool can read it,
even while the writer is still appending to the pack. All names here are re-exported by `slime.data.transport`.
"""

from __future__ import annotations

import copy
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slime.interfaces import ShardReference

if TYPE_CHECKING:
    from straw.protocol import CommitReceipt, RecordSetRef

#: Read-only stores by (process id, pool root, run id); see `DiskPayloadRef.reader_store`.
_readers: dict[tuple[int, str, str], Any] = {}
_readers_lock = threading.Lock()


@dataclass(frozen=True)
class DiskPayloadRef:
    """A published value: `manifest` in the pool at `root`; `path` and `sample_metadata` refine the result."""

    manifest: RecordSetRef
    root: str
    path: tuple = field(default=(), kw_only=True)
    sample_metadata: list[dict] | None = field(default=None, kw_only=True)

    def reader_store(self, root: str | None = None) -> Any:
        """This process's read-only store on `root` (default: the reference's own) for the manifest's run.

        One store per process, pool root and run, kept open: a reader sees records and packs its writer adds
        later, and closing a store is not free (straw fsyncs and leaves a writer control directory behind
        each time), which per-load stores paid on every group, batch and shard read.
        """
        from straw.store import SharedFilesystemStore
        from straw.tensor import MAX_PUBLICATION_BYTES, MAX_TENSOR_BYTES

        from slime.data.codec import CODECS

        root = root or self.root
        run_id = self.manifest.manifest.segment.run_id
        key = (os.getpid(), root, run_id)
        with _readers_lock:
            store = _readers.get(key)
            if store is None:
                store = _readers[key] = SharedFilesystemStore(
                    root,
                    run_id,
                    codecs=CODECS,
                    max_record_bytes=MAX_TENSOR_BYTES,
                    max_buffer_bytes=MAX_PUBLICATION_BYTES,
                )
        return store

    def load(self, *, root: str | None = None, selection: dict | None = None) -> Any:
        """Decode the payload (optionally from another mount point `root` of the same pool)."""
        from slime.data.codec import SampleCodec

        value = SampleCodec(self.reader_store(root)).load(self.manifest, selection=selection)
        for step in self.path:
            value = value[step] if isinstance(step, int) else getattr(value, step)
        if self.sample_metadata is not None:
            value = _apply_sample_metadata(value, self.sample_metadata)
        return value


def _apply_sample_metadata(value: Any, updates: list[dict]) -> Any:
    from slime.utils.types import Sample

    single = isinstance(value, Sample)
    samples = [value] if single else list(value)
    if len(samples) != len(updates):
        raise ValueError(f"Reference carries metadata for {len(updates)} samples but its payload has {len(samples)}")
    result = []
    for sample, update in zip(samples, updates, strict=True):
        sample = copy.copy(sample)
        update = dict(update)
        if "metadata" in update:
            sample.metadata = {**(sample.metadata or {}), **update.pop("metadata")}
        sample.__dict__.update(update)
        result.append(sample)
    return result[0] if single else result


@dataclass(frozen=True)
class RolloutGroupRef(DiskPayloadRef):
    """One finished rollout group; `receipt` is set when the group completed a queue task."""

    index: int
    receipt: CommitReceipt | None = None
    source_positions: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RawRolloutRef(DiskPayloadRef):
    """A rollout step's accepted collection: the queue's receipt and the rollout metrics."""

    receipt: CommitReceipt
    metrics: dict | None = None


@dataclass(frozen=True)
class TrainBatchRef(DiskPayloadRef):
    """One data-parallel rank's share of a converted training batch (a column selection plus its schedule)."""

    batch_id: str
    rank: int
    plan_digest: str
    selection: dict | None = field(default=None, kw_only=True)
    schedule: dict | None = field(default=None, kw_only=True)

    def load(self, *, root: str | None = None) -> Any:  # type: ignore[override]
        value = super().load(root=root, selection=self.selection)
        if self.schedule:
            value.update(self.schedule)
        return value


# Trainers load a TrainBatchRef like any transport's shard reference (`slime.utils.data.process_rollout_data`).
ShardReference.register(TrainBatchRef)

#: Reference classes the codec may store, by class name.
REF_CLASSES = {cls.__name__: cls for cls in (DiskPayloadRef, RolloutGroupRef, RawRolloutRef, TrainBatchRef)}
