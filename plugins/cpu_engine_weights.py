"""The CPU engine's control and weight-transfer protocol, as SGLang 0.5.19 speaks it on the wire.

`parse_control_body(endpoint, body)` validates the JSON body of one control endpoint against SGLang's request
schema (every field SGLang accepts is accepted, with SGLang's defaults; anything else, a wrong type or a value
the CPU engine cannot honour is a `RequestError` naming the field).

`WeightUpdateGroups` joins the torch.distributed groups a trainer creates to broadcast weights
(`/init_weights_update_group`, `/update_weights_from_distributed`, `/destroy_weights_update_group`). The engine
joins exactly as an SGLang engine does with backend "gloo", so one trainer-side recipe serves both: a TCPStore
*client* at master_address:master_port (created with the group's world_size), wrapped as
`PrefixStore("cpu/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store)))` (the prefix from SGLang's
rendezvous, then torch's per-group and per-device prefixes), and a `ProcessGroupGloo` at rank `rank_offset` (the
CPU engine has one tensor-parallel rank) of `world_size`. The trainer is rank 0: it creates the TCPStore master
(`is_master=True`, same world_size), the same PrefixStore chain and `ProcessGroupGloo(store, 0, world_size,
timeout)`, then broadcasts from rank 0.

`decode_named_tensors(entry)` turns one `/update_weights_from_tensor` entry (base64 of a
`multiprocessing.reduction.ForkingPickler` dump of `[(name, tensor), ...]`) back into tensors with a restricted
unpickler that resolves only what torch's tensor reductions with the "file_system" sharing strategy need.

`release_weights(model)` / `restore_weights(model, released)` implement `/release_memory_occupation` and
`/resume_memory_occupation` for the "weights" tag: the served parameters are written to a safetensors file in
a fresh temporary directory (under `$TMPDIR`; put it on disk, not tmpfs, for the release to free RAM) and each
parameter's storage is dropped; resume reallocates them and loads that file back, so exactly the weights served
before come back, whichever way they arrived. Writing the file briefly needs a second copy of the weights in
memory (safetensors serializes each tensor to bytes first).
"""

from __future__ import annotations

import base64
import binascii
import datetime
import io
import pickle
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slime.plugins.cpu_engine_core import RequestError

DEFAULT_GROUP_NAME = "weight_update_group"
#: The memory tags SGLang knows. On the CPU engine only "weights" holds memory between requests.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
PAUSE_MODES = ("abort", "retract", "in_place")

_REQUIRED = object()
#: Fields every SGLang request object carries (routing metadata); accepted and ignored.
_COMMON_FIELDS = {"rid": None, "http_worker_ipc": None}


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_str(value: Any) -> bool:
    return isinstance(value, str)


def _check_opt_str(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _check_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _check_opt_bool(value: Any) -> bool:
    return value is None or isinstance(value, bool)


def _check_port(value: Any) -> bool:
    return _is_int(value) and 0 < value < 65536


def _check_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_opt_str_list(value: Any) -> bool:
    return value is None or _check_str_list(value)


def _check_shapes(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape) for shape in value
    )


