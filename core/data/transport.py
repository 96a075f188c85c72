"""The rollout data transport facade: publish rollout payloads durably, hand out small references.

These are the straw transport's operations (`slime.transports.straw` adapts them to the `Transport`
interface): payloads go to a shared pool through one cached writer per process and only frozen references
(`slime.data.refs`) travel through Ray. Orchestration never calls them directly; it asks the run's
transport. Names that tests patch (`pack_rollout_group`, `ray`, ...) are looked up through this module at
call time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import json
import logging
import os
import string
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import ray

from slime.data import queue_state
from slime.data.queue_state import QueueState
from slime.data.refs import DiskPayloadRef, RawRolloutRef, RolloutGroupRef, TrainBatchRef
from slime.data.straw_settings import StrawSettings
from slime.errors import UsageError
from slime.rollout.base_types import iter_samples

logger = logging.getLogger(__name__)

#: Seconds one node's storage probe may take (`check_rollout_storage`).
STORAGE_PROBE_TIMEOUT_S = 60.0

__all__ = [
    "DiskPayloadRef",
    "RawRolloutRef",
    "RolloutGroupRef",
    "TrainBatchRef",
    "accept_raw_rollout",
    "check_rollout_storage",
    "discard_rollout_group",
    "group_lease",
    "inherit_queue_context",
    "load_rollout_samples",
    "pack_rollout_group",
    "pack_rollout_payload",
    "publish_rollout_async",
    "record_generation_provenance",
    "release_payload_publications",
    "release_rollout_publications",
    "resolve_rollout_data_dir",
    "rollout_store",
    "run_rollout_io",
    "seal_rollout_store",
    "unpack_published_payload",
    "unpack_rollout_payload",
]

ARCHIVE_FORMAT = "slime.straw-debug"
_RELEASE_BATCH = 128

_writers: dict[tuple, tuple[Any, threading.RLock]] = {}
_writers_lock = threading.Lock()
_io_semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _require_straw() -> None:
    try:
        import straw  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "straw":
            raise
        raise ModuleNotFoundError("Install straw with: pip install straw-queue", name="straw") from exc


# --------------------------------------------------------------------------------------------- pool and writer


def _archive_index_path(template: str, start_rollout_id: int | None) -> Path:
    if start_rollout_id is not None:
        return Path(template.format(rollout_id=start_rollout_id)).expanduser()
    pattern = "".join(
        glob.escape(literal) + ("*" if field is not None else "")
        for literal, field, _, _ in string.Formatter().parse(template)
    )
    matches = sorted(glob.glob(os.path.expanduser(pattern)))
    if not matches:
        raise FileNotFoundError(f"No Straw rollout archive matches {template}")
    return Path(matches[0])


def resolve_rollout_data_dir(args: Any) -> None:
    """Set `args.rollout_data_dir` to the absolute pool directory (and bind pool/run from a debug archive).

    Order: a `.straw.json` archive given by `--load-debug-rollout-data` names its own pool and run;
    otherwise `--rollout-data-dir`; otherwise `<--save>/rollout_data`. There is no silent local default:
    every node must see the same directory.
    """
    template = getattr(args, "load_debug_rollout_data", None)
    if isinstance(template, str) and template.endswith(".straw.json"):
        path = _archive_index_path(template, getattr(args, "start_rollout_id", None))
        try:
            index = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise ValueError(f"Unsupported straw rollout archive: {path} ({exc})") from exc
        if not isinstance(index, dict) or index.get("format") != ARCHIVE_FORMAT or index.get("version") != 1:
            raise ValueError(f"Unsupported straw rollout archive: {path}")
        try:
            args.rollout_data_dir = index["root"]
            args.rollout_queue_run_id = index["manifest"]["manifest"]["segment"]["run_id"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"Unsupported straw rollout archive: {path} (missing {exc})") from exc
    if getattr(args, "rollout_data_dir", None) is None:
        if getattr(args, "save", None) is None:
            raise ValueError(
                "Straw rollout transport requires --rollout-data-dir or --save on shared storage "
                "(a directory every rollout and training node mounts)"
            )
        args.rollout_data_dir = str(Path(args.save) / "rollout_data")
    args.rollout_data_dir = str(Path(args.rollout_data_dir).expanduser().resolve())


def _pool_root(args: Any) -> str:
    root = getattr(args, "rollout_data_dir", None)
    if root is None:
        save = getattr(args, "save", None)
        if save is None:
            raise ValueError("Straw rollout transport requires --rollout-data-dir or --save on shared storage")
        root = str(Path(save) / "rollout_data")
    return str(Path(root).expanduser().resolve())


def _declaration(settings: StrawSettings) -> dict:
    source = settings.storage_declaration
    if not source:
        return {}
    try:
        value = json.loads(Path(source).expanduser().read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"Cannot read --rollout-storage-declaration {source}: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"--rollout-storage-declaration {source} must hold a JSON object")
    return value


def rollout_store(args: Any) -> tuple[Any, Any, threading.RLock]:
    """The process's cached writer for the run's pool, a fresh `SampleCodec` bound to `args`, and the writer lock."""
    _require_straw()
    from straw.backend import FilesystemBackend
    from straw.store import SharedFilesystemStore
    from straw.tensor import MAX_PUBLICATION_BYTES, MAX_TENSOR_BYTES

    from slime.data.codec import CODECS, SampleCodec

    settings = StrawSettings.from_args(args)
    root = _pool_root(args)
    run_id, profile, segment_mib, online_gc = (
        settings.run_id,
        settings.storage_profile,
        settings.segment_mib,
        settings.online_gc,
    )
    declaration = _declaration(settings)
    key = (os.getpid(), root, run_id, profile, segment_mib, online_gc, json.dumps(declaration, sort_keys=True))
    with _writers_lock:
        cached = _writers.get(key)
        if cached is None:
            options = {} if segment_mib is None else {"segment_target_bytes": int(segment_mib * 1024**2)}
            store = SharedFilesystemStore(
                root,
                run_id,
                online_gc=online_gc,
                codecs=CODECS,
                max_record_bytes=MAX_TENSOR_BYTES,
                max_buffer_bytes=MAX_PUBLICATION_BYTES,
                backend=FilesystemBackend(root, profile=profile, declaration=declaration),
                **options,
            )
            cached = _writers[key] = (store, threading.RLock())
    store, lock = cached
    return store, SampleCodec(store, args=args), lock


def seal_rollout_store(args: Any) -> None:
    """Seal the current pack of the run's writer (it stays open for later publications)."""
    store, _, lock = rollout_store(args)
    with lock:
        store.seal()


