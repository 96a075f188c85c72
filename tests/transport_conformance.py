"""A reusable conformance suite for rollout data transports.

Subclass `TransportConformance` in a test module and set `transport_name` to a registered transport:

    from transport_conformance import TransportConformance

    class TestMyTransport(TransportConformance):
        transport_name = "my-transport"

The suite asks the transport's `TransportSpec` how it moves data, never its name:
- durable transports (`spec.durable`) publish through `slime.data.transport.pack_rollout_payload` and hand
  out small picklable `DiskPayloadRef`s that another process loads from the shared pool;
- in-memory transports pass payloads through `pack_rollout_payload` unchanged and move training shards
  with `spec.put_shard` (a Ray object ref), read back with `ray.get`.
Set `hardware_available = False` (or override `hardware_missing()`) when `put_shard` needs hardware this
machine lacks; the checks that need it are then skipped with that reason, the rest still run.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from slime.data.tensor import TensorRef
from slime.data.transport import (
    DiskPayloadRef,
    pack_rollout_payload,
    release_payload_publications,
    rollout_store,
    unpack_rollout_payload,
)
from slime.plugin_manager import registry_for
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
TESTS_DIR = str(Path(__file__).resolve().parent)


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


def example_payload() -> dict:
    """Samples plus tensors of every supported dtype, scalars and empty tensors."""
    sample = Sample(
        index=5,
        tokens=[1, 2, 3],
        response="ok",
        response_length=2,
        reward=1.0,
        status=Sample.Status.COMPLETED,
        rollout_routed_experts=torch.arange(4, dtype=torch.int32).reshape(2, 1, 2),
        rollout_log_probs=[-0.5, -0.25],
    )
    sample._queue_receipt = {"position": 3, "task_id": "prompt:5"}
    tensors = {str(dtype).removeprefix("torch."): torch.arange(6).reshape(2, 3).to(dtype) for dtype in DTYPES}
    return {
        "samples": [[sample]],
        "tensors": tensors,
        "scalar": torch.tensor(2.5),
        "bf16_scalar": torch.tensor(-1.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 3),
        "empty_int": torch.zeros(0, dtype=torch.int64),
        "meta": {"step": 7, "name": "batch", "ratio": 0.5},
    }


class Harness:
    """How one transport moves a value out of this process and back."""

    def __init__(self, args: Any, spec: Any) -> None:
        self.args, self.spec = args, spec

    def put(self, value: Any) -> Any:
        raise NotImplementedError

    def get(self, handle: Any) -> Any:
        raise NotImplementedError

    def check_elsewhere(self, handle: Any, expected: Any) -> None:
        """Load `handle` in another process and compare it with `expected` there."""
        raise NotImplementedError


class DurableHarness(Harness):
    def put(self, value: Any) -> Any:
        return pack_rollout_payload(value, self.args, 0)

    def get(self, handle: Any) -> Any:
        return unpack_rollout_payload(handle)

    def check_elsewhere(self, handle: Any, expected: Any) -> None:
        directory = Path(self.args.rollout_data_dir).parent
        (directory / "handle.pkl").write_bytes(pickle.dumps(handle))
        (directory / "expected.pkl").write_bytes(pickle.dumps(expected))
        code = (
            "import pickle, sys\n"
            f"sys.path.insert(0, {TESTS_DIR!r})\n"
            "from transport_conformance import assert_same\n"
            "handle = pickle.load(open(sys.argv[1], 'rb'))\n"
            "assert_same(handle.load(), pickle.load(open(sys.argv[2], 'rb')))\n"
        )
        subprocess.run(
            [sys.executable, "-c", code, str(directory / "handle.pkl"), str(directory / "expected.pkl")],
            check=True,
            timeout=120,
            env=dict(os.environ),
        )


def _check_in_worker(boxed: list, expected: Any) -> int:
    import ray
    import transport_conformance

    transport_conformance.assert_same(ray.get(boxed[0])["value"], expected)
    return os.getpid()


class InMemoryHarness(Harness):
    def put(self, value: Any) -> Any:
        return self.spec.put_shard({"value": value})

    def get(self, handle: Any) -> Any:
        import ray

        return ray.get(handle)["value"]

    def check_elsewhere(self, handle: Any, expected: Any) -> None:
        import ray

        check = ray.remote(num_cpus=0, runtime_env={"env_vars": {"PYTHONPATH": TESTS_DIR}})(_check_in_worker)
        assert ray.get(check.remote([handle], expected), timeout=120) != os.getpid()


class TransportConformance:
    """The suite; subclasses set `transport_name` (see the module docstring)."""

    transport_name: str = ""
    hardware_available: bool = True

    def hardware_missing(self) -> str | None:
        """A reason to skip the checks that move data, or None when this machine can run them."""
        return None if self.hardware_available else f"{self.transport_name} needs hardware this machine lacks"

    @pytest.fixture
    def spec(self):
        return registry_for(None).get("transports", self.transport_name)

    @pytest.fixture
    def args(self, spec, tmp_path):
        return SimpleNamespace(
            rollout_data_transport=self.transport_name,
            rollout_data_dir=str(tmp_path / "pool") if spec.durable else None,
            rollout_queue_online_gc=True,
            save=None,
        )

    @pytest.fixture(scope="class")
    def ray_runtime(self):
        """A local Ray instance for in-memory transports (shared by the class, shut down after it)."""
        spec = registry_for(None).get("transports", self.transport_name)
        if spec.durable or self.hardware_missing():
            yield None
            return
        import ray

        started = not ray.is_initialized()
        if started:
            ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        try:
            yield ray
        finally:
            if started:
                ray.shutdown()

    @pytest.fixture
    def harness(self, spec, args, ray_runtime):
        reason = self.hardware_missing()
        if reason:
            pytest.skip(reason)
        if spec.durable:
            return DurableHarness(args, spec)
        assert spec.put_shard is not None, f"in-memory transport {spec.name!r} must define put_shard"
        return InMemoryHarness(args, spec)

    # ------------------------------------------------------------------ contract checks (no data movement)

    def test_spec_describes_how_data_moves(self, spec):
        assert spec.name == self.transport_name
        assert spec.durable or callable(spec.put_shard), "a transport is durable or puts shards somewhere"
        assert isinstance(spec.checkpoint_policy, str) and spec.checkpoint_policy

    def test_in_memory_payloads_pass_through_and_pickle(self, spec, args):
        if spec.durable:
            pytest.skip("durable transports publish payloads; see the round-trip checks")
        value = example_payload()
        assert pack_rollout_payload(value, args, 0) is value
        assert unpack_rollout_payload(value) is value
        assert_same(pickle.loads(pickle.dumps(value)), value)

    # ------------------------------------------------------------------ data movement

    def test_round_trip_samples_and_every_dtype(self, harness):
        value = example_payload()
        assert_same(harness.get(harness.put(value)), value)

    def test_tensor_aliasing_is_preserved(self, harness):
        tensor = torch.arange(1000, dtype=torch.int32)
        restored = harness.get(harness.put({"tensor": tensor, "alias": tensor, "other": tensor.clone()}))
        assert restored["tensor"] is restored["alias"]
        assert restored["other"] is not restored["tensor"]
        assert_same(restored["other"], tensor)

    def test_reference_is_small_and_picklable(self, harness, spec):
        handle = harness.put({"text": "x" * 1_000_000, "tensor": torch.zeros(100_000)})
        copy = pickle.loads(pickle.dumps(handle))
        assert len(pickle.dumps(handle)) < 1024
        if spec.durable:
            assert isinstance(handle, DiskPayloadRef) and copy == handle
        assert len(harness.get(copy)["text"]) == 1_000_000

    def test_reference_loads_in_another_process(self, harness):
        value = example_payload()
        harness.check_elsewhere(harness.put(value), value)

    def test_released_payloads_are_reclaimed(self, harness, spec, args):
        if not spec.durable:
            pytest.skip("in-memory payloads are reclaimed by Ray reference counting")
        handles = [harness.put({"tensor": torch.arange(64)}) for _ in range(2)]
        pool = Path(args.rollout_data_dir)
        assert list(pool.rglob("*.pack"))
        release_payload_publications(args, handles + handles[:1])
        store, _, lock = rollout_store(args)
        with lock:
            store.seal()
            store.collect_garbage()
        assert not list(pool.rglob("*.pack"))
        with pytest.raises(Exception):  # noqa: B017 - any storage error; the bytes are gone
            dataclasses.replace(handles[0]).load()