# endpoint -> field -> (check, expectation in words, default or _REQUIRED). Fields and defaults are SGLang's.
_SCHEMAS: dict[str, dict[str, tuple[Any, str, Any]]] = {
    "/update_weight_version": {
        "new_version": (_check_str, "a string", _REQUIRED),
        "abort_all_requests": (_check_bool, "a boolean", True),
    },
    "/pause_generation": {
        "mode": (lambda v: v in PAUSE_MODES, f"one of {list(PAUSE_MODES)}", "abort"),
    },
    "/continue_generation": {
        "torch_empty_cache": (_check_bool, "a boolean", True),
    },
    "/release_memory_occupation": {
        "tags": (_check_opt_str_list, f"null or a list of tags from {list(MEMORY_TAGS)}", None),
    },
    "/resume_memory_occupation": {
        "tags": (_check_opt_str_list, f"null or a list of tags from {list(MEMORY_TAGS)}", None),
    },
    "/init_weights_update_group": {
        "master_address": (lambda v: isinstance(v, str) and bool(v), "a non-empty host name or address", _REQUIRED),
        "master_port": (_check_port, "a port number in [1, 65535]", _REQUIRED),
        "rank_offset": (_is_int, "an integer", _REQUIRED),
        "world_size": (_is_int, "an integer", _REQUIRED),
        "group_name": (lambda v: isinstance(v, str) and bool(v), "a non-empty string", DEFAULT_GROUP_NAME),
        "backend": (_check_str, "a string", "nccl"),
    },
    "/destroy_weights_update_group": {
        "group_name": (lambda v: isinstance(v, str) and bool(v), "a non-empty string", DEFAULT_GROUP_NAME),
    },
    "/update_weights_from_distributed": {
        "names": (_check_str_list, "a list of parameter names", _REQUIRED),
        "dtypes": (_check_str_list, "a list of torch dtype names such as 'bfloat16'", _REQUIRED),
        "shapes": (_check_shapes, "a list of shapes (lists of non-negative integers)", _REQUIRED),
        "group_name": (lambda v: isinstance(v, str) and bool(v), "a non-empty string", DEFAULT_GROUP_NAME),
        "flush_cache": (_check_bool, "a boolean", True),
        "abort_all_requests": (_check_bool, "a boolean", False),
        "weight_version": (_check_opt_str, "a string or null", None),
        "load_format": (lambda v: v in (None, "flattened_bucket"), "null or 'flattened_bucket'", None),
        "torch_empty_cache": (_check_bool, "a boolean", False),
    },
    "/update_weights_from_tensor": {
        "serialized_named_tensors": (
            lambda v: _check_str_list(v) and bool(v),
            "a non-empty list of base64 strings, one per tensor-parallel rank",
            _REQUIRED,
        ),
        "load_format": (
            lambda v: v in (None, "direct"),
            "null or 'direct' (the CPU engine loads tensors by parameter name; 'flattened_bucket' and custom "
            "loaders are not supported)",
            None,
        ),
        "flush_cache": (_check_bool, "a boolean", True),
        "abort_all_requests": (_check_bool, "a boolean", False),
        "weight_version": (_check_opt_str, "a string or null", None),
        "disable_draft_model": (_check_opt_bool, "a boolean or null", None),
        "torch_empty_cache": (_check_bool, "a boolean", False),
    },
}


