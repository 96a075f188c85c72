"""`RolloutArchive`: immutable debug archives of rollout batches over durable straw records.

An archive is a small index file (`*.straw.json`) naming one `slime.v1` publication (the *contents*) in a
straw pool. The contents list, per Sample in archive order, a sample key, a task key and where the Sample
lives, in one of two modes:

- chunk mode: `{"chunks": [DiskPayloadRef, ...], "entries": [{"sample_key", "task_key", "chunk", "offset"}]}`;
  the Samples were published in chunks of at most `CHUNK_SIZE`, so one Sample is read by decoding one chunk;
- reference mode: `{"raw": DiskPayloadRef, "entries": [{"sample_key", "task_key", "offset"}]}`; the archive
  points at a rollout batch that already lives in the pool and copies nothing.

When the run itself uses a durable transport, the archive is written into the run's pool through the
run's writer, so tensors already stored there are referenced by dependency and never copied; otherwise
a standalone pool `straw-data/` beside the index holds the data. An archive keeps its records alive with
its own storage owner (named in the index) until `release()`; the index file is written only after that
ownership is durable, and is never overwritten.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import tempfile
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slime.data import queue_state
from slime.data.queue_state import QueueState
from slime.data.refs import DiskPayloadRef
from slime.rollout.base_types import iter_samples
from slime.utils.atomic_files import fsync_path
from slime.utils.types import Sample

ARCHIVE_FORMAT = "slime.straw-debug"
ARCHIVE_VERSION = 1
#: Samples per chunk publication in chunk mode.
CHUNK_SIZE = 64
#: Chunks prepared into one storage bundle (bounds the memory of one publication call).
CHUNKS_PER_BUNDLE = 16
#: Pool and run of archives written without a durable run transport.
STANDALONE_DIRECTORY = "straw-data"
STANDALONE_RUN_ID = "debug-rollout"


def sample_keys(samples: Iterable[Sample]) -> list[tuple[str, str | None]]:
    """`(sample_key, task_key)` per Sample: `sample:<index>` (or `position:<ordinal>`) and its queue task id."""
    keys = []
    for ordinal, sample in enumerate(samples):
        sample_key = f"sample:{sample.index}" if sample.index is not None else f"position:{ordinal}"
        keys.append((sample_key, _task_key(sample)))
    return keys


def _task_key(sample: Sample) -> str | None:
    return QueueState.of(sample).task_id


def _detach(sample: Sample) -> Sample:
    """A shallow copy without live queue authorization (tensor fields stay lazy references)."""
    sample = copy.copy(sample)
    queue_state.clear_live(sample)
    return sample


def _open_store(root: str, run_id: str, *, online_gc: bool = False) -> Any:
    from straw.store import SharedFilesystemStore
    from straw.tensor import MAX_PUBLICATION_BYTES, MAX_TENSOR_BYTES

    from slime.data.codec import CODECS

    return SharedFilesystemStore(
        root,
        run_id,
        codecs=CODECS,
        max_record_bytes=MAX_TENSOR_BYTES,
        max_buffer_bytes=MAX_PUBLICATION_BYTES,
        online_gc=online_gc,
    )


class RolloutArchive:
    """Read side of an archive: `keys()`, `load_samples(...)`, `export_pt(...)`, `release()`.

    Opening reads and validates the index and decodes the small contents record only; Samples are read on
    demand, one chunk publication at a time. `root` reads the pool from another mount point.
    """

    def __init__(self, path: str | os.PathLike, *, root: str | None = None) -> None:
        from straw.errors import QueueError
        from straw.protocol import RecordSetRef

        from slime.data.codec import SampleCodec

        self.path = Path(path).expanduser()
        self.index = _read_index(self.path)
        try:
            self.manifest = RecordSetRef.from_dict(self.index["manifest"])
            run_id = self.manifest.manifest.segment.run_id
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"Unsupported straw rollout archive: {self.path} (invalid manifest: {exc})") from exc
        pool = Path(root or self.index["root"]).expanduser()
        if not (pool / "control").is_dir():
            raise FileNotFoundError(
                f"The straw pool {pool} of rollout archive {self.path} is not mounted here (no {pool / 'control'}); "
                f"mount it or open the archive with root=<its mount point>"
            )
        self.store = _open_store(str(pool), run_id)
        try:
            self.codec = SampleCodec(self.store)
            try:
                self.contents = self.codec.load(self.manifest)
            except QueueError as exc:
                missing = _missing_packs(self.store, self.manifest)
                detail = f"; missing packs: {', '.join(missing)}" if missing else ""
                raise ValueError(
                    f"Cannot read the contents of rollout archive {self.path} from the pool {pool}: "
                    f"{type(exc).__name__}: {exc}{detail} (was the archive released and garbage-collected?)"
                ) from exc
            self._entries = _validate_contents(self.path, self.contents)
        except BaseException:
            self.store.close()
            raise

    def __enter__(self) -> RolloutArchive:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the reader (the archive's records stay retained; see `release`)."""
        self.store.close()

    @property
    def rollout_id(self) -> int | str:
        return self.index["rollout_id"]

    @property
    def mode(self) -> str:
        """`"chunks"` (Samples published for the archive) or `"reference"` (an existing batch in the pool)."""
        return "chunks" if "chunks" in self.contents else "reference"

    def sample_refs(self) -> list[DiskPayloadRef]:
        """The publications holding the archived Samples (chunks, or the referenced batch), for replay."""
        return list(self.contents["chunks"]) if self.mode == "chunks" else [self.contents["raw"]]

    def keys(self) -> list[tuple[str, str | None]]:
        """`(sample_key, task_key)` per Sample, in archive order; keys may repeat."""
        return [(entry["sample_key"], entry["task_key"]) for entry in self._entries]

    def load_samples(self, *, sample_key: str | None = None, task_key: str | None = None) -> list[Sample]:
        """The archived Samples matching every given key, in archive order, without live queue fields.

        Each needed chunk is decoded once; other chunks are not read. A filter matching nothing is a KeyError.
        """
        selected = [
            entry
            for entry in self._entries
            if (sample_key is None or entry["sample_key"] == sample_key)
            and (task_key is None or entry["task_key"] == task_key)
        ]
        if not selected and (sample_key is not None or task_key is not None):
            raise KeyError((sample_key, task_key))
        if self.mode == "reference":
            values = {None: self._read("the referenced batch", _load_batch, self.contents["raw"])}
        else:
            chunks = self.contents["chunks"]
            needed = sorted({entry["chunk"] for entry in selected})
            values = {index: self._read(f"chunk {index}", self.codec.load, chunks[index].manifest) for index in needed}
        samples = []
        for entry in selected:
            value = values[entry.get("chunk")]
            offset = entry["offset"]
            if not isinstance(value, list) or offset >= len(value) or not isinstance(value[offset], Sample):
                where = "the referenced batch" if self.mode == "reference" else f"chunk {entry['chunk']}"
                raise ValueError(
                    f"Rollout archive {self.path} is corrupt: {where} has no Sample at offset {offset} "
                    f"(entry {entry['sample_key']})"
                )
            samples.append(_detach(value[offset]))
        return samples

    def _read(self, what: str, load: Any, ref: Any) -> Any:
        """`load(ref)`; storage failures name the archive, the part and the pool."""
        from straw.errors import QueueError

        try:
            return load(ref)
        except (QueueError, FileNotFoundError) as exc:
            raise ValueError(
                f"Rollout archive {self.path}: cannot read {what} from the pool {self.store.backend.root}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def export_pt(self, path: str | os.PathLike) -> Path:
        """Write a self-contained legacy `.pt` dump (tensors materialized), atomically; returns its path."""
        import torch

        from slime.data.tensor import materialize_tensor_refs

        path = Path(path).expanduser()
        dump = materialize_tensor_refs(
            {"rollout_id": self.rollout_id, "samples": [sample.to_dict() for sample in self.load_samples()]}
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        try:
            with os.fdopen(descriptor, "wb") as stream:
                torch.save(dump, stream)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(partial, path)
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise
        fsync_path(path.parent)
        return path

    def release(self) -> None:
        """Drop the archive's storage owner so GC may reclaim its records; the index file remains."""
        self.store.release(self.index["storage_owner"])

    @classmethod
    def save(
        cls,
        path: str | os.PathLike,
        samples: Iterable[Sample],
        *,
        rollout_id: int | str,
        evaluation: bool = False,
        args: Any = None,
        reference: DiskPayloadRef | None = None,
    ) -> Path:
        """Archive `samples` at `path` (which must not exist); returns the index path.

        With `reference`, the archive points at that already-published batch (it must hold exactly these
        Samples, in order, and live in the run's pool); otherwise the Samples are published in chunks.
        """
        path = Path(path).expanduser()
        samples = list(samples)
        if not all(isinstance(sample, Sample) for sample in samples):
            raise TypeError(
                f"Rollout archive {path}: expected Samples, got {sorted({type(s).__name__ for s in samples})}"
            )
        if path.exists():
            raise FileExistsError(f"Rollout archives are immutable; choose a new path: {path}")
        shared = args is not None and bool(getattr(args, "rollout_data_dir", None))
        if reference is not None and not isinstance(reference, DiskPayloadRef):
            raise TypeError(f"An archive reference must be a DiskPayloadRef, got {type(reference).__name__}")
        if shared:
            from slime.data.transport import rollout_store

            store, codec, lock = rollout_store(args)
            owned = False
        elif reference is not None:
            raise ValueError(
                f"An archive reference must belong to its storage pool: {path} has no run pool "
                f"(pass the run's args with a durable rollout transport)"
            )
        else:
            from slime.data.codec import SampleCodec

            path.parent.mkdir(parents=True, exist_ok=True)
            store = _open_store(str(path.parent / STANDALONE_DIRECTORY), STANDALONE_RUN_ID, online_gc=True)
            codec, lock, owned = SampleCodec(store, args=args), threading.RLock(), True
        try:
            if reference is not None:
                _check_reference(store, reference, path)
            with lock:
                return _write_archive(path, store, codec, samples, rollout_id, evaluation, reference)
        finally:
            if owned:
                store.close()


def _read_index(path: Path) -> dict:
    try:
        index = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise ValueError(f"Unsupported straw rollout archive: {path} ({exc})") from exc
    if not isinstance(index, dict) or index.get("format") != ARCHIVE_FORMAT or index.get("version") != ARCHIVE_VERSION:
        found = (index.get("format"), index.get("version")) if isinstance(index, dict) else type(index).__name__
        raise ValueError(
            f"Unsupported straw rollout archive: {path} (expected format {ARCHIVE_FORMAT!r} version "
            f"{ARCHIVE_VERSION}, found {found})"
        )
    missing = [key for key in ("rollout_id", "root", "manifest", "storage_owner") if key not in index]
    if missing:
        raise ValueError(f"Unsupported straw rollout archive: {path} (missing {', '.join(missing)})")
    return index


def _validate_contents(path: Path, contents: Any) -> list[dict]:
    """The contents' entries, after checking the record has the shape `_write_archive` gives it."""
    if not isinstance(contents, dict) or not isinstance(contents.get("entries"), list):
        raise ValueError(f"Rollout archive {path} is corrupt: its contents record has no entry list")
    entries = contents["entries"]
    for entry in entries:
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("offset"), int)
            or entry["offset"] < 0
            or not isinstance(entry.get("sample_key"), str)
            or "task_key" not in entry
        ):
            raise ValueError(f"Rollout archive {path} is corrupt: malformed entry {entry!r}")
    if "chunks" in contents:
        chunks = contents["chunks"]
        if not isinstance(chunks, list) or not all(isinstance(chunk, DiskPayloadRef) for chunk in chunks):
            raise ValueError(f"Rollout archive {path} is corrupt: its chunk list holds non-references")
        for entry in entries:
            if not isinstance(entry.get("chunk"), int) or not 0 <= entry["chunk"] < len(chunks):
                raise ValueError(
                    f"Rollout archive {path} is corrupt: entry {entry['sample_key']} names missing chunk "
                    f"{entry.get('chunk')} (the archive has {len(chunks)})"
                )
    elif not isinstance(contents.get("raw"), DiskPayloadRef):
        raise ValueError(f"Rollout archive {path} is corrupt: its contents hold neither chunks nor a batch reference")
    return entries


