"""Sending a training rank's full weights to the rollout engines without going through disk.

`RayTrainGroup.update_weights` gives every training rank a `WeightUpdate`: the version, the transport, the
live engines' URLs (engines already paused by the rollout manager) and how to send. With transport "disk" the
backend exports to `update.disk_dir` and the rollout manager has the engines load it; with "distributed" or
"tensor", the rank that holds the full weights (rank 0 of the torch backend; a backend that shards them gathers
them first) calls `send_weights(update, named_tensors)` with Hugging Face parameter names, and the others
wait. The manager then checks that every engine serves `update.version` and lets them generate again.

- `DistributedWeightSender` (transport "distributed"): the trainer is rank 0 of a torch.distributed group of
  `1 + sum(tp_size)` ranks (each engine's `GET /server_info` "tp_size"; engine ranks start at their engine's
  `rank_offset`). It listens with a `TCPStore` on a free port, asks every engine to
  `POST /init_weights_update_group` while it joins, then broadcasts the weights in buckets of at most
  `update.bucket_bytes`, each the uint8 concatenation of its tensors' bytes (`flatten_bucket`) announced by a
  `POST /update_weights_from_distributed` with `load_format` "flattened_bucket". The last bucket carries
  `weight_version` and `flush_cache`. The group is torn down (`/destroy_weights_update_group`) whatever happens.
  Backend gloo, or NCCL when the tensors are on CUDA.
- `TensorWeightSender` (transport "tensor"): engines on this machine only. Each bucket is pickled with torch's
  multiprocessing reductions (CPU tensors travel through shared memory, CUDA tensors as CUDA IPC handles) and
  posted base64-encoded to `POST /update_weights_from_tensor`, one copy per engine TP rank.

An engine that refuses a request, fails it or does not answer within `update.timeout_s` stops the update with
an `EngineRequestError` naming the engine, the endpoint and the engine's message. Importing this module
imports neither torch, Ray nor SGLang (the driver and the settings read `WeightUpdate` and `TRANSPORTS`); the
senders import torch when they run.
"""

from __future__ import annotations

import base64
import io
import itertools
import logging
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from slime.engine_control import (
    EngineRequestError,
    EngineUnreachableError,
    PendingPosts,
    engine_get,
    post_engines,
    start_posts,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DistributedWeightSender",
    "SENDERS",
    "TRANSPORTS",
    "TensorWeightSender",
    "WeightSender",
    "WeightSyncError",
    "WeightUpdate",
    "bucket_metadata",
    "canonical_transport",
    "engine_tp_sizes",
    "flatten_bucket",
    "iter_buckets",
    "send_weights",
]

logger = logging.getLogger(__name__)

#: `--update-weight-transport` values.
TRANSPORTS = ("disk", "distributed", "tensor")
#: Older names still read from arguments that code builds (the command line offers `TRANSPORTS` only).
TRANSPORT_ALIASES = {"nccl": "distributed"}
#: `--update-weight-buffer-size`'s default: bytes per bucket.
DEFAULT_BUCKET_BYTES = 512 * 1024**2
#: Seconds the teardown of a failed update waits for engines to drop their side of the group.
TEARDOWN_TIMEOUT_S = 30.0
_POLL_S = 0.005


def canonical_transport(name: str) -> str:
    """`name` with the old alias "nccl" read as "distributed" (the backend follows the tensors' device)."""
    return TRANSPORT_ALIASES.get(str(name), str(name))


class WeightSyncError(RuntimeError):
    """A weight update could not be sent (the trainer's side failed; engine refusals are `EngineRequestError`)."""


@dataclass(frozen=True)
class WeightUpdate:
    """One weight update, as every training rank receives it (picklable; see the module docstring).

    `version`: the weight version the engines serve once it is applied (they report it as `str(version)`);
    `transport`: one of `TRANSPORTS`; `engine_urls`: the live engines to send to (empty: none, e.g. a run with
    `--debug-train-only`); `disk_dir`: for "disk", the `weight_v{version:06d}` directory to export to;
    `bucket_bytes`: the most bytes one bucket carries; `timeout_s`: seconds any one wait on an engine (a request,
    the group join, a broadcast) may take.
    """

    version: int
    transport: str
    engine_urls: tuple[str, ...] = ()
    disk_dir: str | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"weight update transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.transport == "disk" and not self.disk_dir:
            raise ValueError("a disk weight update needs disk_dir (the weight_v{version:06d} directory)")
        if self.bucket_bytes < 1:
            raise ValueError(f"--update-weight-buffer-size must be >= 1 byte, got {self.bucket_bytes}")
        if self.timeout_s <= 0:
            raise ValueError(f"a weight update's timeout must be > 0 s, got {self.timeout_s}")
        object.__setattr__(self, "engine_urls", tuple(self.engine_urls))

    @property
    def group_name(self) -> str:
        """The name of this update's process group on the engines ("distributed")."""
        return f"slime-weights-v{self.version}"