def parse_control_body(endpoint: str, body: Any) -> dict[str, Any]:
    """`body` checked against `endpoint`'s SGLang request schema; returns every field, defaults filled in."""
    schema = _SCHEMAS[endpoint]
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise RequestError(f"the {endpoint} body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(schema) - set(_COMMON_FIELDS))
    if unknown:
        raise RequestError(f"unsupported {endpoint} fields {unknown}; supported: {sorted(schema)}")
    params: dict[str, Any] = {}
    for name, (check, expected, default) in schema.items():
        if name not in body:
            if default is _REQUIRED:
                raise RequestError(f"{endpoint} needs '{name}' ({expected})")
            params[name] = default
            continue
        value = body[name]
        if not check(value):
            raise RequestError(f"{endpoint}: '{name}' must be {expected}, got {_describe(value)}")
        params[name] = value
    _check_semantics(endpoint, params)
    return params


def _check_semantics(endpoint: str, params: dict[str, Any]) -> None:
    if endpoint in ("/release_memory_occupation", "/resume_memory_occupation") and params["tags"]:
        unknown = [tag for tag in params["tags"] if tag not in MEMORY_TAGS]
        if unknown:
            raise RequestError(f"{endpoint}: 'tags' holds unknown tags {unknown}; known tags: {list(MEMORY_TAGS)}")
    if endpoint == "/init_weights_update_group":
        world, offset = params["world_size"], params["rank_offset"]
        if world < 2:
            raise RequestError(f"{endpoint}: 'world_size' must be >= 2 (the trainer and this engine), got {world}")
        if not 1 <= offset < world:
            raise RequestError(
                f"{endpoint}: 'rank_offset' must be in [1, world_size) = [1, {world}): rank 0 is the trainer, "
                f"got {offset}"
            )
    if endpoint == "/update_weights_from_distributed":
        names, dtypes, shapes = params["names"], params["dtypes"], params["shapes"]
        if not names:
            raise RequestError(f"{endpoint}: 'names' must name at least one tensor")
        if not len(names) == len(dtypes) == len(shapes):
            raise RequestError(
                f"{endpoint}: 'names', 'dtypes' and 'shapes' must have one entry per tensor, got "
                f"{len(names)}, {len(dtypes)} and {len(shapes)}"
            )
        duplicated = sorted({name for name in names if names.count(name) > 1})
        if duplicated:
            raise RequestError(f"{endpoint}: 'names' lists {duplicated} more than once")
        params["dtypes"] = [parse_dtype(d, f"{endpoint}: 'dtypes'") for d in dtypes]


def parse_dtype(name: str, where: str) -> torch.dtype:
    """The torch dtype called `name` (as SGLang resolves it: an attribute of `torch`, e.g. "bfloat16")."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise RequestError(f"{where} holds {name!r}, which is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    return dtype


# --- weight update groups ------------------------------------------------------------------------------


@dataclass
class _Group:
    process_group: Any
    rank: int
    world_size: int
    lock: threading.Lock


def group_store(store: Any, group_name: str, device: str = "cpu") -> Any:
    """The store a rank of weight update group `group_name` builds its process group on (see the module doc)."""
    from torch.distributed import PrefixStore

    return PrefixStore(f"{device}/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store)))


class WeightUpdateGroups:
    """The weight update groups this engine has joined, by name. Blocking methods: call them off the event loop."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self._groups: dict[str, _Group] = {}
        self._lock = threading.Lock()
        self._joining: set[str] = set()

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)

    def init(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> str:
        """Join group `group_name` as rank `rank_offset`; blocks until every rank joined or the timeout passed."""
        if backend != "gloo":
            raise RequestError(
                f"backend {backend!r} is not available on the CPU engine: it joins weight update groups with "
                "backend 'gloo' only; create the trainer's group with gloo and send backend 'gloo'"
            )
        with self._lock:
            if group_name in self._groups or group_name in self._joining:
                raise RequestError(
                    f"weight update group {group_name!r} already exists on this engine; destroy it first "
                    "(/destroy_weights_update_group) or use another group_name"
                )
            self._joining.add(group_name)
        try:
            from torch.distributed import ProcessGroupGloo, TCPStore

            timeout = datetime.timedelta(seconds=self.timeout_s)
            where = f"{master_address}:{master_port}"
            try:
                store = TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
                process_group = ProcessGroupGloo(group_store(store, group_name), rank_offset, world_size, timeout)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                raise RequestError(
                    f"could not join weight update group {group_name!r} at {where} as rank {rank_offset} of "
                    f"{world_size} within {self.timeout_s:g} s: {type(exc).__name__}: {exc}. The trainer must "
                    "create the TCPStore master there and join the group as rank 0 while this request waits"
                ) from exc
            with self._lock:
                self._groups[group_name] = _Group(process_group, rank_offset, world_size, threading.Lock())
        finally:
            with self._lock:
                self._joining.discard(group_name)
        return f"Joined weight update group {group_name!r} at {where} as rank {rank_offset} of {world_size}."

    def destroy(self, group_name: str) -> str:
        with self._lock:
            group = self._groups.get(group_name)
        if group is None:
            raise RequestError(f"weight update group {group_name!r} does not exist on this engine")
        with group.lock:  # lets a transfer in progress on this group finish (or time out) first
            with self._lock:
                self._groups.pop(group_name, None)
            _shutdown(group.process_group)
        return f"Destroyed weight update group {group_name!r}."

    def close(self) -> None:
        with self._lock:
            groups = list(self._groups.values())
            self._groups.clear()
        for group in groups:
            _shutdown(group.process_group)

    def receive(
        self,
        group_name: str,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[list[int]],
        load_format: str | None,
    ) -> list[tuple[str, torch.Tensor]]:
        """The tensors rank 0 of `group_name` broadcasts, allocated from the given metadata.

        `load_format` None: one broadcast per tensor, in order; "flattened_bucket": one broadcast of a uint8
        tensor holding every tensor's bytes (`tensor.flatten().view(torch.uint8)`) concatenated in order.
        """
        with self._lock:
            group = self._groups.get(group_name)
        if group is None:
            raise RequestError(
                f"weight update group {group_name!r} does not exist on this engine (known: {self.names()}); "
                "call /init_weights_update_group first"
            )
        tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]
        with group.lock:
            try:
                if load_format == "flattened_bucket":
                    sizes = [t.numel() * t.element_size() for t in tensors]
                    flat = torch.empty(sum(sizes), dtype=torch.uint8)
                    group.process_group.broadcast(flat, 0).wait()
                    tensors = _split_bucket(flat, sizes, dtypes, shapes)
                else:
                    works = [group.process_group.broadcast(t, 0) for t in tensors]
                    for work in works:
                        work.wait()
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                raise RequestError(
                    f"receiving {len(names)} tensors over weight update group {group_name!r} failed: "
                    f"{type(exc).__name__}: {exc}. The group may now be out of step with the trainer: destroy and "
                    "re-initialize it"
                ) from exc
        return list(zip(names, tensors, strict=True))


def _split_bucket(
    flat: torch.Tensor, sizes: list[int], dtypes: list[torch.dtype], shapes: list[list[int]]
) -> list[torch.Tensor]:
    tensors, offset = [], 0
    for size, dtype, shape in zip(sizes, dtypes, shapes, strict=True):
        chunk = flat[offset : offset + size]
        if offset % dtype.itemsize:  # a byte view must start at a multiple of the element size
            chunk = chunk.clone()
        tensors.append(chunk.view(dtype).reshape(shape))
        offset += size
    return tensors


