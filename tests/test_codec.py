"""SampleCodec specifics: the tree encoding, laziness and sharing, validation, bad input and compression."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from straw.errors import CorruptData, InvalidReference, UnsupportedSchema
from straw.protocol import Record, RecordSetRef, decode, encode
from straw.store import SharedFilesystemStore
from straw.tensor import TensorRef

from slime.data import codec as codec_module
from slime.data.codec import CODECS, SampleCodec
from slime.data.transport import DiskPayloadRef, RolloutGroupRef, pack_rollout_payload, rollout_store
from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.types import Sample


@pytest.fixture
def args(tmp_path):
    return SimpleNamespace(rollout_data_transport="straw", rollout_data_dir=str(tmp_path / "pool"))


def round_trip(value, args):
    return pack_rollout_payload(value, args, 0).load()


def record_payload(reference: DiskPayloadRef) -> bytes:
    [record] = list(reference.reader_store().read(reference.manifest))
    return bytes(record.payload)


def test_plain_values_keep_their_python_types(args):
    value = {
        1: ("a", None, True),
        "floats": [1.5, math.inf, -math.inf],
        "bytes": b"\x00\xff",
        "numpy": np.arange(3, dtype=np.int16),
        "scalar": np.float32(0.5),
        "status": Sample.Status.TRUNCATED,
        "filter": DynamicFilterOutput(keep=False, reason="all equal"),
    }
    restored = round_trip(value, args)
    assert list(restored) == [1, "floats", "bytes", "numpy", "scalar", "status", "filter"]
    assert restored[1] == ("a", None, True)
    assert restored["floats"] == [1.5, math.inf, -math.inf]
    assert restored["bytes"] == b"\x00\xff"
    assert isinstance(restored["numpy"], np.ndarray) and restored["numpy"].dtype == np.int16
    assert restored["numpy"].tolist() == [0, 1, 2]
    assert restored["scalar"] == 0.5
    assert restored["status"] is Sample.Status.TRUNCATED
    assert restored["filter"] == DynamicFilterOutput(keep=False, reason="all equal")
    assert math.isnan(round_trip(math.nan, args))


def test_sample_keeps_dynamic_attributes_and_makes_replay_fields_lazy(args):
    sample = Sample(index=3, tokens=[1, 2, 3], response_length=2, status=Sample.Status.COMPLETED, reward=0.5)
    sample.spec_info.spec_verify_ct = 4
    sample._queue_lease = {"task_id": "prompt:1"}
    sample.rollout_topk_token_ids = [[1, 2], [3, 4]]
    sample.rollout_routed_experts = torch.zeros((2, 1, 2), dtype=torch.uint8)
    sample.multimodal_train_inputs = {"pixels": torch.ones(2, 2)}
    [restored] = round_trip([sample], args)
    assert restored._queue_lease == {"task_id": "prompt:1"}
    assert restored.spec_info.spec_verify_ct == 4 and restored.status is Sample.Status.COMPLETED
    assert isinstance(restored.rollout_topk_token_ids, TensorRef)
    assert restored.rollout_topk_token_ids.kind == "rollout_topk_token_ids"
    # Without validation (no args), captures keep their natural dtype.
    assert restored.rollout_topk_token_ids.load().dtype == torch.int64
    assert restored.rollout_routed_experts.load().dtype == torch.uint8
    assert isinstance(restored.multimodal_train_inputs["pixels"], torch.Tensor)
    assert restored.rollout_routed_experts.path == restored.rollout_topk_token_ids.path


def test_same_pool_tensor_refs_are_shared_without_reading_bytes(args, monkeypatch):
    first = round_trip({"tensor": Sample(rollout_routed_experts=torch.arange(4096).reshape(4096, 1, 1))}, args)
    ref = first["tensor"].rollout_routed_experts
    store, _, _ = rollout_store(args)
    written = store.metrics["payload_bytes"]
    monkeypatch.setattr(TensorRef, "load", lambda *a, **kw: pytest.fail("shared tensor was read"))
    again = pack_rollout_payload({"again": ref}, args, 0)
    assert store.metrics["payload_bytes"] - written < 4096
    monkeypatch.undo()
    restored = again.load()["again"]
    assert restored.record_ref == ref.record_ref
    assert restored.load()[-1].item() == 4095


def test_selection_reads_only_selected_elements(args):
    reference = pack_rollout_payload({"rows": [torch.ones(2), torch.zeros(3)], "ids": torch.arange(5), "x": 1}, args, 0)
    selected = reference.load(selection={"rows": [1], "ids": [0, 4], "missing": None})
    assert set(selected) == {"rows", "ids"}
    assert [row.tolist() for row in selected["rows"]] == [[0, 0, 0]]
    assert selected["ids"].tolist() == [0, 4]
    with pytest.raises(ValueError, match="dict-rooted"):
        pack_rollout_payload([1], args, 0).load(selection={"rows": None})


def test_references_inside_values_round_trip_with_the_readers_root(args):
    group = pack_rollout_payload([Sample(index=1)], args, 0)
    ref = RolloutGroupRef(group.manifest, group.root, 1, None, (4, 5))
    restored = round_trip({"refs": [ref, group.manifest]}, args)
    assert restored["refs"][0] == ref
    assert restored["refs"][1] == group.manifest


def test_publish_many_returns_one_manifest_per_value(args):
    store, codec, lock = rollout_store(args)
    with lock:
        refs = codec.publish_many([{"a": torch.ones(2)}, [Sample(index=7)]], submission_ids=["one", "two"])
    assert codec.load(refs[0])["a"].tolist() == [1.0, 1.0]
    assert codec.load(refs[1])[0].index == 7
    with pytest.raises(ValueError, match="one submission id per value"):
        codec.publish_many([1], submission_ids=[])


def test_unsupported_types_and_cycles_are_rejected_before_writing(args):
    with pytest.raises(TypeError, match="Unsupported durable Sample field type: builtins.object"):
        pack_rollout_payload({"x": object()}, args, 0)
    cyclic: dict = {}
    cyclic["self"] = cyclic
    with pytest.raises(TypeError, match="Cyclic custom fields are not supported"):
        pack_rollout_payload(cyclic, args, 0)
    sample = Sample()
    sample.rollout_topk_token_ids = [[1], [2, 3]]
    with pytest.raises(TypeError, match="rectangular"):
        pack_rollout_payload(sample, args, 0)
    with pytest.raises(TypeError, match="Unsupported durable tensor dtype"):
        pack_rollout_payload(torch.zeros(2, dtype=torch.complex64), args, 0)
    assert not list(Path(args.rollout_data_dir).rglob("*.pack"))


def test_replay_validation_with_training_args(args):
    args.use_rollout_routing_replay = True
    args.num_layers, args.moe_router_topk = 2, 1
    sample = Sample(tokens=[1, 2, 3], response_length=2, status=Sample.Status.COMPLETED)
    sample.rollout_routed_experts = torch.zeros((2, 1, 1), dtype=torch.int32)
    with pytest.raises(ValueError, match="Routed experts have shape"):
        pack_rollout_payload(sample, args, 0)
    sample.rollout_routed_experts = torch.zeros((2, 2, 1), dtype=torch.int64)
    restored = round_trip(sample, args)
    assert restored.rollout_routed_experts.validated
    args.use_rollout_routing_replay = False
    args.use_score_centering, args.rollout_top_p = True, 0.9
    empty = Sample(tokens=[1], response_length=0, status=Sample.Status.COMPLETED)
    restored = round_trip(empty, args)
    assert restored.rollout_top_p_token_offsets.load().tolist() == [0]
    assert restored.rollout_top_p_log_probs.load().dtype == torch.float32
    bad = Sample(tokens=[1, 2], response_length=1, status=Sample.Status.COMPLETED)
    bad.rollout_top_p_token_ids, bad.rollout_top_p_token_offsets, bad.rollout_top_p_log_probs = [5], [0, 2], [-1.0]
    with pytest.raises(ValueError, match="offsets must rise"):
        pack_rollout_payload(bad, args, 0)


def publish_raw(store, payload: bytes, dependencies=()):
    return store.publish([Record("raw", payload, "slime.v1")], submission_id="raw", dependencies=dependencies)


def test_corrupt_and_foreign_records_fail_loudly(args):
    store, codec, lock = rollout_store(args)
    with lock:
        unknown = publish_raw(store, encode({"version": 1, "tree": ["mystery", 1]}))
        future = store.publish([Record("v2", encode({"version": 2, "tree": 1}), "slime.v1")], submission_id="v2")
        dangling = store.publish(
            [Record("d", encode({"version": 1, "tree": ["record-set", 3]}), "slime.v1")], submission_id="d"
        )
        not_json = store.publish([Record("j", b"\xff", "slime.v1")], submission_id="j")
        plain = store.publish([Record("b", b"bytes")], submission_id="b")
    with pytest.raises(UnsupportedSchema, match="Unknown slime.v1 tree tag"):
        codec.load(unknown)
    with pytest.raises(UnsupportedSchema, match="version"):
        codec.load(future)
    with pytest.raises(CorruptData, match="dependency"):
        codec.load(dangling)
    with pytest.raises(CorruptData):
        codec.load(not_json)
    with pytest.raises(UnsupportedSchema, match="Expected one slime.v1 collection record"):
        codec.load(plain)


@pytest.mark.slow  # straw retries a failed checksum for ~4 s (shared-filesystem visibility) before giving up
def test_flipped_pack_bytes_are_detected(args):
    reference = pack_rollout_payload({"text": "y" * 4096}, args, 0)
    [pack] = Path(args.rollout_data_dir).rglob("*.pack")
    data = bytearray(pack.read_bytes())
    position = data.find(b"y" * 64)
    data[position] = ord("z")
    pack.write_bytes(bytes(data))
    with pytest.raises(CorruptData):
        reference.load()


def test_reader_of_another_run_is_refused(args, tmp_path):
    store, codec, _ = rollout_store(args)
    reference = pack_rollout_payload({"x": 1}, args, 0)
    other = SharedFilesystemStore(args.rollout_data_dir, "another-run", codecs=CODECS)
    with other.read_session() as reader, pytest.raises(InvalidReference, match="another-run"):
        codec.load(reference.manifest, reader=reader)


def test_store_codecs_and_host_byte_order_are_checked(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="requires explicit slime.v1 and tensor.v1 store codecs"):
        SampleCodec(SharedFilesystemStore(tmp_path, "run"))
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(UnsupportedSchema, match="little-endian"):
        SampleCodec(SharedFilesystemStore(tmp_path, "run", codecs=CODECS))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_compression_is_optional_and_self_describing(args, compression):
    args.rollout_data_compression = compression
    value = {"text": "abc" * 100_000, "tensor": torch.arange(8)}
    reference = pack_rollout_payload(value, args, 0)
    payload = record_payload(reference)
    if compression is None:
        assert decode(payload)["version"] == 1
        assert len(payload) > 300_000
    else:
        assert payload[:4] == b"\x28\xb5\x2f\xfd"
        assert len(payload) < 10_000
    # Loading needs no compression flag: the record says what it is.
    restored = reference.load()
    assert restored["text"] == value["text"] and restored["tensor"].tolist() == list(range(8))


def test_unknown_compression_is_refused(args):
    args.rollout_data_compression = "lz4"
    with pytest.raises(ValueError, match="rollout-data-compression"):
        pack_rollout_payload({"x": 1}, args, 0)


@pytest.mark.slow
def test_more_tensors_than_one_publication_holds(args):
    from straw.store import MAX_RECORDS

    value = [torch.tensor([i]) for i in range(MAX_RECORDS + 500)]
    restored = round_trip(value, args)
    assert len(restored) == len(value)
    assert [restored[i].item() for i in (0, MAX_RECORDS - 2, MAX_RECORDS - 1, len(value) - 1)] == [
        0,
        MAX_RECORDS - 2,
        MAX_RECORDS - 1,
        len(value) - 1,
    ]


def types_of(value):
    """The Python type of `value` and, for lists and tuples, of every element (recursively)."""
    if isinstance(value, (list, tuple)):
        return type(value), [types_of(item) for item in value]
    return type(value)


def test_long_numeric_lists_go_to_arenas_and_keep_their_python_types(args, monkeypatch):
    tokens = list(range(100_000, 104_096))
    log_probs = [-0.5, -0.0, math.inf, 1e-310] + [-(i / 7) for i in range(60)]
    value = {
        "tokens": tokens,
        "log_probs": log_probs,
        "ids": tuple(range(20)),
        "wide": [2**40 + i for i in range(16)],
        "huge": [2**64] * 16,
        "flags": [True, False] * 8,
        "mixed": [1, 2.5] * 8,
        "short": [1, 2, 3],
        "nested": [[7] * 16, [0.25] * 16],
        "nan": [math.nan] * 16,
    }
    reference = pack_rollout_payload(value, args, 0)
    document = decode(record_payload(reference))
    tree = dict((key, node) for key, node in document["tree"][1])
    assert set(document["numbers"]) == {"int", "float"}
    assert tree["tokens"][0] == tree["log_probs"][0] == tree["ids"][0] == tree["wide"][0] == "numbers"
    assert tree["short"][0] == tree["flags"][0] == tree["mixed"][0] == tree["huge"][0] == "list"
    # The ints need int64 once one of them does; the floats are float64, so every bit survives.
    assert document["numbers"]["int"][3] == "int64" and document["numbers"]["float"][3] == "float64"
    assert len(record_payload(reference)) < 4096
    monkeypatch.setattr(TensorRef, "load", lambda *a, **kw: pytest.fail("number arenas must not need TensorRef.load"))
    restored = reference.load()
    for key, expected in value.items():
        assert types_of(restored[key]) == types_of(expected), key
        if key != "nan":
            assert restored[key] == expected, key
    assert [math.copysign(1, item) for item in restored["log_probs"][:2]] == [-1, -1]
    assert restored["log_probs"][3] == 1e-310 and all(math.isnan(item) for item in restored["nan"])


def test_int32_arena_and_selection_of_a_numeric_column(args):
    reference = pack_rollout_payload({"rewards": [float(i) for i in range(32)], "ids": list(range(40))}, args, 0)
    assert decode(record_payload(reference))["numbers"]["int"][3] == "int32"
    selected = reference.load(selection={"rewards": [1, 31], "ids": [0, 39]})
    assert selected == {"rewards": [1.0, 31.0], "ids": [0, 39]}


def test_corrupt_number_nodes_fail_loudly(args):
    store, codec, lock = rollout_store(args)
    good = pack_rollout_payload(list(range(32)), args, 0)
    document = decode(record_payload(good))
    dependencies = [RecordSetRef.from_dict(dep) for dep in store.manifest(good.manifest)["dependencies"]]
    int_arena = document["numbers"]["int"]
    cases = {
        "outside the int arena": {**document, "tree": ["numbers", "list", "int", 0, 33]},
        "has none": {**document, "tree": ["numbers", "list", "float", 0, 1]},
        "container": {**document, "tree": ["numbers", "set", "int", 0, 1]},
        "number arenas": {**document, "numbers": ["int"]},
        "not a 1-D float64": {**document, "numbers": {"float": int_arena}, "tree": ["numbers", "list", "float", 0, 1]},
    }
    for index, (message, bad) in enumerate(cases.items()):
        with lock:
            ref = store.publish(
                [Record(f"bad-{index}", encode(bad), "slime.v1")],
                submission_id=f"bad-{index}",
                dependencies=dependencies,
            )
        with pytest.raises(CorruptData, match=message):
            codec.load(ref)


def test_routed_experts_are_published_from_the_samples_own_tensor(args, monkeypatch):
    """No copy of the capture before writing: publication reads the tensor's bytes where they are."""
    sample = Sample(tokens=[1, 2, 3], response_length=2, status=Sample.Status.COMPLETED)
    sample.rollout_routed_experts = torch.arange(16, dtype=torch.int32).reshape(2, 2, 4)
    monkeypatch.setattr(torch.Tensor, "clone", lambda *a, **kw: pytest.fail("routed experts were copied"))
    reference = pack_rollout_payload(sample, args, 0)
    monkeypatch.undo()
    assert reference.load().rollout_routed_experts.load().tolist() == sample.rollout_routed_experts.tolist()
    transposed = Sample(tokens=[1, 2, 3], response_length=2, status=Sample.Status.COMPLETED)
    transposed.rollout_routed_experts = torch.arange(16, dtype=torch.int32).reshape(4, 2, 2).transpose(0, 2)
    restored = round_trip(transposed, args).rollout_routed_experts.load()
    assert torch.equal(restored, transposed.rollout_routed_experts)


