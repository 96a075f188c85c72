"""The transport conformance suite: what every `slime.interfaces.Transport` must do, checked through the interface.

Subclass `TransportConformance` and set `transport_name` (see `slime.testing` for the usage). The tests of a class
share one `TransportHarness` (fixture `transport_harness`, one run): the transport set up the way a run sets it up, with
`slime-run`'s own argument parser (the run's plugins and their options, a temporary `--save` directory and
prompt file), `run_transport(args)`, the driver's `resolve_restore()` and `prepare_storage()`, and the rollout
manager's `check_storage()` and `open_data_source(...)` with the run's registered data source, inside a local
Ray session (fixture `slime_ray`, two CPUs, shut down after the class). The checks never ask which transport it
is, only what the interface promises:

- `run_transport(args)` builds it and it implements every `Transport` (and `RolloutSession`) method;
- a rollout session publishes groups (synchronously and from the event loop) and loads them back identical:
  Samples holding tensors of every dtype in `DTYPES`, bfloat16 and empty tensors, nested groups;
- a discarded group stays out of the batch; `accept_rollout` returns the step's groups and metrics;
- `replay_archive` declines an archive of a foreign format;
- `shard_batch` on a real `BatchBuilder` (two data-parallel ranks) gives one `Box` per rank, from which
  `slime.utils.data.process_rollout_data` hands each rank exactly its rows, its schedule and the global
  columns, in this process and in a Ray worker; a transport that passes `ShardReference`s passes small
  ones (independent of the batch's size) that load in a fresh Python process without Ray;
- `save_state`, `load_state` and `seal` succeed on a fresh run (a harness of its own).

Checks that move training shards call `hardware_missing()` first and are skipped with its reason.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from slime.data.tensor import TensorRef
from slime.utils.types import Sample

DTYPES = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
)
#: Data-parallel ranks of the sharding checks.
DP_SIZE = 2
#: Largest pickled `ShardReference` accepted; the batch behind it is many times larger.
MAX_REFERENCE_BYTES = 16 * 1024
#: Seconds a check waits for another process (a Ray worker, a fresh interpreter).
OTHER_PROCESS_TIMEOUT_S = 120


def assert_same(actual: Any, expected: Any, where: str = "value") -> None:
    """Deep equality that compares tensors exactly (dtype, shape, bits) and loads stored tensor refs."""
    if isinstance(actual, TensorRef):
        actual = actual.load()
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert torch.equal(actual, expected), f"{where}: tensor contents differ"
    elif isinstance(expected, Sample):
        assert isinstance(actual, Sample), f"{where}: expected a Sample, got {type(actual).__name__}"
        assert_same(vars(actual), vars(expected), f"{where}.<Sample>")
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), f"{where}: keys {actual!r} != {expected!r}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for index, (left, right) in enumerate(zip(actual, expected, strict=True)):
            assert_same(left, right, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# ------------------------------------------------------------------------------------------------ example data


def _example_sample(index: int) -> Sample:
    """A finished Sample whose metadata holds a tensor of every dtype, scalars and empty tensors."""
    return Sample(
        group_index=index // 2,
        index=index,
        prompt=f"prompt {index}",
        tokens=[1, 2, 3, index],
        response="ok",
        response_length=2,
        label="ok",
        reward=float(index % 2),
        loss_mask=[1, 0],
        rollout_log_probs=[-0.5, -0.25],
        rollout_routed_experts=torch.arange(4, dtype=torch.int32).reshape(2, 1, 2) + index,
        status=Sample.Status.COMPLETED,
        metadata={
            "tensors": {str(dtype).removeprefix("torch."): torch.arange(6).reshape(2, 3).to(dtype) for dtype in DTYPES},
            "scalar": torch.tensor(2.5),
            "bf16_scalar": torch.tensor(-1.5, dtype=torch.bfloat16),
            "empty": torch.empty(0, 3),
            "empty_int": torch.zeros(0, dtype=torch.int64),
            "step": 7,
            "name": "batch",
            "ratio": 0.5,
        },
    )


def example_groups() -> list:
    """Three finished groups: two Samples, a nested group (two sub-groups) and a single Sample."""
    return [
        [_example_sample(0), _example_sample(1)],
        [[_example_sample(2)], [_example_sample(3), _example_sample(4)]],
        [_example_sample(5)],
    ]


def training_samples(count: int = 8, *, prompt_tokens: int = 2) -> list[Sample]:
    """One step's finished Samples (two per prompt, lengths differ) for `BatchBuilder.convert`."""
    samples = []
    for index in range(count):
        response_length = 1 + index % 3
        length = prompt_tokens + index + response_length
        samples.append(
            Sample(
                group_index=index // 2,
                index=index,
                rollout_id=0,
                tokens=[(index * 7 + position) % 50 for position in range(length)],
                response_length=response_length,
                reward=(index % 3) / 2,
                loss_mask=[1] * (response_length - 1) + [0],
                rollout_log_probs=[-0.125 * (position + 1) for position in range(response_length)],
                teacher_log_probs=[-0.25 * (position + 1) for position in range(response_length)],
                rollout_routed_experts=torch.arange(length * 2, dtype=torch.int32).reshape(length, 1, 2),
                status=Sample.Status.TRUNCATED if index == 3 else Sample.Status.COMPLETED,
                metadata={"round_number": index % 2},
            )
        )
    return samples