def _shutdown(process_group: Any) -> None:
    shutdown = getattr(process_group, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - the group is dropped either way
            pass


# --- tensors through shared memory ------------------------------------------------------------------------

_ALLOWED_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.nn.parameter", "Parameter"),
    ("builtins", "list"),
    ("builtins", "tuple"),
    ("builtins", "dict"),
    ("builtins", "int"),
    ("builtins", "float"),
    ("builtins", "bool"),
    ("builtins", "str"),
    ("builtins", "bytes"),
}
_FD_STRATEGY = {
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("multiprocessing.resource_sharer", "DupFd"),
}
_FILE_SYSTEM_HINT = (
    "the sender must call torch.multiprocessing.set_sharing_strategy('file_system') before serializing, and keep "
    "the tensors alive until the request returns"
)


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only torch's CPU tensor/storage reductions (file_system strategy), dtypes and plain builtins."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _FD_STRATEGY:
            raise RequestError(
                f"the tensors were shared with the file_descriptor strategy ({module}.{name}), which the engine "
                f"does not accept: {_FILE_SYSTEM_HINT}"
            )
        raise RequestError(
            f"refusing to unpickle {module}.{name}: /update_weights_from_tensor accepts only a list of "
            "(name, CPU tensor) pairs pickled with multiprocessing.reduction.ForkingPickler"
        )


def decode_named_tensors(entry: str) -> list[tuple[str, torch.Tensor]]:
    """The `(name, tensor)` pairs in one base64 `serialized_named_tensors` entry."""
    try:
        data = base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"/update_weights_from_tensor: 'serialized_named_tensors'[0] is not base64: {exc}") from exc
    try:
        named = _RestrictedUnpickler(io.BytesIO(data)).load()
    except RequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - a payload that does not rebuild is the caller's error
        raise RequestError(
            f"/update_weights_from_tensor: cannot rebuild the tensors of 'serialized_named_tensors'[0]: "
            f"{type(exc).__name__}: {exc}; {_FILE_SYSTEM_HINT}"
        ) from exc
    if not isinstance(named, list | tuple) or not all(
        isinstance(pair, list | tuple)
        and len(pair) == 2
        and isinstance(pair[0], str)
        and isinstance(pair[1], torch.Tensor)
        for pair in named
    ):
        raise RequestError(
            "/update_weights_from_tensor: 'serialized_named_tensors'[0] must hold a list of (name, tensor) pairs, "
            f"got {type(named).__name__}"
        )
    if not named:
        raise RequestError("/update_weights_from_tensor: 'serialized_named_tensors'[0] holds no tensors")
    return [(name, tensor.detach()) for name, tensor in named]


# --- memory release ----------------------------------------------------------------------------------------

_SNAPSHOT_FILE = "weights.safetensors"


@dataclass
class ReleasedWeights:
    """Where released parameters wait on disk, and the shape and dtype of each."""

    directory: Path
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]]

    def discard(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def release_weights(model: torch.nn.Module) -> ReleasedWeights:
    """Write `model`'s parameters to a temporary safetensors file, then drop their storage (buffers stay)."""
    from safetensors.torch import save_file

    params = dict(model.named_parameters())  # tied parameters once
    directory = Path(tempfile.mkdtemp(prefix="slime-cpu-engine-released-"))
    try:
        save_file({name: p.detach().contiguous() for name, p in params.items()}, str(directory / _SNAPSHOT_FILE))
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    layout = {name: (tuple(p.shape), p.dtype) for name, p in params.items()}
    for p in params.values():
        p.data = torch.empty(0, dtype=p.dtype)
    return ReleasedWeights(directory, layout)


def restore_weights(model: torch.nn.Module, released: ReleasedWeights) -> None:
    """Reallocate the parameters `release_weights` dropped and load their saved values; removes the file."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    try:
        with safe_open(str(released.directory / _SNAPSHOT_FILE), framework="pt") as saved:
            for name, (shape, dtype) in released.layout.items():
                params[name].data = saved.get_tensor(name).to(dtype).reshape(shape)
    except Exception as exc:  # noqa: BLE001 - reported to the caller; the weights stay released
        for name, (_, dtype) in released.layout.items():
            params[name].data = torch.empty(0, dtype=dtype)
        raise RequestError(
            f"cannot restore the released weights from {released.directory}: {type(exc).__name__}: {exc}"
        ) from exc
    released.discard()
