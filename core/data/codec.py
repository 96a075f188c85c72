"""`SampleCodec`: durable encoding of Samples and nested values as straw publications, never pickle.

A value becomes one `slime.v1` record holding a JSON tree of tagged nodes, plus `tensor.v1` records for
every new tensor; tensors and payloads that already live in the same pool are referenced as publication
dependencies instead of being copied. `publish` returns the manifest (`RecordSetRef`) of the `slime.v1`
publication; `load` rebuilds the value, with Sample replay fields as lazy `TensorRef`s.

Tree nodes are lists `[tag, ...]`; `None`, `str`, `bool`, `int` and finite floats are themselves:

    ["float", "inf"|"-inf"|"nan"]              ["bytes", base64]          ["status", value]
    ["tensor", loc, shape, dtype, lazy, kind, validated]   loc = {"dependency": i, "ordinal": j}
    ["ndarray", tensor node]                   ["record-set", dependency index]
    ["rollout-ref", class name, dependency index, extra dict node]
    ["sample", dict node]   ["spec-info", dict node]   ["prefix-cache-info", dict node]
    ["dynamic-filter", dict node]   ["dict", [[key, value], ...]]   ["list", [...]]   ["tuple", [...]]
    ["image-png", base64 PNG]
    ["numbers", "list"|"tuple", "int"|"float", start, stop]
    ["small-tensor", dtype, shape, start, stop]

A list or tuple of at least `NUMBERS_MIN` elements that are all exactly `int` (within int64) or all exactly
`float` (token ids, log-probs, loss masks) is not written into the JSON tree: its values go into one of two
per-value arenas, tensor records named in the document's `"numbers"` object (`{"int": tensor node, "float":
tensor node}`; int32 when every int fits, else int64; float64, so every float round-trips bit for bit), and
its node names the element range. Decoding reads each arena once, when the first such node is visited, and
returns lists (or tuples) of the same Python types. Encoding such lists as JSON used to dominate the
publication of rollout-shaped Samples (see docs/benchmarks.md).

Likewise a (non-lazy) tensor of at most `SMALL_TENSOR_BYTES` bytes gets no tensor record of its own: its raw
bytes go into the `"bytes"` arena (uint8, each slice 8-byte aligned) and its node names dtype, shape and the
byte range. A converted training batch holds a few small tensors per sample (tokens, loss masks); as records
each was a separate checked read when a trainer loaded its shard.

With `args.rollout_data_compression == "zstd"` the record payload is a zstd frame (recognised by its magic
number on load) instead of plain JSON bytes.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from straw.errors import CorruptData, IndeterminateCommit, InvalidReference, StorageUnavailable, UnsupportedSchema
from straw.protocol import Publication, Record, RecordSetRef, decode, encode
from straw.store import MAX_RECORDS
from straw.tensor import TensorRef, tensor_record

from slime.data.straw_settings import StrawSettings
from slime.utils.types import Sample

CODECS = ("bytes.v1", "json.v1", "slime.v1", "tensor.v1")
TREE_VERSION = 1
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

#: Replay fields stored as lazy tensors (kind = field name), loaded back as `TensorRef`s.
REPLAY_FIELDS = (
    "rollout_routed_experts",
    "rollout_topk_token_ids",
    "rollout_topk_log_probs",
    "rollout_top_p_token_ids",
    "rollout_top_p_token_offsets",
    "rollout_top_p_log_probs",
)
_TOP_K_FIELDS = ("rollout_topk_token_ids", "rollout_topk_log_probs")
_TOP_P_FIELDS = ("rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_top_p_log_probs")
#: Shorter numeric lists stay in the JSON tree (an arena slice is not worth it for a handful of values).
NUMBERS_MIN = 16
#: Tensors up to this size share the bytes arena instead of getting a tensor record each.
SMALL_TENSOR_BYTES = 64 * 1024
_SMALL_TENSOR_DTYPES = frozenset(
    (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    + (torch.float16, torch.bfloat16, torch.float32, torch.float64)
)
_INT32 = np.iinfo(np.int32)
_NUMBER_DTYPES = {"int": ("int32", "int64"), "float": ("float64",), "bytes": ("uint8",)}


@dataclasses.dataclass
class _Encoding:
    """Everything collected while walking one value."""

    submission_id: str
    blobs: list[Record] = dataclasses.field(default_factory=list)
    blob_nodes: list[tuple[list, int]] = dataclasses.field(default_factory=list)
    dependencies: list[RecordSetRef] = dataclasses.field(default_factory=list)
    dependency_index: dict[RecordSetRef, int] = dataclasses.field(default_factory=dict)
    aliases: dict[tuple, list] = dataclasses.field(default_factory=dict)
    keep_alive: list[Any] = dataclasses.field(default_factory=list)
    active: set[int] = dataclasses.field(default_factory=set)
    numbers: dict[str, list[np.ndarray]] = dataclasses.field(
        default_factory=lambda: {"int": [], "float": [], "bytes": []}
    )
    number_sizes: dict[str, int] = dataclasses.field(default_factory=lambda: {"int": 0, "float": 0, "bytes": 0})
    tokens: int = 0

    def dependency(self, ref: RecordSetRef) -> int:
        if ref not in self.dependency_index:
            self.dependency_index[ref] = len(self.dependencies)
            self.dependencies.append(ref)
        return self.dependency_index[ref]


@contextlib.contextmanager
def _storage_errors() -> Iterator[None]:
    """A failed storage flush surfaces as `StorageUnavailable` carrying straw's original message.

    straw reports a publication whose flush failed as `IndeterminateCommit`; it cleans the attempt up
    itself, so for callers the storage was simply unavailable and no reference exists.
    """
    try:
        yield
    except IndeterminateCommit as exc:
        raise StorageUnavailable(str(exc)) from exc


class SampleCodec:
    """Encodes values into publications of `store` and decodes them back (see the module docstring)."""

    def __init__(self, store: Any, *, args: Any = None) -> None:
        if sys.byteorder != "little":
            raise UnsupportedSchema("slime.v1/tensor.v1 rollout data requires a little-endian host")
        missing = sorted(set(CODECS) - set(store.codecs))
        if missing:
            raise ValueError(
                f"SampleCodec requires explicit slime.v1 and tensor.v1 store codecs; the store at "
                f"{getattr(store.backend, 'root', '?')} lacks {missing}: create it with codecs=slime.data.codec.CODECS"
            )
        self.store = store
        self.args = args
        self.compression = StrawSettings.from_args(args).compression

    # ----------------------------------------------------------------------------------------- publish

    def prepare(self, value: Any, *, submission_id: str, metadata: dict | None = None) -> list[Publication]:
        """The publications that store `value`; the last one holds the single `slime.v1` record."""
        state = _Encoding(submission_id)
        document = {"version": TREE_VERSION, "tree": self._node(value, state)}
        numbers = self._number_arenas(state)
        if numbers:
            document["numbers"] = numbers
        publications = []
        blob_dependency = {}
        limit = MAX_RECORDS - 1
        for start in range(0, len(state.blobs), limit):
            blob_dependency[start // limit] = len(state.dependencies) + len(publications)
            publications.append(Publication(tuple(state.blobs[start : start + limit])))
        for node, blob in state.blob_nodes:
            node[1] = {"dependency": blob_dependency[blob // limit], "ordinal": blob % limit}
        payload = encode(document)
        if self.compression == "zstd":
            import zstandard

            payload = zstandard.ZstdCompressor().compress(payload)
        record = Record(submission_id, payload, "slime.v1", dict(metadata or {}), state.tokens)
        dependencies = tuple(state.dependencies) + tuple(range(len(publications)))
        publications.append(Publication((record,), dependencies))
        return publications

    def publish(self, value: Any, *, submission_id: str, metadata: dict | None = None) -> RecordSetRef:
        """Durably publish `value`; returns the manifest of its `slime.v1` publication."""
        with _storage_errors():
            publications = self.prepare(value, submission_id=submission_id, metadata=metadata)
            return self._publish(publications, submission_id)[-1]

    def publish_many(
        self, values: Sequence[Any], *, submission_ids: Sequence[str], metadata: dict | None = None
    ) -> list[RecordSetRef]:
        """Publish several values in one bundle; returns one manifest per value."""
        if len(values) != len(submission_ids):
            raise ValueError("publish_many needs one submission id per value")
        if not values:
            return []
        bundle, manifests = [], []
        with _storage_errors():
            for value, submission_id in zip(values, submission_ids, strict=True):
                offset = len(bundle)
                for publication in self.prepare(value, submission_id=submission_id, metadata=metadata):
                    bundle.append(
                        Publication(
                            publication.records,
                            tuple(dep + offset if type(dep) is int else dep for dep in publication.dependencies),
                        )
                    )
                manifests.append(len(bundle) - 1)
            refs = self._publish(bundle, f"bundle:{submission_ids[0]}")
        return [refs[index] for index in manifests]

    def _publish(self, publications: list[Publication], submission_id: str) -> list[RecordSetRef]:
        """Send publications through `store.publish_many`, at most `MAX_RECORDS` records per call."""
        refs: list[RecordSetRef] = []
        start = 0
        while start < len(publications):
            stop, count = start, 0
            while stop < len(publications) and (
                stop == start or count + len(publications[stop].records) + 1 <= MAX_RECORDS
            ):
                count += len(publications[stop].records) + 1
                stop += 1
            batch = [
                Publication(
                    publication.records,
                    tuple(
                        (refs[dep] if dep < start else dep - start) if type(dep) is int else dep
                        for dep in publication.dependencies
                    ),
                )
                for publication in publications[start:stop]
            ]
            refs.extend(self.store.publish_many(batch, submission_id=f"{submission_id}:part:{start}"))
            start = stop
        return refs

    # ----------------------------------------------------------------------------------------- encode

    def _node(self, value: Any, state: _Encoding) -> Any:
        kind = type(value)
        if value is None or kind in (str, bool, int):
            return value
        if kind is float:
            if math.isfinite(value):
                return value
            return ["float", "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")]
        if isinstance(value, torch.Tensor):
            if value.nbytes <= SMALL_TENSOR_BYTES and value.dtype in _SMALL_TENSOR_DTYPES:
                return self._small_tensor_node(value, state)
            return self._tensor_node(value, state, lazy=False)
        if isinstance(value, TensorRef):
            return self._tensor_node(value, state, lazy=True, kind=value.kind, validated=value.validated)
        if isinstance(value, np.ndarray):
            return ["ndarray", self._tensor_node(_numpy_tensor(value), state, lazy=False)]
        if isinstance(value, np.generic):
            return self._node(value.item(), state)
        if isinstance(value, (bytes, bytearray)):
            return ["bytes", base64.b64encode(bytes(value)).decode("ascii")]
        if isinstance(value, Sample.Status):
            return ["status", value.value]
        if isinstance(value, RecordSetRef):
            return ["record-set", state.dependency(value)]
        from slime.data import refs

        if isinstance(value, refs.DiskPayloadRef):
            return self._ref_node(value, state, refs)
        if isinstance(value, Sample):
            return self._container(value, state, lambda: ["sample", self._sample_node(value, state)])
        if isinstance(value, Sample.SpecInfo):
            return ["spec-info", self._node(dataclasses.asdict(value), state)]
        if isinstance(value, Sample.PrefixCacheInfo):
            return ["prefix-cache-info", self._node(dataclasses.asdict(value), state)]
        from slime.rollout.filter_hub.base_types import DynamicFilterOutput

        if isinstance(value, DynamicFilterOutput):
            return ["dynamic-filter", self._node(dataclasses.asdict(value), state)]
        if isinstance(value, (list, tuple)) and len(value) >= NUMBERS_MIN:
            node = self._numbers_node(value, state)
            if node is not None:
                return node
        if isinstance(value, dict):
            return self._container(
                value,
                state,
                lambda: ["dict", [[self._node(k, state), self._node(v, state)] for k, v in value.items()]],
            )
        if isinstance(value, list):
            return self._container(value, state, lambda: ["list", [self._node(item, state) for item in value]])
        if isinstance(value, tuple):
            return self._container(value, state, lambda: ["tuple", [self._node(item, state) for item in value]])
        image = sys.modules.get("PIL.Image")
        if image is not None and isinstance(value, image.Image):
            buffer = io.BytesIO()
            value.save(buffer, format="PNG")
            return ["image-png", base64.b64encode(buffer.getvalue()).decode("ascii")]
        raise TypeError(f"Unsupported durable Sample field type: {kind.__module__}.{kind.__qualname__}")

    @staticmethod
    def _container(value: Any, state: _Encoding, build: Any) -> list:
        if id(value) in state.active:
            raise TypeError(
                f"Cyclic custom fields are not supported in durable rollout data "
                f"(a {type(value).__name__} contains itself)"
            )
        state.active.add(id(value))
        try:
            return build()
        finally:
            state.active.discard(id(value))

    def _tensor_node(
        self, value: Any, state: _Encoding, *, lazy: bool, kind: str | None = None, validated: bool = False
    ) -> list:
        key = (id(value), lazy, kind, validated)
        if key in state.aliases:
            return state.aliases[key]
        state.keep_alive.append(value)
        if isinstance(value, TensorRef):
            shape, dtype = list(value.shape), value.dtype
            if value.shares_storage(self.store):
                share_id = f"{state.submission_id}:share:{len(state.keep_alive)}"
                blob_set, ordinal = value.share(self.store, submission_id=share_id)
                node = ["tensor", {"dependency": state.dependency(blob_set), "ordinal": ordinal}]
                node += [shape, dtype, lazy, kind, validated]
                state.aliases[key] = node
                return node
            value = value.load()
        tensor = value.detach().cpu()
        dtype = str(tensor.dtype).removeprefix("torch.")
        node = ["tensor", None, list(tensor.shape), dtype, lazy, kind, validated]
        index = len(state.blobs)
        try:
            state.blobs.append(tensor_record(tensor, f"{state.submission_id}:tensor:{index}", kind=kind))
        except UnsupportedSchema as exc:
            raise TypeError(f"Unsupported durable tensor dtype {dtype} (field kind {kind!r}): {exc}") from exc
        state.blob_nodes.append((node, index))
        state.aliases[key] = node
        return node

    @staticmethod
    def _numbers_node(value: list | tuple, state: _Encoding) -> list | None:
        """An arena slice for a homogeneous int or float list; None when it must stay in the JSON tree."""
        kinds = set(map(type, value))
        if kinds == {int}:
            kind = "int"
            try:
                array = np.array(value, dtype=np.int64)
            except OverflowError:
                return None
        elif kinds == {float}:
            kind, array = "float", np.array(value, dtype=np.float64)
        else:
            return None
        start = state.number_sizes[kind]
        state.numbers[kind].append(array)
        state.number_sizes[kind] = start + len(array)
        return ["numbers", "list" if isinstance(value, list) else "tuple", kind, start, start + len(array)]

    @staticmethod
    def _small_tensor_node(value: torch.Tensor, state: _Encoding) -> list:
        """A byte-arena slice holding a small tensor's raw bytes (see the module docstring)."""
        key = (id(value), "small")
        if key in state.aliases:
            return state.aliases[key]
        state.keep_alive.append(value)
        tensor = value.detach().cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else np.empty(0, dtype=np.uint8)
        start = state.number_sizes["bytes"]
        padding = -len(raw) % 8
        state.numbers["bytes"].append(raw)
        if padding:
            state.numbers["bytes"].append(np.zeros(padding, dtype=np.uint8))
        state.number_sizes["bytes"] = start + len(raw) + padding
        dtype = str(tensor.dtype).removeprefix("torch.")
        node = ["small-tensor", dtype, list(tensor.shape), start, start + len(raw)]
        state.aliases[key] = node
        return node

    def _number_arenas(self, state: _Encoding) -> dict[str, list]:
        """The tensor nodes of the int, float and bytes arenas that were filled (none when empty)."""
        nodes = {}
        for kind, arrays in state.numbers.items():
            if not arrays:
                continue
            values = np.concatenate(arrays)
            if kind == "int" and _INT32.min <= values.min() and values.max() <= _INT32.max:
                values = values.astype(np.int32)
            nodes[kind] = self._tensor_node(torch.from_numpy(values), state, lazy=True, kind=f"slime.numbers.{kind}")
        return nodes

    def _ref_node(self, value: Any, state: _Encoding, refs: Any) -> list:
        name = type(value).__name__
        if name not in refs.REF_CLASSES:
            raise TypeError(f"Unsupported durable reference type: {type(value).__module__}.{type(value).__qualname__}")
        extra = {}
        for item in dataclasses.fields(value):
            if item.name in ("manifest", "root"):
                continue
            field_value = getattr(value, item.name)
            if item.name == "path" and not field_value:
                continue
            if item.name == "sample_metadata" and field_value is None:
                continue
            if item.name == "receipt" and field_value is not None:
                field_value = dataclasses.asdict(field_value)
            extra[item.name] = field_value
        return ["rollout-ref", name, state.dependency(value.manifest), self._node(extra, state)]

    def _sample_node(self, sample: Sample, state: _Encoding) -> list:
        validated = self._prepare_sample(sample)
        state.tokens += len(sample.tokens or ())
        items = []
        for key, value in vars(sample).items():
            if key in REPLAY_FIELDS and value is not None:
                node = self._replay_node(sample, key, value, key in validated, state)
            else:
                node = self._node(value, state)
            items.append([key, node])
        return ["dict", items]

    def _replay_node(self, sample: Sample, key: str, value: Any, validated: bool, state: _Encoding) -> list:
        if isinstance(value, TensorRef):
            return self._tensor_node(value, state, lazy=True, kind=key, validated=validated or value.validated)
        if key == "rollout_routed_experts":
            tensor = _routed_experts(sample)
        else:
            tensor = _replay_tensor(key, value)
            if validated or tensor.numel() == 0:
                tensor = tensor.to(torch.float32 if key.endswith("log_probs") else torch.int32)
        return self._tensor_node(tensor, state, lazy=True, kind=key, validated=validated)

    def _prepare_sample(self, sample: Sample) -> set[str]:
        """Validate the replay captures that training will use; returns the validated field names."""
        args = self.args
        if args is None or sample.status not in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
            return set()
        validated: set[str] = set()
        if getattr(args, "use_rollout_routing_replay", False) and sample.rollout_routed_experts is not None:
            if sample.loss_mask is None or any(sample.loss_mask):
                from slime.observability.rollout_data_utils import validate_rollout_routed_experts_for_replay

                value = sample.rollout_routed_experts
                if not isinstance(value, TensorRef):
                    value = _routed_experts(sample)
                validate_rollout_routed_experts_for_replay(
                    value,
                    num_layers=getattr(args, "num_layers", None),
                    moe_router_topk=getattr(args, "moe_router_topk", None),
                    expected_rows=max(0, len(sample.tokens) - 1),
                )
                validated.add("rollout_routed_experts")
        if getattr(args, "use_score_centering", False):
            top_p = getattr(args, "rollout_top_p", 1.0)
            fields = _TOP_P_FIELDS if top_p is not None and top_p < 1 else _TOP_K_FIELDS
            if all(getattr(sample, name) is None for name in fields):
                if sample.response_length > 0 or fields is _TOP_K_FIELDS:
                    return validated
                sample.rollout_top_p_token_ids = torch.empty(0, dtype=torch.int32)
                sample.rollout_top_p_token_offsets = torch.zeros(1, dtype=torch.int32)
                sample.rollout_top_p_log_probs = torch.empty(0, dtype=torch.float32)
            _validate_score_capture(sample, fields, getattr(args, "score_centering_top_k", None))
            validated.update(fields)
        return validated

    # ----------------------------------------------------------------------------------------- load

    def load(self, ref: RecordSetRef, *, reader: Any = None, selection: dict | None = None) -> Any:
        """Decode the value published as `ref` (see the module docstring for laziness and aliasing)."""
        if reader is None:
            with self.store.read_session() as session:
                return self.load(ref, reader=session, selection=selection)
        if reader.run_id != self.store.run_id or reader.backend.root != self.store.backend.root:
            raise InvalidReference(
                f"Reader for run {reader.run_id!r} at {reader.backend.root} cannot decode data of run "
                f"{self.store.run_id!r} at {self.store.backend.root}"
            )
        records = list(reader.read(ref))
        if len(records) != 1 or records[0].codec != "slime.v1":
            raise UnsupportedSchema("Expected one slime.v1 collection record")
        payload = bytes(records[0].payload)
        if payload.startswith(_ZSTD_MAGIC):
            import zstandard

            try:
                payload = zstandard.ZstdDecompressor().decompress(payload)
            except zstandard.ZstdError as exc:
                raise CorruptData(f"Invalid zstd slime.v1 record in {ref.manifest.segment.path}: {exc}") from exc
        document = decode(payload)
        if not isinstance(document, dict) or document.get("version") != TREE_VERSION or "tree" not in document:
            raise UnsupportedSchema(
                f"Unsupported slime.v1 record version in {ref.manifest.segment.path}: expected {TREE_VERSION}"
            )
        numbers = document.get("numbers", {})
        if not isinstance(numbers, dict) or not set(numbers) <= set(_NUMBER_DTYPES):
            raise CorruptData(
                f"Malformed slime.v1 number arenas in {ref.manifest.segment.path}: expected an object with keys "
                f"from {sorted(_NUMBER_DTYPES)}, got {str(numbers)[:200]}"
            )
        dependencies = [RecordSetRef.from_dict(dep) for dep in reader.manifest(ref)["dependencies"]]
        decoder = _Decoder(self.store, reader, dependencies, numbers)
        tree = document["tree"]
        if selection is None:
            return decoder.visit(tree)
        decoder.whole_arenas = False
        return decoder.select(tree, selection)