# --------------------------------------------------------------------------------------------- buckets


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The tensors in their order, grouped into buckets of at most `bucket_bytes` bytes (a tensor larger than
    that travels alone); reads `named_tensors` lazily, one tensor ahead.

    A tensor also starts a new bucket when the bytes before it are not a multiple of its element size: an
    engine views each tensor's slice of a flattened bucket as the tensor's dtype, which needs that alignment.
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = _nbytes(tensor)
        if bucket and (size + nbytes > bucket_bytes or size % tensor.element_size()):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _dtype_name(dtype: torch.dtype) -> str:
    """The name engines read back with `getattr(torch, name)`: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def bucket_metadata(bucket: list[tuple[str, torch.Tensor]]) -> dict[str, list]:
    """The `names`, `dtypes` and `shapes` that announce `bucket` to the engines."""
    return {
        "names": [name for name, _ in bucket],
        "dtypes": [_dtype_name(tensor.dtype) for _, tensor in bucket],
        "shapes": [list(tensor.shape) for _, tensor in bucket],
    }


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """One uint8 tensor: each tensor's bytes (row-major), in order. An engine receiving it allocates the tensors
    `bucket_metadata` describes, concatenates their byte views the same way and splits it back after the
    broadcast, so any mix of dtypes may share a bucket (each tensor aligned to its element size, as
    `iter_buckets` arranges)."""
    import torch

    return torch.cat([tensor.detach().contiguous().reshape(-1).view(torch.uint8) for _, tensor in bucket])


def _with_last(items: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """`(item, is_last)` for each item of `items`."""
    previous = next(items, _END)
    while previous is not _END:
        current = next(items, _END)
        yield previous, current is _END
        previous = current


_END = object()


def _update_buckets(update: WeightUpdate, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple]:
    """`(bucket, is_last)` for the update's tensors; `WeightSyncError` when there are none."""
    empty = True
    for bucket, last in _with_last(iter_buckets(named_tensors, update.bucket_bytes)):
        empty = False
        yield bucket, last
    if empty:
        raise WeightSyncError(f"weight update {update.version} has no tensors to send")


# ------------------------------------------------------------------------------------------- engines


def engine_tp_sizes(urls: Iterable[str], timeout: float) -> list[int]:
    """Each engine's tensor-parallel size (`GET /server_info` "tp_size"): how many ranks it receives with."""
    sizes = []
    for url in urls:
        info = engine_get(url, "/server_info", timeout)
        tp_size = info.get("tp_size") if isinstance(info, dict) else None
        if not isinstance(tp_size, int) or tp_size < 1:
            raise EngineRequestError(f"rollout engine {url}: GET /server_info has no positive 'tp_size' ({tp_size!r})")
        dp_size = info.get("dp_size") or 1
        if dp_size != 1 and not info.get("enable_dp_attention"):
            raise EngineRequestError(
                f"rollout engine {url} runs dp_size {dp_size}: its data-parallel replicas would join a weight update "
                "with the same ranks; launch one engine per replica (dp_size 1)"
            )
        sizes.append(tp_size)
    return sizes


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"engine URL {url!r} names no host")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def local_address_towards(url: str) -> str:
    """This machine's address on the route to the engine at `url` (where that engine can reach the trainer)."""
    host, port = _address(url)
    family, kind, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as probe:
        probe.connect(sockaddr)  # a datagram socket's connect sends nothing; it only picks the route
        return probe.getsockname()[0]


