"""The straw facade beyond the shared conformance suite: writer cache, pool resolution, queue context on
groups, async publication, rollout output normalisation, tensorization and `.pt` debug dumps."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from straw.protocol import CommitReceipt

from slime.data import transport
from slime.data.tensor import TensorRef
from slime.data.transport import (
    RawRolloutRef,
    RolloutGroupRef,
    group_lease,
    inherit_queue_context,
    load_rollout_samples,
    pack_rollout_group,
    pack_rollout_payload,
    record_generation_provenance,
    resolve_rollout_data_dir,
    rollout_store,
    run_rollout_io,
    unpack_published_payload,
)
from slime.observability.rollout_data_utils import (
    load_debug_rollout_data,
    save_debug_rollout_data,
    tensorize_rollout_data_for_training,
    validate_rollout_id_annotated,
)
from slime.rollout.base_types import (
    RolloutFnEvalOutput,
    RolloutFnTrainOutput,
    call_rollout_fn,
    finalize_rollout_groups,
    iter_samples,
)
from slime.utils.types import Sample

LEASE = {
    "run_id": "rollout",
    "queue_id": "q",
    "task_id": "prompt:1",
    "attempt_id": "a1",
    "generation": 1,
    "coordinator_epoch": "e",
    "token": "t",
    "worker_id": "w",
}


@pytest.fixture
def args(tmp_path):
    return SimpleNamespace(rollout_data_transport="straw", rollout_data_dir=str(tmp_path / "pool"), save=None)


def test_the_run_transport_comes_from_the_registry(args):
    from slime.interfaces import run_transport
    from slime.transports.nixl import NixlTransport
    from slime.transports.object_store import InMemoryTransport
    from slime.transports.straw import StrawTransport

    assert type(run_transport(args)) is StrawTransport
    assert type(run_transport(SimpleNamespace())) is InMemoryTransport  # object-store is the default
    assert type(run_transport(SimpleNamespace(rollout_data_transport="nixl"))) is NixlTransport
    value = [[Sample()]]
    session = run_transport(SimpleNamespace(rollout_data_transport="object-store")).rollout_session(None)
    assert session.publish_batch(value, 0) is value


def test_writer_is_cached_per_configuration_with_a_fresh_codec(args):
    store, codec, lock = rollout_store(args)
    again, other_codec, same_lock = rollout_store(args)
    assert again is store and same_lock is lock and other_codec is not codec
    other_run, _, _ = rollout_store(SimpleNamespace(**{**vars(args), "rollout_queue_run_id": "other"}))
    assert other_run is not store and other_run.run_id == "other"


def test_pool_resolution_binds_to_the_archive_index(tmp_path):
    index = {"format": "slime.straw-debug", "version": 1, "root": str(tmp_path / "pool")}
    index["manifest"] = {"manifest": {"segment": {"run_id": "archived-run"}}}
    for step in (3, 12):
        (tmp_path / f"rollout_{step:07d}.straw.json").write_text(json.dumps({**index, "rollout_id": step}))
    args = SimpleNamespace(
        rollout_data_dir="/elsewhere",
        rollout_queue_run_id="mine",
        load_debug_rollout_data=str(tmp_path / "rollout_{rollout_id:07d}.straw.json"),
        start_rollout_id=None,
    )
    resolve_rollout_data_dir(args)
    assert (args.rollout_data_dir, args.rollout_queue_run_id) == (str(tmp_path / "pool"), "archived-run")
    args.load_debug_rollout_data = str(tmp_path / "missing_{rollout_id}.straw.json")
    with pytest.raises(FileNotFoundError, match="No Straw rollout archive matches"):
        resolve_rollout_data_dir(args)
    (tmp_path / "bad.straw.json").write_text(json.dumps({"format": "other", "version": 1}))
    args.load_debug_rollout_data = str(tmp_path / "bad.straw.json")
    with pytest.raises(ValueError, match="Unsupported straw rollout archive"):
        resolve_rollout_data_dir(args)


def test_group_lease_must_be_shared_and_needs_a_coordinator(args):
    first, second = Sample(index=1), Sample(index=2)
    first._queue_lease = second._queue_lease = LEASE
    assert group_lease([[first], [second]]).attempt_id == "a1"
    assert group_lease([Sample()]) is None
    second._queue_lease = {**LEASE, "attempt_id": "a2"}
    with pytest.raises(ValueError, match="one task authorization"):
        group_lease([first, second])
    with pytest.raises(ValueError, match="no coordinator binding"):
        pack_rollout_group([first], args, 0)


def test_generation_provenance_and_inherited_queue_context():
    sample = Sample(tokens=[1, 2, 3, 4], weight_versions=["7"])
    sample._queue_generation_start, sample._queue_branch = 2, "branch-a"
    record_generation_provenance([sample])
    assert sample.queue_policy_segments == [
        {"start": 0, "stop": 2, "branch": None, "reported_versions": None},
        {"start": 2, "stop": 4, "branch": "branch-a", "reported_versions": ["7"]},
    ]
    assert sample._queue_generation_start == 4
    source = Sample()
    source._queue_lease = LEASE
    produced = [Sample(), Sample()]
    assert inherit_queue_context(source, produced) is produced
    assert all(s._queue_lease == LEASE for s in produced)
    stranger = Sample()
    stranger._queue_lease = {**LEASE, "attempt_id": "other"}
    with pytest.raises(ValueError, match="different queue task authorization"):
        inherit_queue_context(source, [stranger])


def test_loaded_groups_carry_receipts_and_expand_chunk_refs(args):
    leased = Sample(index=4)
    leased._queue_lease = LEASE
    published = pack_rollout_payload([leased], args, 0)
    receipt = CommitReceipt("c1", "prompt:1", "group:a1", "d", 6, published.manifest)
    group = RolloutGroupRef(published.manifest, published.root, 4, receipt, (2, 3))
    chunk = pack_rollout_payload([Sample(index=10), Sample(index=11)], args, 0)
    batch = pack_rollout_payload([group, [chunk, Sample(index=12)]], args, 0)
    [receipted, expanded] = load_rollout_samples(batch)
    assert not hasattr(receipted[0], "_queue_lease")
    assert receipted[0]._queue_receipt == dataclasses.asdict(receipt)
    assert receipted[0]._queue_source_positions == [2, 3]
    assert [s.index for s in expanded] == [10, 11, 12]


def test_async_publication_looks_up_the_module_and_never_abandons_a_write(args, monkeypatch):
    monkeypatch.setattr(transport, "pack_rollout_group", lambda group, *a, **kw: ("patched", group))

    async def scenario():
        assert await transport.publish_rollout_async(["g"], args, 0, group=True) == ("patched", ["g"])
        finished = []

        def slow_write():
            time.sleep(0.3)
            finished.append(True)

        task = asyncio.ensure_future(run_rollout_io(args, slow_write))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished == [True]
        reference = await transport.publish_rollout_async({"x": 1}, args, 0)
        assert await unpack_published_payload(reference) == {"x": 1}

    asyncio.run(scenario())


def test_batch_sorting_and_plain_transport_pass_through():
    groups = [[Sample(index=3)], [Sample(index=None)], [Sample(index=1)]]
    output = finalize_rollout_groups(SimpleNamespace(rollout_sample_filter_path=None), 0, groups, {"m": 1})
    assert [group[0].index for group in output.samples] == [None, 1, 3]
    assert output.metrics == {"m": 1}
    assert [s.index for s in iter_samples([[Sample(index=1)], (Sample(index=2),)])] == [1, 2]


def test_rollout_outputs_are_normalised_or_refused(args):
    ref = pack_rollout_payload([Sample()], args, 0)
    assert call_rollout_fn(lambda evaluation: [1], evaluation=False) == RolloutFnTrainOutput(samples=[1])
    assert call_rollout_fn(lambda evaluation: ref, evaluation=False).samples is ref
    assert call_rollout_fn(lambda evaluation: {"d": 1}, evaluation=True) == RolloutFnEvalOutput(data={"d": 1})
    raw = RawRolloutRef(ref.manifest, ref.root, None)
    assert call_rollout_fn(lambda evaluation: raw, evaluation=False) is raw
    with pytest.raises(TypeError, match="Unsupported rollout output"):
        call_rollout_fn(lambda evaluation: raw, evaluation=True)
    with pytest.raises(TypeError, match="Unsupported rollout output"):
        call_rollout_fn(lambda evaluation: "text", evaluation=False)
    with pytest.raises(TypeError, match="must be a list or DiskPayloadRef"):
        call_rollout_fn(lambda evaluation: RolloutFnTrainOutput(samples="x"), evaluation=False)


def test_tensorization_types_columns_and_keeps_stored_refs(args):
    stored = pack_rollout_payload(Sample(rollout_routed_experts=torch.zeros(2, 1, 1, dtype=torch.uint8)), args, 0)
    ref = stored.load().rollout_routed_experts
    data = tensorize_rollout_data_for_training(
        {
            "tokens": [[1, 2]],
            "loss_masks": [[1]],
            "rollout_top_p_log_probs": [[-0.5]],
            "rollout_top_p_token_offsets": [[0, 1]],
            "rollout_routed_experts": [ref],
            "multimodal_train_inputs": [None, {"pixels": torch.ones(2), "name": "x"}],
            "rollout_mask_sums": [1, 2],
        }
    )
    assert data["tokens"][0].dtype == torch.int64 and data["loss_masks"][0].dtype == torch.int32
    assert data["rollout_top_p_log_probs"][0].dtype == torch.float32
    assert data["rollout_top_p_token_offsets"][0].dtype == torch.int32
    assert data["rollout_routed_experts"][0] is ref and isinstance(ref, TensorRef)
    assert data["multimodal_train_inputs"][1]["name"] == "x"
    assert data["rollout_mask_sums"].dtype == torch.float32


def test_rollout_id_annotation_check():
    flat = [Sample(rollout_id=None), Sample(rollout_id=3)]
    assert validate_rollout_id_annotated(flat) is flat
    with pytest.raises(ValueError, match="rollout_id"):
        validate_rollout_id_annotated([[Sample(rollout_id=-1)]])
    with pytest.raises(TypeError, match="Sample leaves"):
        validate_rollout_id_annotated([{"not": "a sample"}])


def test_pt_debug_dump_is_self_contained_and_subsamples_head_and_tail(args, tmp_path):
    samples = [Sample(index=i, tokens=[i]) for i in range(10)]
    samples[0].rollout_routed_experts = (
        pack_rollout_payload(Sample(rollout_routed_experts=torch.ones(1, 1, 1, dtype=torch.int32)), args, 0)
        .load()
        .rollout_routed_experts
    )
    template = str(tmp_path / "dumps" / "rollout_{rollout_id}.pt")
    assert save_debug_rollout_data(None, samples, rollout_id=0, evaluation=False) is None
    path = save_debug_rollout_data(template, samples, rollout_id=0, evaluation=False)
    assert path == tmp_path / "dumps" / "rollout_0.pt" and list(path.parent.iterdir()) == [path]
    restored = load_debug_rollout_data(template, rollout_id=0)
    assert isinstance(restored[0].rollout_routed_experts, torch.Tensor)
    assert [s.index for s in load_debug_rollout_data(template, rollout_id=0, subsample_ratio=0.4)] == [0, 1, 8, 9]
    evaluation = {"math": {"samples": [Sample(index=1)]}, "code": {"samples": [Sample(index=2)]}}
    save_debug_rollout_data(template, evaluation, rollout_id=0, evaluation=True)
    assert [s.index for s in load_debug_rollout_data(template, rollout_id="eval_0")] == [1, 2]
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"samples": [SimpleNamespace()]}, unsafe)
    with pytest.raises(ValueError, match="objects other than tensors"):
        load_debug_rollout_data(str(unsafe), rollout_id=0)
    assert not list(Path(tmp_path / "dumps").glob("*.bin"))