class _Decoder:
    """Decodes one tree; caches tensor lookups per dependency and aliases per location."""

    def __init__(self, store: Any, reader: Any, dependencies: list[RecordSetRef], numbers: dict) -> None:
        self.store, self.reader, self.dependencies = store, reader, dependencies
        self.members: dict[int, dict[int, TensorRef]] = {}
        self.aliases: dict[tuple[str, bool], Any] = {}
        self.number_nodes, self.arenas = numbers, {}
        self.byte_ranges: list[tuple[int, int, Any]] = []
        #: A full decode reads each arena whole; a column selection reads only the byte ranges it needs.
        self.whole_arenas = True

    def dependency(self, index: Any) -> RecordSetRef:
        if type(index) is not int or not 0 <= index < len(self.dependencies):
            raise CorruptData(f"slime.v1 tree names dependency {index!r} outside its manifest")
        return self.dependencies[index]

    def select(self, tree: Any, selection: dict) -> dict:
        if not (isinstance(tree, list) and tree and tree[0] == "dict"):
            raise ValueError("A column selection needs a dict-rooted rollout payload")
        result = {}
        for key_node, value_node in tree[1]:
            key = self.visit(key_node)
            if key not in selection:
                continue
            indices = selection[key]
            if indices is None:
                result[key] = self.visit(value_node)
            elif isinstance(value_node, list) and value_node and value_node[0] in ("list", "tuple"):
                self.prefetch_small([value_node[1][i] for i in indices])
                items = [self.visit(value_node[1][i]) for i in indices]
                result[key] = tuple(items) if value_node[0] == "tuple" else items
            elif isinstance(value_node, list) and value_node and value_node[0] == "numbers":
                values = self.visit(value_node)
                items = [values[i] for i in indices]
                result[key] = tuple(items) if isinstance(values, tuple) else items
            else:
                result[key] = self.visit(value_node)[list(indices)]
        return result

    def visit(self, node: Any) -> Any:
        if not isinstance(node, list):
            if isinstance(node, dict):
                raise CorruptData("slime.v1 tree holds an untagged object")
            return node
        if not node:
            raise CorruptData("slime.v1 tree holds an empty node")
        tag = node[0]
        try:
            if tag == "dict":
                return {self.visit(k): self.visit(v) for k, v in node[1]}
            if tag == "list":
                return [self.visit(item) for item in node[1]]
            if tag == "tuple":
                return tuple(self.visit(item) for item in node[1])
            if tag == "numbers":
                return self.numbers(node)
            if tag == "small-tensor":
                return self.small_tensor(node)
            if tag == "float":
                return float(node[1])
            if tag == "tensor":
                return self.tensor(node)
            if tag == "ndarray":
                value = self.visit(node[1])
                return (value.load(reader=self.reader) if isinstance(value, TensorRef) else value).numpy()
            if tag == "bytes":
                return base64.b64decode(node[1], validate=True)
            if tag == "status":
                return Sample.Status(node[1])
            if tag == "record-set":
                dependency = self.dependency(node[1])
                self.reader.validate(dependency)
                return dependency
            if tag == "rollout-ref":
                return self.rollout_ref(node)
            if tag == "sample":
                return self.sample(self.visit(node[1]))
            if tag == "spec-info":
                return Sample.SpecInfo(**self.visit(node[1]))
            if tag == "prefix-cache-info":
                return Sample.PrefixCacheInfo(**self.visit(node[1]))
            if tag == "dynamic-filter":
                from slime.rollout.filter_hub.base_types import DynamicFilterOutput

                return DynamicFilterOutput(**self.visit(node[1]))
            if tag == "image-png":
                from PIL import Image

                image = Image.open(io.BytesIO(base64.b64decode(node[1], validate=True)))
                image.load()
                return image
        except (IndexError, TypeError, ValueError, KeyError) as exc:
            raise CorruptData(f"Malformed slime.v1 {tag!r} node: {exc}") from exc
        raise UnsupportedSchema(f"Unknown slime.v1 tree tag {tag!r}")

    def tensor(self, node: list) -> Any:
        _, location, shape, dtype, lazy, kind, validated = node
        key = (encode(location).decode(), bool(lazy))
        if key in self.aliases:
            return self.aliases[key]
        index, ordinal = location["dependency"], location["ordinal"]
        dependency = self.dependency(index)
        if index not in self.members:
            self.members[index] = TensorRef.from_record_set_many(self.store, dependency, reader=self.reader)
        member = self.members[index].get(ordinal)
        if member is None:
            raise CorruptData(f"slime.v1 tensor node names ordinal {ordinal!r} that is not a tensor record")
        if list(member.shape) != list(shape) or member.dtype != dtype:
            raise CorruptData(
                f"Tensor record {member.path} is {member.dtype}{list(member.shape)}, tree expects {dtype}{shape}"
            )
        member = dataclasses.replace(member, validated=bool(validated), kind=kind)
        value = member if lazy else member.load(reader=self.reader)
        self.aliases[key] = value
        return value

    def numbers(self, node: list) -> list | tuple:
        _, container, kind, start, stop = node
        if container not in ("list", "tuple"):
            raise CorruptData(f"slime.v1 numbers node has container {container!r}")
        values = self.arena(kind)
        if type(start) is not int or type(stop) is not int or not 0 <= start <= stop <= len(values):
            raise CorruptData(f"slime.v1 numbers node range {start!r}:{stop!r} is outside the {kind} arena")
        items = values[start:stop].tolist()
        return items if container == "list" else tuple(items)

    def small_tensor(self, node: list) -> torch.Tensor:
        _, dtype, shape, start, stop = node
        key = ("small", start, stop, dtype)
        if key in self.aliases:
            return self.aliases[key]
        torch_dtype = getattr(torch, dtype, None)
        if torch_dtype not in _SMALL_TENSOR_DTYPES:
            raise CorruptData(f"slime.v1 small-tensor node has unknown dtype {dtype!r}")
        raw = bytearray(self.arena_bytes(start, stop))
        flat = torch.frombuffer(raw, dtype=torch_dtype) if raw else torch.empty(0, dtype=torch_dtype)
        tensor = self.aliases[key] = flat.reshape(shape)
        return tensor

    def arena_bytes(self, start: Any, stop: Any) -> bytes:
        """Bytes `start:stop` of the bytes arena: from the whole arena when a full decode read it, from a
        range `prefetch_small` read, or else read on their own (a column selection reads only its rows)."""
        if type(start) is not int or type(stop) is not int or not 0 <= start <= stop:
            raise CorruptData(f"slime.v1 small-tensor node range {start!r}:{stop!r} is invalid")
        if self.whole_arenas or "bytes" in self.arenas:
            values = self.arena("bytes")
            if stop > len(values):
                raise CorruptData(f"slime.v1 small-tensor node range {start}:{stop} is outside the bytes arena")
            return values[start:stop].tobytes()
        for first, last, payload in self.byte_ranges:
            if first <= start and stop <= last:
                return bytes(payload[start - first : stop - first])
        self.read_byte_ranges([(start, stop)])
        return self.arena_bytes(start, stop)

    def prefetch_small(self, nodes: list) -> None:
        """Read the arena bytes of these nodes' small tensors, each run of adjacent slices in one read."""
        wanted = sorted({(n[3], n[4]) for n in nodes if isinstance(n, list) and n and n[0] == "small-tensor"})
        if wanted and not self.whole_arenas and "bytes" not in self.arenas:
            self.read_byte_ranges(wanted)

    def read_byte_ranges(self, ranges: list[tuple[int, int]]) -> None:
        if "bytes" not in self.number_nodes:
            raise CorruptData("slime.v1 tree uses the bytes arena but the document has none")
        ref = self.visit(self.number_nodes["bytes"])
        if not isinstance(ref, TensorRef) or ref.dtype != "uint8" or len(ref.shape) != 1:
            raise CorruptData("slime.v1 bytes arena is not a 1-D uint8 tensor")
        merged: list[list[int]] = []
        for start, stop in ranges:
            if stop > ref.nbytes:
                raise CorruptData(f"slime.v1 small-tensor node range {start}:{stop} is outside the bytes arena")
            if merged and start <= merged[-1][1] + (-merged[-1][1] % 8):  # adjacent slices (8-byte aligned)
                merged[-1][1] = max(merged[-1][1], stop)
            else:
                merged.append([start, stop])
        expected = {"shape": list(ref.shape), "dtype": ref.dtype, "length": ref.nbytes}
        for start, stop in merged:
            _, payload = self.reader.read_tensor_range(ref.record_ref, start, stop, expected=expected)
            self.byte_ranges.append((start, stop, payload))

    def arena(self, kind: str) -> np.ndarray:
        """The `kind` number arena, read once through the reader (never through `TensorRef.load`)."""
        if kind in self.arenas:
            return self.arenas[kind]
        if kind not in self.number_nodes:
            raise CorruptData(f"slime.v1 tree uses the {kind!r} number arena but the document has none")
        ref = self.visit(self.number_nodes[kind])
        if not isinstance(ref, TensorRef) or ref.dtype not in _NUMBER_DTYPES[kind] or len(ref.shape) != 1:
            raise CorruptData(f"slime.v1 {kind} number arena is not a 1-D {'/'.join(_NUMBER_DTYPES[kind])} tensor")
        _, payload = self.reader.read_tensor_range(
            ref.record_ref, 0, ref.nbytes, expected={"shape": list(ref.shape), "dtype": ref.dtype, "length": ref.nbytes}
        )
        values = self.arenas[kind] = np.frombuffer(payload, dtype=ref.dtype)
        return values

    def rollout_ref(self, node: list) -> Any:
        from straw.protocol import CommitReceipt

        from slime.data import refs

        _, name, index, extra_node = node
        cls = refs.REF_CLASSES.get(name)
        if cls is None:
            raise UnsupportedSchema(f"Unknown durable reference class {name!r} in slime.v1 tree")
        extra = self.visit(extra_node)
        if extra.get("receipt") is not None:
            extra["receipt"] = CommitReceipt.from_dict(extra["receipt"])
        return cls(manifest=self.dependency(index), root=str(self.store.backend.root), **extra)

    @staticmethod
    def sample(values: dict) -> Sample:
        known = {item.name for item in dataclasses.fields(Sample)}
        sample = Sample(**{key: value for key, value in values.items() if key in known})
        for key, value in values.items():
            if key not in known:
                setattr(sample, key, value)
        return sample