def is_this_machine(host: str) -> bool:
    """Whether `host` names an address of this machine (one a socket here can bind)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        return False
    for family, kind, _, _, sockaddr in infos:
        with socket.socket(family, kind) as probe:
            try:
                probe.bind((sockaddr[0], 0))
            except OSError:
                continue
            return True
    return False


# ------------------------------------------------------------------------------------------- senders


class WeightSender(Protocol):
    """Sends one `WeightUpdate`'s tensors to its engines: `Sender(update).send(named_tensors)`."""

    def __init__(self, update: WeightUpdate) -> None: ...

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send every tensor (Hugging Face names, the engines' dtypes); return once every engine holds them as
        `update.version`. Raises `EngineRequestError` or `WeightSyncError` otherwise."""
        ...


def _wait_for_broadcast(work: Any, pending: PendingPosts, timeout: float, what: str) -> None:
    """Wait for the trainer's side of a collective and for the engines' answers to the request announcing it,
    failing as soon as an engine refuses (an engine that refuses never joins the collective). When the
    collective itself fails (an engine's connection closed), the engines' answers say which one and why."""
    deadline = time.monotonic() + timeout
    try:
        while not work.is_completed():
            error = pending.first_error()
            if error is not None:
                raise error
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"{what} did not complete within {timeout:g} s: engine(s) {', '.join(pending.urls)} did not "
                    "receive it (an engine died or stopped answering)"
                )
            time.sleep(_POLL_S)
        work.wait()
    except (EngineRequestError, WeightSyncError):
        raise
    except Exception as exc:
        try:
            pending.wait(max(0.0, min(deadline - time.monotonic(), TEARDOWN_TIMEOUT_S)))
        except Exception as engine_error:  # noqa: BLE001 - the engine's own account of the failure
            raise engine_error from exc
        raise WeightSyncError(f"{what} failed between the trainer and {', '.join(pending.urls)}: {exc}") from exc
    pending.wait(max(0.0, deadline - time.monotonic()))


class DistributedWeightSender:
    """Transport "distributed": a torch.distributed broadcast to every engine rank (see the module docstring).

    The store and the trainer's group are held on the sender only, so that the teardown really closes them
    (an engine still waiting to join gives up once the store is gone); no frame of a traceback keeps them.
    The tensors are read one bucket ahead (to mark the last one), so at most two buckets' tensors and one
    flattened copy are alive at once.
    """

    def __init__(self, update: WeightUpdate) -> None:
        self.update = update
        self._store: Any = None
        self._group: Any = None

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        import torch.distributed as dist

        update = self.update
        urls = list(update.engine_urls)
        buckets = _update_buckets(update, named_tensors)
        first = next(buckets)
        device = first[0][0][1].device
        backend = "nccl" if device.type == "cuda" else "gloo"
        tp_sizes = engine_tp_sizes(urls, update.timeout_s)
        world_size = 1 + sum(tp_sizes)
        address = local_address_towards(urls[0])
        timeout = timedelta(seconds=update.timeout_s)
        self._store = dist.TCPStore(address, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        succeeded = False
        try:
            join = {
                "master_address": address,
                "master_port": self._store.port,
                "world_size": world_size,
                "group_name": update.group_name,
                "backend": backend,
            }
            bodies = [{**join, "rank_offset": 1 + sum(tp_sizes[:i])} for i in range(len(urls))]
            joining = start_posts(urls, "/init_weights_update_group", bodies, update.timeout_s)
            self._join(world_size, backend, timeout, joining)
            joining.wait(update.timeout_s)
            for index, (bucket, last) in enumerate(itertools.chain([first], buckets)):
                self._broadcast(index, bucket, last, device)
            succeeded = True
        finally:
            self._teardown(urls, succeeded)

    def _join(self, world_size: int, backend: str, timeout: timedelta, joining: PendingPosts) -> None:
        """Become rank 0 of the update's group once every engine rank has joined.

        Engines create their side with `torch.distributed`'s group helper over a `tcp://` rendezvous, which
        prefixes the store's keys with the group name, then "<group name>/", then "<device>/" ("cpu" for gloo,
        "cuda" for NCCL): the trainer's side reads and writes the same keys to meet them.
        """
        import torch.distributed as dist

        name = self.update.group_name
        device_type = "cuda" if backend == "nccl" else "cpu"
        try:
            keys = dist.PrefixStore(name, self._store)
            keys = dist.PrefixStore(f"{device_type}/", dist.PrefixStore(f"{name}/", keys))
            if backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self._group = dist.ProcessGroupNCCL(keys, 0, world_size, options)
            else:
                self._group = dist.ProcessGroupGloo(keys, 0, world_size, timeout)
        except Exception as exc:
            keys = None  # the traceback keeps this frame: it must not keep the store
            refused = joining.first_error()
            if refused is not None and not isinstance(refused, EngineUnreachableError):
                raise refused from None  # the engine said why it did not join
            raise WeightSyncError(
                f"rollout engine(s) {', '.join(joining.urls)} did not join weight update group {name!r} "
                f"({world_size} ranks, {backend}) within {timeout.total_seconds():g} s: {exc}"
            ) from None

    def _broadcast(self, index: int, bucket: list, last: bool, device: torch.device) -> None:
        update = self.update
        flat = flatten_bucket(bucket).to(device)
        body = {
            **bucket_metadata(bucket),
            "group_name": update.group_name,
            "flush_cache": last,
            "weight_version": str(update.version) if last else None,
            "load_format": "flattened_bucket",
        }
        pending = start_posts(list(update.engine_urls), "/update_weights_from_distributed", body, update.timeout_s)
        work = self._group.broadcast(flat, 0)
        what = f"weight update {update.version}: broadcast of bucket {index} ({len(bucket)} tensors, {flat.numel()} B)"
        _wait_for_broadcast(work, pending, update.timeout_s, what)

    def _teardown(self, urls: list[str], succeeded: bool) -> None:
        """Drop the trainer's side (closing the store makes engines still joining give up), then have every
        engine destroy its side. After a failure, engines that never created theirs refuse; that is expected."""
        group, self._group = self._group, None
        if group is not None:
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001 - a broken group may not shut down cleanly; it is dropped anyway
                logger.warning("shutting down weight update group %s failed", self.update.group_name, exc_info=True)
        del group
        self._store = None
        timeout = self.update.timeout_s if succeeded else min(self.update.timeout_s, TEARDOWN_TIMEOUT_S)
        try:
            post_engines(urls, "/destroy_weights_update_group", {"group_name": self.update.group_name}, timeout)
        except EngineRequestError as exc:
            if succeeded:
                raise
            logger.warning("after the failed weight update %d: %s", self.update.version, exc)


def _serialize(bucket: list[tuple[str, torch.Tensor]]) -> str:
    """base64 of the pickled `[(name, tensor), ...]` with torch's multiprocessing reductions (the tensors' data
    stays in shared memory; the payload holds handles). Each receiving rank needs its own: unpickling consumes
    the reference that pickling took."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(bucket)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class TensorWeightSender:
    """Transport "tensor": shared memory to engines on this machine (see the module docstring).

    The tensors are copied per bucket (the engines never alias the trainer's parameters) and kept alive until
    every engine has answered. This sets torch's sharing strategy to "file_system" for the whole process (an
    SGLang engine's scheduler crashes on file-descriptor handles), and torch then starts a `torch_shm_manager`
    process that inherits this process's stdout and stderr.
    """

    def __init__(self, update: WeightUpdate) -> None:
        self.update = update
        remote = [url for url in update.engine_urls if not is_this_machine(_address(url)[0])]
        if remote:
            raise WeightSyncError(
                f"--update-weight-transport tensor passes weights through this machine's shared memory, but engine(s) "
                f"{', '.join(remote)} run elsewhere; use --update-weight-transport distributed (or disk)"
            )

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        import torch.multiprocessing  # registers torch's reductions with ForkingPickler

        update = self.update
        torch.multiprocessing.set_sharing_strategy("file_system")
        urls = list(update.engine_urls)
        tp_sizes = engine_tp_sizes(urls, update.timeout_s)
        for bucket, last in _update_buckets(update, named_tensors):
            copies = [(name, tensor.detach().clone()) for name, tensor in bucket]
            bodies = [
                {
                    "serialized_named_tensors": [_serialize(copies) for _ in range(tp_size)],
                    "load_format": None,
                    "flush_cache": last,
                    "weight_version": str(update.version) if last else None,
                }
                for tp_size in tp_sizes
            ]
            post_engines(urls, "/update_weights_from_tensor", bodies, update.timeout_s)
            del copies, bodies  # the engines hold their own now: free this bucket's shared memory before the next


#: The sender of each transport that sends tensors (disk exports are the backend's).
SENDERS: dict[str, type[WeightSender]] = {"distributed": DistributedWeightSender, "tensor": TensorWeightSender}


def send_weights(update: WeightUpdate, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Send `named_tensors` (Hugging Face names; every weight of the model) to `update.engine_urls` with the
    update's transport; a no-op without engines. Call it from the one rank that holds the full weights."""
    sender = SENDERS.get(update.transport)
    if sender is None:
        raise ValueError(
            f"send_weights sends 'distributed' and 'tensor' updates; a {update.transport!r} update is exported to "
            "update.disk_dir by the backend"
        )
    if not update.engine_urls:
        return
    sender(update).send(named_tensors)
