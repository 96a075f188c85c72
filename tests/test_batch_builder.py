"""BatchBuilder, the data-parallel schedule and process_rollout_data: replay, isolation, schedule rules."""

from contextlib import closing
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import straw.tensor
from fakes import local_actor_handle

from slime.data import batch_builder as module
from slime.data.queue_data_source import RolloutQueueController
from slime.data.transport import TrainBatchRef, accept_raw_rollout
from slime.rollout.base_types import RolloutFnTrainOutput
from slime.utils.data import process_rollout_data
from slime.utils.dp_schedule import build_dp_schedule
from slime.utils.misc import Box
from slime.utils.types import Sample


def _pack_bytes(root) -> int:
    return sum(path.stat().st_size for path in Path(root).rglob("*.pack"))


@pytest.fixture
def durable(tmp_path, monkeypatch):
    args = SimpleNamespace(
        rollout_data_transport="straw",
        rollout_data_dir=str(tmp_path / "pool"),
        save=None,
        rollout_sample_filter_path=None,
        global_batch_size=2,
    )
    monkeypatch.setattr(module.ray, "get", lambda value: value)
    monkeypatch.setattr(module.ray, "put", lambda value: value)
    with closing(RolloutQueueController(args)) as controller:
        handle = local_actor_handle(controller)
        builder = module.BatchBuilder(args, controller=handle)
        builder.train_parallel_config = {"dp_size": 2}
        builder.rollout_id = 0
        yield args, controller, handle, builder


def _samples():
    # Distinct lengths per rank let the test tell which rank's tensors were opened.
    return [
        Sample(index=0, rollout_id=0, tokens=[1, 2], response_length=1, reward=1.0),
        Sample(index=1, rollout_id=0, tokens=[3, 4, 5, 6, 7], response_length=4, reward=0.0),
    ]


def test_replayed_begin_before_conversion_reuses_plan_and_writes_nothing(durable):
    args, controller, handle, builder = durable
    samples = _samples()
    builder.raw_ref = accept_raw_rollout(RolloutFnTrainOutput(samples=samples), args, 0, controller=handle)
    assert builder.begin(samples) is None
    plan = controller.batch(builder.batch_id)
    assert plan["input_positions"] == [0] and not plan["ready"]
    written = _pack_bytes(args.rollout_data_dir)
    assert builder.begin(samples) is None
    assert _pack_bytes(args.rollout_data_dir) == written
    assert controller.batch(builder.batch_id) == plan
    refs = builder.split_by_dp(builder.convert(samples))
    assert controller.batch(builder.batch_id)["ready"]
    written = _pack_bytes(args.rollout_data_dir)
    replay = builder.begin(samples)
    assert [box.inner for box in replay] == [box.inner for box in refs]
    assert _pack_bytes(args.rollout_data_dir) == written
    with pytest.raises(ValueError, match="does not match the current batch"):
        builder.training_completed(5)
    builder.training_completed(0)
    assert controller.training_state()["processed_cursor"] == 2
    original_layout = builder.train_parallel_config
    builder.train_parallel_config = {"dp_size": 4}
    with pytest.raises(ValueError, match=r"different selection or conversion plan.*parallel layout"):
        builder.begin(samples)
    builder.train_parallel_config = original_layout
    args.global_batch_size = (args.global_batch_size or 0) + 2
    with pytest.raises(ValueError, match=r"--global-batch-size \(\d+ -> \d+\)"):
        builder.begin(samples)


def test_rank_never_opens_another_ranks_tensors(durable, monkeypatch):
    args, controller, handle, builder = durable
    samples = _samples()
    builder.raw_ref = accept_raw_rollout(RolloutFnTrainOutput(samples=samples), args, 0, controller=handle)
    builder.begin(samples)
    monkeypatch.setattr(module, "build_dp_schedule", lambda *a, **kw: ([[0], [1]], [[[0]], [[0]]], [1], [2]))
    refs = builder.split_by_dp(builder.convert(samples))
    loaded, read_bytes = [], []
    original_load = straw.tensor.TensorRef.load

    def counting_load(self, *a, **kw):
        loaded.append(tuple(self.shape))
        return original_load(self, *a, **kw)

    import slime.data.codec as codec

    original_range = codec._Decoder.read_byte_ranges

    def counting_ranges(self, ranges):
        read_bytes.append(sum(stop - start for start, stop in ranges))
        return original_range(self, ranges)

    monkeypatch.setattr(straw.tensor.TensorRef, "load", counting_load)
    monkeypatch.setattr(codec._Decoder, "read_byte_ranges", counting_ranges)
    batch = process_rollout_data(refs, 0, 2)
    assert batch["tokens"][0].tolist() == [1, 2] and batch["loss_masks"][0].tolist() == [1]
    assert batch["total_lengths"] == [2] and batch["global_total_lengths"] == [2, 5]
    # Small tensors live in the bytes arena: rank 0 reads only its own sample's slices (2 int64 tokens, a 1-token
    # mask, ...: 28 bytes), never sample 1's (5 int64 tokens alone are 40 bytes), and no tensor record of theirs.
    assert read_bytes and sum(read_bytes) < 5 * 8, read_bytes
    assert (5,) not in loaded and (4,) not in loaded
    assert batch["local_raw_reward"] == [1.0]