def _missing_packs(store: Any, manifest: Any) -> list[str]:
    """Pack files (relative to the pool) that the archive's contents or its direct dependencies need but lack."""
    from straw.errors import QueueError
    from straw.protocol import RecordSetRef

    paths = [manifest.manifest.segment.path]
    try:
        dependencies = store.manifest(manifest)["dependencies"]
        paths += [RecordSetRef.from_dict(dependency).manifest.segment.path for dependency in dependencies]
    except QueueError:
        pass  # the contents' own pack is unreadable; it is listed below if it is gone
    root = store.backend.root
    return sorted({path for path in paths if not (root / path).exists()})


def _load_batch(reference: DiskPayloadRef) -> list[Sample]:
    from slime.data.transport import load_rollout_samples

    return list(iter_samples(load_rollout_samples(reference)))


def _check_reference(store: Any, reference: DiskPayloadRef, path: Path) -> None:
    root = Path(reference.root).expanduser().resolve()
    run_id = reference.manifest.manifest.segment.run_id
    if root != store.backend.root or run_id != store.run_id:
        raise ValueError(
            f"An archive reference must belong to its storage pool: {path} would be written to run "
            f"{store.run_id!r} at {store.backend.root}, the reference is run {run_id!r} at {root}"
        )
    from straw.errors import QueueError

    try:
        store.validate(reference.manifest)
    except QueueError as exc:
        raise ValueError(
            f"Rollout archive {path}: the referenced batch is not readable in the pool {root}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _write_archive(
    path: Path,
    store: Any,
    codec: Any,
    samples: list[Sample],
    rollout_id: int | str,
    evaluation: bool,
    reference: DiskPayloadRef | None,
) -> Path:
    """Publish chunks and contents, retain them under the archive's owner, then write the index."""
    from straw.protocol import digest
    from straw.reporting import write_report

    root = str(store.backend.root)
    keys = sample_keys(samples)
    published = []
    owner = None
    try:
        if reference is not None:
            entries = [{"sample_key": s, "task_key": t, "offset": i} for i, (s, t) in enumerate(keys)]
            contents: dict = {"raw": reference, "entries": entries}
        else:
            chunks = [samples[start : start + CHUNK_SIZE] for start in range(0, len(samples), CHUNK_SIZE)]
            manifests = []
            for start in range(0, len(chunks), CHUNKS_PER_BUNDLE):
                bundle = chunks[start : start + CHUNKS_PER_BUNDLE]
                ids = [f"debug-chunk:{uuid.uuid4().hex}" for _ in bundle]
                refs = codec.publish_many(bundle, submission_ids=ids)
                published.extend(refs)
                manifests.extend(refs)
            entries = [
                {"sample_key": s, "task_key": t, "chunk": i // CHUNK_SIZE, "offset": i % CHUNK_SIZE}
                for i, (s, t) in enumerate(keys)
            ]
            contents = {"chunks": [DiskPayloadRef(ref, root) for ref in manifests], "entries": entries}
        manifest = codec.publish(contents, submission_id=f"debug-index:{uuid.uuid4().hex}")
        published.append(manifest)
        owner = f"debug:{path.resolve()}:{digest(dataclasses.asdict(manifest))}"
        store.retain(owner, [manifest])
        store.release_publications([manifest])
        published = []
        if path.exists():
            raise FileExistsError(f"Rollout archives are immutable; choose a new path: {path}")
        index = {
            "format": ARCHIVE_FORMAT,
            "version": ARCHIVE_VERSION,
            "rollout_id": f"eval_{rollout_id}" if evaluation else rollout_id,
            "evaluation": bool(evaluation),
            "root": root,
            "manifest": dataclasses.asdict(manifest),
            "storage_owner": owner,
        }
        write_report(path, index)
    except BaseException:
        if owner is not None:
            store.release(owner)
        if published:
            store.release_publications(published)
        raise
    return path