# ------------------------------------------------------------------------------------------------ harness


def _write_prompts(path: Path, count: int = 8) -> Path:
    """A prompt file the run's data source can read (`input`/`label` rows)."""
    path.write_text("".join(json.dumps({"input": f"p{i}", "label": f"p{i}"}) + "\n" for i in range(count)))
    return path


class TransportHarness:
    """A transport set up as a run sets it up (see the module docstring); `close()` tears it down.

    `args`: the run's parsed arguments; `transport`: `run_transport(args)`; `restore_plan`: what
    `resolve_restore()` returned; `opened`: the `OpenedSource`; `session`: the rollout session of its service.
    """

    def __init__(self, argv: Sequence[str]) -> None:
        from slime.interfaces import run_transport
        from slime.utils.arguments import parse_args
        from slime.utils.misc import load_function, plugin_name

        self.args, self.restore_plan = run_transport(parse_args(list(argv))).resolve_restore()
        self.transport = run_transport(self.args)
        self.transport.prepare_storage()
        self.transport.check_storage()
        self.source_cls = load_function(plugin_name("data_sources", self.args.data_source_path, self.args))
        self.opened = self.transport.open_data_source(
            self.source_cls, restore_plan=self.restore_plan, serving=None, service=None
        )
        self.session = self.transport.rollout_session(self.opened.service)

    def batch_builder(self) -> Any:
        """The rollout manager's `BatchBuilder` for step 0 on `DP_SIZE` data-parallel ranks."""
        from slime.data.batch_builder import BatchBuilder

        builder = BatchBuilder(self.args, controller=self.opened.service)
        builder.train_parallel_config = {"dp_size": DP_SIZE}
        builder.rollout_id = 0
        return builder

    def close(self) -> None:
        """What the rollout manager's `dispose` does: close the source and the owned service, then `seal()`."""
        import ray

        close = getattr(self.opened.source, "close", None)
        if close is not None:
            close()
        if self.opened.owned and self.opened.service is not None:
            try:
                ray.get(self.opened.service.close.remote(), timeout=OTHER_PROCESS_TIMEOUT_S)
            finally:
                ray.kill(self.opened.service, no_restart=True)
        self.transport.seal()


def _load_shard_in_worker(boxes: list, rank: int, expected: dict) -> int:
    """In a Ray worker: load `rank`'s shard as a trainer does and compare it with `expected`; returns the pid."""
    from slime.utils.data import process_rollout_data

    assert_same(process_rollout_data(boxes, rank, len(boxes)), expected, f"rank {rank} in a Ray worker")
    return os.getpid()


_LOAD_WITHOUT_RAY = """
import pickle, sys
from slime.testing.transport_conformance import assert_same
references = pickle.load(open(sys.argv[1], "rb"))
expected = pickle.load(open(sys.argv[2], "rb"))
for reference, shard in zip(references, expected, strict=True):
    assert_same(reference.load(), shard, f"rank {reference.rank} in a fresh process")
"""