def _routed_experts(sample: Sample) -> torch.Tensor:
    """The routed experts as one CPU tensor, without the copy `materialize_rollout_routed_experts` makes of a tensor.

    Publication only reads the bytes (straw hashes and writes them from a view), so copying a tensor here
    would cost a memcpy and one extra copy of the payload in memory.
    """
    value = sample.rollout_routed_experts
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return sample.materialize_rollout_routed_experts(replace=False)


def _numpy_tensor(value: np.ndarray) -> torch.Tensor:
    if value.dtype == object:
        raise TypeError("Unsupported durable Sample field type: numpy.ndarray of Python objects")
    return torch.from_numpy(np.array(value, copy=True))


def _replay_tensor(key: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    try:
        array = np.asarray(value)
    except ValueError as exc:
        raise TypeError(f"Sample.{key} must be a rectangular numeric array: {exc}") from exc
    if array.dtype == object:
        raise TypeError(f"Sample.{key} must be a rectangular numeric array, got ragged or non-numeric values")
    return torch.from_numpy(array.copy())


def _validate_score_capture(sample: Sample, fields: tuple[str, ...], top_k: int | None) -> None:
    """Check top-k pairs / top-p triples against the response length before training uses them."""
    rows = sample.response_length
    values = {name: _as_tensor(name, getattr(sample, name)) for name in fields}
    if fields is _TOP_K_FIELDS:
        ids, log_probs = values["rollout_topk_token_ids"], values["rollout_topk_log_probs"]
        for name, tensor in values.items():
            if tensor is None:
                raise ValueError(f"Score centering needs Sample.{name}; the engine did not return it")
            if tensor.dim() != 2 or tensor.shape[0] != rows or (top_k is not None and tensor.shape[1] != top_k):
                raise ValueError(
                    f"Sample.{name} has shape {tuple(tensor.shape)}; expected ({rows}, {top_k}) for "
                    f"response_length={rows} and args.score_centering_top_k={top_k}"
                )
        if ids.shape != log_probs.shape:
            raise ValueError("Sample top-k token ids and log-probs differ in shape")
        return
    ids, offsets, log_probs = (values[name] for name in _TOP_P_FIELDS)
    if ids is None or offsets is None or log_probs is None:
        raise ValueError("Score centering with --rollout-top-p < 1 needs token ids, offsets and log-probs")
    if ids.dim() != 1 or log_probs.shape != ids.shape:
        raise ValueError("Sample top-p token ids and log-probs must be equal-length 1-D arrays")
    if offsets.dim() != 1 or offsets.shape[0] != rows + 1:
        raise ValueError(f"Sample.rollout_top_p_token_offsets must hold response_length + 1 = {rows + 1} entries")
    if offsets[0] != 0 or offsets[-1] != ids.shape[0] or bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError("Sample.rollout_top_p_token_offsets must rise from 0 to the number of token ids")


def _as_tensor(name: str, value: Any) -> torch.Tensor | None:
    if value is None:
        return None
    if isinstance(value, TensorRef):
        return value.load()
    return _replay_tensor(name, value)