# --------------------------------------------------------------------------------------------- publishing


def pack_rollout_payload(
    value: Any, args: Any, rollout_id: Any, *, metadata: dict | None = None, submission_id: str | None = None
) -> Any:
    """Publish `value` durably and return a `DiskPayloadRef`.

    A reference that already names a manifest is validated and returned as is (nothing is rewritten).
    """
    store, codec, lock = rollout_store(args)
    if isinstance(value, DiskPayloadRef) and value.root:
        store.validate(value.manifest)
        return value
    with lock:
        ref = codec.publish(
            value, submission_id=submission_id or f"payload:{rollout_id}:{uuid.uuid4().hex}", metadata=metadata
        )
    return DiskPayloadRef(ref, str(store.backend.root))


def group_lease(group: Any) -> Any:
    """The one queue lease (`straw.protocol.Lease`) that all trajectories of `group` carry, or None."""
    leases = [lease for sample in iter_samples(group) if (lease := QueueState.of(sample).lease)]
    if not leases:
        return None
    if any(lease != leases[0] for lease in leases[1:]):
        raise ValueError("A queue group must preserve one task authorization across all trajectories")
    from straw.protocol import Lease

    return Lease(**leases[0])


def record_generation_provenance(group: Any) -> None:
    """Append a policy segment for tokens generated since the last record, for samples on a queue branch."""
    for sample in iter_samples(group):
        state = QueueState.of(sample)
        start, branch = state.generation_start, state.branch
        if start is None or branch is None:
            continue
        stop = len(sample.tokens)
        if stop <= start:
            continue
        segments = list(state.policy_segments or [])
        if not segments and start > 0:
            segments.append({"start": 0, "stop": start, "branch": None, "reported_versions": None})
        segments.append(
            {"start": start, "stop": stop, "branch": branch, "reported_versions": list(sample.weight_versions or [])}
        )
        queue_state.stamp(sample, policy_segments=segments, generation_start=stop)