class TransportConformance:
    """The suite (see the module docstring); subclasses set `transport_name`."""

    #: The registered `TransportSpec` name of the transport under test.
    transport_name: str = ""
    #: More `slime-run` options for the run (your plugin's own options, `--plugin NAME`, ...).
    extra_args: Sequence[str] = ()

    def hardware_missing(self) -> str | None:
        """Why this machine cannot move training shards with this transport (the checks are skipped), or None."""
        return None

    def transport_argv(self, tmp_path: Path) -> list[str]:
        """The run's command line: a temporary `--save` and prompt file, two samples per prompt, `extra_args`."""
        prompts = _write_prompts(tmp_path / "prompts.jsonl")
        return [
            "--rollout-data-transport",
            self.transport_name,
            "--save",
            str(tmp_path / "save"),
            "--prompt-data",
            str(prompts),
            "--input-key",
            "input",
            "--label-key",
            "label",
            "--n-samples-per-prompt",
            "2",
            "--rollout-batch-size",
            "4",
            "--global-batch-size",
            "4",
            *self.extra_args,
        ]

    def _require_hardware(self) -> None:
        reason = self.hardware_missing()
        if reason:
            pytest.skip(reason)

    # ------------------------------------------------------------------------------------------ building

    def test_factory_builds_a_complete_transport(self, transport_harness: TransportHarness) -> None:
        from slime.interfaces import RolloutSession, missing_methods, run_transport
        from slime.plugin_manager import registry_for
        from slime.specs import TransportSpec

        args = transport_harness.args
        registry = registry_for(args)
        spec = registry.get("transports", self.transport_name)
        assert isinstance(spec, TransportSpec) and callable(spec.target)
        registry.get("checkpoint_policies", spec.checkpoint_policy)
        registry.get("data_sources", spec.data_source)
        transport = run_transport(args)
        assert missing_methods(transport) == [], f"{type(transport).__qualname__} lacks interface methods"
        assert transport.name == self.transport_name
        session = transport_harness.session
        for name in sorted(RolloutSession.__abstractmethods__):
            method = getattr(session, name, None)
            assert callable(method) and not getattr(method, "__isabstractmethod__", False), f"session lacks {name}"

    def test_storage_and_data_source_are_set_up(self, transport_harness: TransportHarness) -> None:
        from slime.data.checkpoint import RestorePlan
        from slime.interfaces import OpenedSource

        assert isinstance(transport_harness.restore_plan, RestorePlan)
        assert transport_harness.restore_plan.mode == "new", "a fresh --save directory restores nothing"
        transport_harness.transport.prepare_storage()  # the driver may settle storage again (a rerun)
        transport_harness.transport.check_storage()
        opened = transport_harness.opened
        assert isinstance(opened, OpenedSource)
        assert isinstance(opened.source, transport_harness.source_cls)
        assert not opened.owned or opened.service is not None, "an owned service must exist to be closed"

    # ------------------------------------------------------------------------------------------ rollout session

    def test_groups_published_synchronously_load_back_identical(self, transport_harness: TransportHarness) -> None:
        session = transport_harness.session
        published = [session.publish_group_now(group, 0) for group in example_groups()]
        assert_same(session.load_groups(published), example_groups(), "groups")

    def test_groups_published_from_the_event_loop_load_back_identical(
        self, transport_harness: TransportHarness
    ) -> None:
        session = transport_harness.session

        async def publish_all() -> list:
            return list(await asyncio.gather(*(session.publish_group(group, 1) for group in example_groups())))

        published = asyncio.run(publish_all())
        assert_same(session.load_groups(published), example_groups(), "groups")
        assert_same(session.load_groups(pickle.loads(pickle.dumps(published))), example_groups(), "pickled groups")

    def test_discarded_group_stays_out_of_the_batch(self, transport_harness: TransportHarness) -> None:
        session = transport_harness.session
        first, nested, last = (session.publish_group_now(group, 0) for group in example_groups())
        session.discard_group(nested, "conformance: rejected by a dynamic filter")
        dropped = session.load_groups([last])[0]
        batch = session.publish_batch([first], 0, dropped=list(dropped))
        assert_same(session.load_groups(batch), example_groups()[:1], "batch")

    def test_accept_rollout_returns_the_groups_and_metrics(self, transport_harness: TransportHarness) -> None:
        from slime.rollout.base_types import RolloutFnTrainOutput

        session = transport_harness.session
        published = [session.publish_group_now(group, 0) for group in example_groups()]
        batch = session.publish_batch(published, 0)
        output = RolloutFnTrainOutput(samples=batch, metrics={"rollout/reward": 0.5})
        groups, metrics, _ = transport_harness.transport.accept_rollout(
            output, 0, service=transport_harness.opened.service
        )
        assert_same(session.load_groups(groups), example_groups(), "accepted groups")
        assert metrics == {"rollout/reward": 0.5}

    def test_replay_declines_an_archive_of_a_foreign_format(
        self, transport_harness: TransportHarness, tmp_path: Path
    ) -> None:
        (tmp_path / "foreign_0.conformance-archive").write_text(json.dumps({"format": "not-slime", "version": 1}))
        template = str(tmp_path / "foreign_{rollout_id}.conformance-archive")
        replayed = transport_harness.transport.replay_archive(template, 0, service=transport_harness.opened.service)
        assert replayed is None

    # ------------------------------------------------------------------------------------------ training shards

    def test_shards_give_each_rank_its_rows_and_the_global_columns(self, transport_harness: TransportHarness) -> None:
        from slime.data.batch_builder import GLOBAL_FIELDS, PARTITIONED_FIELDS, take_rows
        from slime.observability.rollout_data_utils import tensorize_rollout_data_for_training
        from slime.utils.data import process_rollout_data
        from slime.utils.misc import Box

        self._require_hardware()
        builder = transport_harness.batch_builder()
        samples = training_samples()
        data = builder.convert(samples)
        expected = tensorize_rollout_data_for_training(copy.deepcopy(data))
        schedule = builder.dp_schedule(data)
        boxes = transport_harness.transport.shard_batch(builder, data)
        assert len(boxes) == DP_SIZE and all(isinstance(box, Box) for box in boxes), boxes
        trained = []
        for rank in range(DP_SIZE):
            shard = process_rollout_data(boxes, rank, DP_SIZE)
            partition = list(shard["partition"])
            assert partition == schedule.partitions[rank], f"rank {rank} trains other rows than its schedule"
            trained.extend(partition)
            for key in PARTITIONED_FIELDS:
                if key in expected:
                    assert_same(shard[key], take_rows(expected[key], partition), f"rank {rank}[{key!r}]")
                else:
                    assert shard.get(key) is None, f"rank {rank} got a column the batch lacks: {key}"
            for key in GLOBAL_FIELDS:
                if key != "total_lengths":
                    assert_same(list(shard[key]), list(expected[key]), f"rank {rank}[{key!r}] (global)")
            assert list(shard["global_total_lengths"]) == schedule.total_lengths
            assert list(shard["total_lengths"]) == [schedule.total_lengths[i] for i in partition]
            assert list(shard["local_raw_reward"]) == [expected["raw_reward"][i] for i in partition]
            for key, value in schedule.for_rank(rank).items():
                assert_same(shard[key], value, f"rank {rank}[{key!r}] (schedule)")
        assert sorted(trained) == list(range(len(samples))), f"ranks train {sorted(trained)}"

    def test_shards_load_in_a_ray_worker(self, transport_harness: TransportHarness, slime_ray: Any) -> None:
        from slime.utils.data import process_rollout_data

        self._require_hardware()
        builder = transport_harness.batch_builder()
        boxes = builder.split_by_dp(builder.convert(training_samples()))  # orchestration's way to shard_batch
        expected = [process_rollout_data(boxes, rank, DP_SIZE) for rank in range(DP_SIZE)]
        load = slime_ray.remote(num_cpus=0)(_load_shard_in_worker)
        pids = slime_ray.get(
            [load.remote(boxes, rank, expected[rank]) for rank in range(DP_SIZE)], timeout=OTHER_PROCESS_TIMEOUT_S
        )
        assert os.getpid() not in pids, "the shards must be loaded by another process"

    def test_shard_references_are_small_and_load_in_a_fresh_process(
        self, transport_harness: TransportHarness, slime_ray: Any, tmp_path: Path
    ) -> None:
        from slime.interfaces import ShardReference

        self._require_hardware()
        builder = transport_harness.batch_builder()
        data = builder.convert(training_samples(prompt_tokens=20_000))
        boxes = transport_harness.transport.shard_batch(builder, data)
        references = [slime_ray.get(box.inner) for box in boxes]
        if not all(isinstance(reference, ShardReference) for reference in references):
            pytest.skip(f"{self.transport_name} passes shards by value, not as ShardReferences")
        assert [reference.rank for reference in references] == list(range(DP_SIZE))
        assert len({(reference.batch_id, reference.plan_digest) for reference in references}) == 1
        payload_bytes = sum(8 * len(tokens) for tokens in data["tokens"])
        for reference in references:
            size = len(pickle.dumps(reference))
            assert size < MAX_REFERENCE_BYTES, f"a ShardReference of {size} bytes for a {payload_bytes}-byte batch"
        expected = [reference.load() for reference in references]
        references_file = tmp_path / "references.pkl"
        expected_file = tmp_path / "expected.pkl"
        references_file.write_bytes(pickle.dumps(references))
        expected_file.write_bytes(pickle.dumps(expected))
        env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
        subprocess.run(
            [sys.executable, "-c", _LOAD_WITHOUT_RAY, str(references_file), str(expected_file)],
            check=True,
            timeout=OTHER_PROCESS_TIMEOUT_S,
            env=env,
        )

    # ------------------------------------------------------------------------------------------ checkpoints

    def test_checkpoint_state_and_seal_on_a_fresh_run(self, slime_ray: Any, tmp_path: Path) -> None:
        harness = TransportHarness(self.transport_argv(tmp_path))
        try:
            builder = harness.batch_builder()
            harness.transport.save_state(builder, 0)
            harness.transport.load_state(builder, None, None)
            harness.transport.seal()
        finally:
            harness.close()