def test_mixed_batch_identities_are_rejected(durable):
    args, controller, handle, builder = durable
    samples = _samples()
    builder.raw_ref = accept_raw_rollout(RolloutFnTrainOutput(samples=samples), args, 0, controller=handle)
    builder.begin(samples)
    refs = builder.split_by_dp(builder.convert(samples))
    assert all(isinstance(box.inner, TrainBatchRef) for box in refs)
    for changed in ({"batch_id": "batch:other"}, {"plan_digest": "0" * 64}, {"rank": 0}):
        with pytest.raises(ValueError, match="inconsistent batch identities"):
            process_rollout_data([refs[0], Box(replace(refs[1].inner, **changed))], 0, 2)
    with pytest.raises(ValueError, match="one per rank"):
        process_rollout_data(refs[:1], 0, 2)


def test_object_store_shares_are_partitioned_dicts(monkeypatch):
    args = SimpleNamespace(rollout_data_transport="object-store", global_batch_size=4, micro_batch_size=1)
    builder = object.__new__(module.BatchBuilder)
    builder.args, builder.batch_id, builder._plan, builder.rollout_id = args, None, None, 0
    builder.train_parallel_config = {"dp_size": 2}
    monkeypatch.setattr(module.ray, "put", lambda value: value)
    monkeypatch.setattr(module.ray, "get", lambda value: value)
    data = {"tokens": [[1], [2, 2], [3, 3, 3], [4]], "rollout_ids": [0] * 4, "rewards": [0.0, 1.0, 2.0, 3.0]}
    refs = builder.split_by_dp(data)
    rank1 = process_rollout_data(refs, 1, 2)
    assert rank1["rewards"] == [2.0, 3.0] and rank1["total_lengths"] == [3, 1]
    assert rank1["micro_batch_indices"] == [[0], [1]]


def test_dp_schedule_balances_tokens_and_aligns_micro_batches():
    lengths = [3, 4, 5, 6, 1, 1, 1, 9]
    args = SimpleNamespace(balance_data=True, use_dynamic_batch_size=True, max_tokens_per_gpu=8)
    partitions, micro, num, sizes = build_dp_schedule(
        args, {"dp_size": 2}, lengths, global_batch_size=4, rollout_indices=[0] * 8
    )
    assert sizes == [4, 4] and sorted(sum(partitions, [])) == list(range(8))
    first = [sum(lengths[i] for i in part[:2]) for part in partitions]
    assert first == [9, 9]
    assert all(len(rank) == sum(num) for rank in micro)
    for rank, part in zip(micro, partitions, strict=True):
        for pack in rank:
            assert pack and (len(pack) == 1 or sum(lengths[part[p]] for p in pack) <= 8)
    fixed = build_dp_schedule(SimpleNamespace(micro_batch_size=2), {"dp_size": 2}, [1] * 8, global_batch_size=8)
    assert fixed == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[[0, 1], [2, 3]], [[0, 1], [2, 3]]], [2], [8])


def test_dp_schedule_rejects_impossible_layouts():
    with pytest.raises(ValueError, match="rollout_ids has 1 entries for 2 samples"):
        build_dp_schedule(SimpleNamespace(), {"dp_size": 1}, [1, 2], global_batch_size=2, rollout_indices=[0])
    with pytest.raises(ValueError, match="requires --max-tokens-per-gpu"):
        build_dp_schedule(SimpleNamespace(use_dynamic_batch_size=True), {"dp_size": 1}, [1], global_batch_size=1)
    with pytest.raises(ValueError, match="1 samples for 2 data-parallel ranks"):
        build_dp_schedule(SimpleNamespace(), {"dp_size": 2}, [1], global_batch_size=1)