def inherit_queue_context(source: Any, output: Any) -> Any:
    """Carry the input Sample's queue fields onto the Samples a custom generate function returned."""
    theirs = QueueState.of(source)
    for sample in iter_samples(output):
        if sample is source:
            continue
        mine = QueueState.of(sample)
        for field in ("lease", "receipt"):
            if getattr(mine, field) is not None and getattr(mine, field) != getattr(theirs, field):
                raise ValueError("A generation hook returned a different queue task authorization")
        queue_state.copy_state(source, sample)
    return output


def pack_rollout_group(group: Any, args: Any, rollout_id: Any, *, controller: Any = None) -> Any:
    """Publish one finished group (nesting preserved); a leased group also completes its queue task."""
    first = next(iter_samples(group))
    lease = group_lease(group)
    record_generation_provenance(group)
    if lease is not None:
        if controller is None:
            raise ValueError("Queue group has a lease but no coordinator binding")
        metadata = {"task_id": lease.task_id, "attempt_id": lease.attempt_id}
        ref = pack_rollout_payload(
            group, args, rollout_id, metadata=metadata, submission_id=f"group:{lease.attempt_id}"
        )
        receipt = ray.get(controller.complete.remote(lease, ref.manifest))
    else:
        ref = pack_rollout_payload(group, args, rollout_id)
        receipt = None
    return RolloutGroupRef(receipt.result_ref if receipt else ref.manifest, ref.root, first.index, receipt)


def _io_semaphore(args: Any) -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    cached = _io_semaphores.get(loop)
    if cached is None or cached[0] != os.getpid():
        cached = (os.getpid(), asyncio.Semaphore(StrawSettings.from_args(args).io_concurrency))
        _io_semaphores[loop] = cached
    return cached[1]


async def run_rollout_io(args: Any, fn: Callable[..., Any], *values: Any, **kwargs: Any) -> Any:
    """Run blocking storage work off the event loop, bounded per loop; a started commit is never abandoned."""
    async with _io_semaphore(args):
        task = asyncio.ensure_future(asyncio.to_thread(fn, *values, **kwargs))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            while not task.done():
                try:
                    await asyncio.shield(task)
                except asyncio.CancelledError:
                    continue
                except Exception:  # noqa: BLE001 - the cancellation below is what the caller asked for
                    break
            raise


async def publish_rollout_async(
    value: Any, args: Any, rollout_id: Any, *, group: bool = False, controller: Any = None
) -> Any:
    """Publish a group (`group=True`) or payload without blocking the event loop."""
    import slime.data.transport as transport

    if group:
        return await transport.run_rollout_io(
            args, transport.pack_rollout_group, value, args, rollout_id, controller=controller
        )
    return await transport.run_rollout_io(args, transport.pack_rollout_payload, value, args, rollout_id)


def release_payload_publications(args: Any, payloads: Iterable[Any]) -> None:
    """Give up staging ownership of published payloads (each manifest once, in batches)."""
    manifests = {}
    for payload in payloads:
        if isinstance(payload, DiskPayloadRef):
            manifests.setdefault(payload.manifest.digest, payload.manifest)
    if not manifests:
        return
    store, _, lock = rollout_store(args)
    refs = list(manifests.values())
    with lock:
        for start in range(0, len(refs), _RELEASE_BATCH):
            store.release_publications(refs[start : start + _RELEASE_BATCH])


def release_rollout_publications(group: Any, args: Any) -> None:
    """Give up staging of the tensor publications that a discarded group's Samples reference."""
    from straw.tensor import TensorRef, release_tensor_publications

    tensors = [
        value for sample in iter_samples(group) for value in vars(sample).values() if isinstance(value, TensorRef)
    ]
    if not tensors:
        return
    store, _, lock = rollout_store(args)
    with lock:
        release_tensor_publications(store, tensors)