def test_small_tensors_share_one_arena_record_and_round_trip(args):
    shared = torch.arange(6).reshape(2, 3)
    value = {
        "tokens": [torch.arange(n) for n in (3, 5, 1)],
        "mask": torch.tensor([True, False, True]),
        "half": torch.ones(3, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "transposed": shared.t(),
        "same": [shared, shared],
        "large": torch.zeros(codec_module.SMALL_TENSOR_BYTES // 4 + 1),
    }
    reference = pack_rollout_payload(value, args, 0)
    manifest = reference.reader_store().manifest(reference.manifest)
    # One publication of tensor records: the bytes arena and the one tensor above the size limit.
    [blobs] = [RecordSetRef.from_dict(dep) for dep in manifest["dependencies"]]
    assert len(list(reference.reader_store().read(blobs))) == 2
    restored = reference.load()
    for key in ("mask", "half", "scalar", "empty", "transposed", "large"):
        assert restored[key].dtype == value[key].dtype and torch.equal(restored[key], value[key]), key
    assert [t.tolist() for t in restored["tokens"]] == [[0, 1, 2], [0, 1, 2, 3, 4], [0]]
    assert restored["same"][0] is restored["same"][1], "one tensor stored twice decodes as one tensor"
    restored["tokens"][0].add_(1)  # decoded tensors own writable memory
    assert reference.load()["tokens"][0].tolist() == [0, 1, 2]