def discard_rollout_group(group: Any, args: Any, reason: str = "dynamic filter", *, controller: Any = None) -> None:
    """Drop a group: release its staging and tell the queue (reject the lease, or record dispositions)."""
    if isinstance(group, DiskPayloadRef):
        release_payload_publications(args, [group])
        group = unpack_rollout_payload(group)
    release_rollout_publications(group, args)
    lease = group_lease(group)
    if lease is not None:
        if controller is None:
            raise ValueError("Queue group has a lease but no coordinator binding")
        ray.get(controller.reject.remote(lease, reason))
        return
    positions = sorted({p for s in iter_samples(group) if (p := QueueState.of(s).position) is not None})
    if positions:
        if controller is None:
            raise ValueError("Queue samples were discarded but no coordinator binding was given")
        ref = pack_rollout_payload({"positions": positions, "reason": reason}, args, "dispositions")
        ray.get(controller.record_dispositions.remote(ref.manifest))


# --------------------------------------------------------------------------------------------- reading


def unpack_rollout_payload(value: Any) -> Any:
    """Follow references until a plain value remains."""
    while isinstance(value, DiskPayloadRef):
        value = value.load()
    return value


async def unpack_published_payload(value: Any) -> Any:
    """`unpack_rollout_payload` off the event loop; corrupt data errors name the pack that failed."""
    from straw.errors import CorruptData

    try:
        return await asyncio.to_thread(unpack_rollout_payload, value)
    except CorruptData as exc:
        if isinstance(value, DiskPayloadRef):
            segment = value.manifest.manifest.segment
            exc.add_note(f"while reading {segment.path} (offset {segment.offset}) in the pool at {value.root}")
        raise


def _read_group(element: Any) -> Any:
    value = unpack_rollout_payload(element)
    if isinstance(value, list):
        expanded = []
        for child in value:
            if isinstance(child, DiskPayloadRef):
                expanded.extend(_read_group(child))
            else:
                expanded.append(child)
        value = expanded
    if isinstance(element, RolloutGroupRef) and element.receipt is not None:
        receipt = dataclasses.asdict(element.receipt)
        for sample in iter_samples(value):
            if element.source_positions is not None:
                queue_state.stamp(sample, source_positions=list(element.source_positions))
            queue_state.remove(sample, "lease")
            queue_state.stamp(sample, receipt=receipt)
    return value


def load_rollout_samples(value: Any) -> list:
    """Load a batch's groups (refs followed, nested chunk refs expanded), keeping each group's nesting."""
    groups = unpack_rollout_payload(value)
    if not isinstance(groups, (list, tuple)):
        raise TypeError(f"Expected a list of rollout groups, got {type(groups).__name__}")
    return [_read_group(element) for element in groups]


# --------------------------------------------------------------------------------------------- acceptance


def accept_raw_rollout(output: Any, args: Any, rollout_id: Any, *, controller: Any) -> RawRolloutRef:
    """Accept one rollout step's output into the queue; returns its receipted `RawRolloutRef`.

    An already accepted ref is checked against the queue and returned unchanged (nothing is written).
    Otherwise borrowed leased groups are completed first, then the collection (references only, when
    the output already holds refs) is published and completed as the step's collection task.
    """
    import slime.data.transport as transport

    if isinstance(output, RawRolloutRef):
        receipt = ray.get(controller.accepted.remote(output.receipt))
        if output.manifest != receipt.result_ref:
            raise ValueError("Raw rollout manifest differs from its accepted receipt")
        return output
    groups = unpack_rollout_payload(output.samples)
    leased: dict[tuple[str, str], list] = {}
    for group in groups:
        if isinstance(group, RolloutGroupRef) and group.receipt is not None:
            continue
        for sample in iter_samples(unpack_rollout_payload(group)):
            lease = QueueState.of(sample).lease
            if lease:
                leased.setdefault((lease["task_id"], lease["attempt_id"]), []).append(sample)
    for samples in leased.values():
        lease = group_lease(samples)
        if ray.get(controller.result.remote(lease)) is None:
            transport.pack_rollout_group(samples, args, rollout_id, controller=controller)
    lease = ray.get(controller.begin_collection.remote(str(rollout_id)))
    store, codec, lock = rollout_store(args)
    value = output.sample_refs if output.sample_refs is not None else output.samples
    with lock:
        ref = codec.publish(
            value,
            submission_id=f"collection:{lease.attempt_id}",
            metadata={"task_id": lease.task_id, "attempt_id": lease.attempt_id},
        )
    receipt = ray.get(controller.complete.remote(lease, ref))
    if output.on_accepted is not None:
        output.on_accepted()
    return RawRolloutRef(receipt.result_ref, str(store.backend.root), receipt, output.metrics)


# --------------------------------------------------------------------------------------------- storage probe


def _probe_storage(reference: DiskPayloadRef, root: str, args: Any) -> DiskPayloadRef:
    """On one node: read the marker through that node's mount and publish it back."""
    return pack_rollout_payload(reference.load(root=root), args, 0)


def check_rollout_storage(args: Any) -> None:
    """Prove that every alive Ray node with CPUs or GPUs reads and writes the same pool; `UsageError` naming each
    node that does not (its address and what failed there) and the path. A node that leaves the cluster during the
    check (a node lost moments before the run, which Ray still listed) is skipped with a warning."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    marker = uuid.uuid4().hex
    reference = pack_rollout_payload(marker, args, 0)  # first: it names a missing straw-queue
    from straw.errors import QueueError

    probe = ray.remote(num_cpus=0)(_probe_storage)
    nodes = [
        node
        for node in ray.nodes()
        if node.get("Alive") and (node.get("Resources", {}).get("CPU") or node.get("Resources", {}).get("GPU"))
    ]
    # This process's own node is probed here: a Ray task would start a worker that imports torch for the codec,
    # seconds of CPU while the engines start, to prove what this process can prove itself.
    here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    remote = [node for node in nodes if node["NodeID"] != here]
    probes = [
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
            reference, args.rollout_data_dir, args
        )
        for node in remote
    ]
    wheres = [_node_label(node) for node in remote]
    try:
        returned, failures = list(zip(wheres, ray.get(probes, timeout=STORAGE_PROBE_TIMEOUT_S), strict=True)), []
    except Exception as exc:
        returned, failures = _diagnose_probes(wheres, probes)
        if not returned and not failures:  # nothing to name: say what failed
            failures = [f"{type(exc).__name__}: {exc}"]
    for node in nodes:
        if node["NodeID"] == here:
            try:
                returned.append((_node_label(node), _probe_storage(reference, args.rollout_data_dir, args)))
            except (OSError, QueueError) as exc:  # the pool is not usable here; anything else is a bug: raised
                failures.append(f"{_node_label(node)}: {type(exc).__name__}: {exc}")
    failures += [f"{where}: reads another file there" for where, ref in returned if ref.load() != marker]
    release_payload_publications(args, [reference, *(ref for _, ref in returned)])
    if failures:
        raise UsageError(
            f"All rollout/training nodes must share the run at --rollout-data-dir={args.rollout_data_dir}, and "
            + ("this node does not" if len(failures) == 1 else f"{len(failures)} nodes do not")
            + ":\n  "
            + "\n  ".join(failures)
            + "\nmount the same shared filesystem (NFS, JuiceFS, ...) at that path on every node"
        )


def _node_label(node: dict) -> str:
    return f"node {node.get('NodeManagerAddress', '?')} ({node['NodeID'][:8]})"


def _diagnose_probes(wheres: list[str], probes: list[Any]) -> tuple[list[tuple[str, Any]], list[str]]:
    """After a failed storage check: each node's probe result (`(node, ref)`) or failure (`"node ...: why"`); a node
    that left the cluster meanwhile (Ray still listed it) is skipped with a warning."""
    from ray.exceptions import TaskUnschedulableError

    returned, failures = [], []
    for where, pending in zip(wheres, probes, strict=True):
        try:
            returned.append((where, ray.get(pending, timeout=STORAGE_PROBE_TIMEOUT_S)))
        except TaskUnschedulableError:
            logger.warning("%s left the Ray cluster during the storage check; it is not checked", where)
        except Exception as exc:
            lines = str(exc).strip().splitlines()
            failures.append(f"{where}: {type(exc).__name__}: {lines[-1] if lines else ''}")
    return returned, failures
