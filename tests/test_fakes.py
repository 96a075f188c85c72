"""tests/fakes.py: fakes refuse what the real class lacks, check signatures and record calls."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import ray
from fakes import Call, fake_actor_handle, fake_object, local_actor_handle, public_methods

from slime.data.queue_controller import RolloutQueueController
from slime.ray.actor_group import RayTrainGroup
from slime.ray.rollout import RolloutManager
from slime.ray.serving import RolloutServer


class _Service:
    """A tiny real class for the helpers' own checks."""

    limit: int = 3

    def __init__(self) -> None:
        self.served = 0
        self._secret = "x"

    def serve(self, count: int, *, tag: str = "") -> int:
        self.served += count
        return self.served

    @staticmethod
    def version() -> str:
        return "1"

    @classmethod
    def build(cls, name: str) -> _Service:
        return cls()

    @property
    def busy(self) -> bool:
        return self.served > 0

    def _private(self) -> None:
        pass


def test_actor_handle_exposes_exactly_the_real_public_methods():
    manager = fake_actor_handle(RolloutManager)
    real = RolloutManager.__ray_metadata__.modified_class
    assert set(public_methods(RolloutManager)) == {
        name for name in dir(real) if not name.startswith("_") and callable(getattr(real, name))
    } - {"transport"}
    assert manager.generate.remote(3) is None and manager.training_ready.remote() is None
    with pytest.raises(AttributeError, match="RolloutManager has no public method 'checkpoint_committed'"):
        manager.checkpoint_committed.remote(3)
    with pytest.raises(AttributeError, match="RolloutManager has no public method 'transport'"):
        _ = manager.transport  # a property: not reachable through a Ray handle
    with pytest.raises(AttributeError, match="RolloutManager has no public method '_get_rollout_data'"):
        _ = manager._get_rollout_data
    with pytest.raises(AttributeError, match="RolloutManager has no public method 'checkpoint_committed'"):
        fake_actor_handle(RolloutManager, checkpoint_committed=None)
    with pytest.raises(AttributeError, match="RolloutManager has no public attribute 'checkpoint_committed'"):
        manager.checkpoint_committed = None
    assert not hasattr(manager, "checkpoint_committed") and hasattr(manager, "register_training_actors")


def test_actor_handle_checks_signatures_and_needs_remote():
    manager = fake_actor_handle(RolloutManager)
    with pytest.raises(TypeError, match=r"RolloutManager\.generate\(rollout_id: 'int'\)"):
        manager.generate.remote(1, 2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'step'"):
        manager.save.remote(1, step=1)
    with pytest.raises(TypeError, match=r"cannot be called directly: use \.generate\.remote"):
        manager.generate(1)
    assert manager.calls == []  # refused calls are not recorded


def test_actor_handle_records_calls_and_returns_behaviours():
    log: list = []
    seen = []
    manager = fake_actor_handle(
        RolloutManager, log, "manager", generate=lambda rollout_id: [f"ref-{rollout_id}"], get_weight_version=7
    )
    controller = fake_actor_handle(RolloutQueueController, log, "controller", close=lambda: seen.append("close"))
    assert manager.generate.remote(4) == ["ref-4"]
    assert manager.get_weight_version.remote() == 7
    assert controller.close.remote() is None and seen == ["close"]
    manager.save.remote(rollout_id=4)
    assert manager.generate.calls == [Call("generate", (4,), {})]
    assert manager.calls == [
        Call("generate", (4,), {}),
        Call("get_weight_version", (), {}),
        Call("save", (), {"rollout_id": 4}),
    ]
    assert [call.name for call in log] == [
        "manager.generate",
        "manager.get_weight_version",
        "controller.close",
        "manager.save",
    ]
    manager.get_weight_version.behaviour = 8
    assert manager.get_weight_version.remote() == 8

    def fail(rollout_id):
        raise RuntimeError("boom")

    manager.generate.behaviour = fail
    with pytest.raises(RuntimeError, match="boom"):
        manager.generate.remote(5)
    assert manager.generate.calls[-1] == Call("generate", (5,), {})  # recorded before it raised
    with pytest.raises(AttributeError, match="set fake.generate.behaviour"):
        manager.generate = fail


def test_actor_handle_of_a_plain_class_and_over_a_real_instance():
    handle = fake_actor_handle(_Service, serve=5)
    assert set(public_methods(_Service)) == {"serve", "version", "build"}
    assert handle.serve.remote(1, tag="a") == 5 and handle.version.remote() is None
    with pytest.raises(AttributeError, match="_Service has no public method 'busy'"):
        _ = handle.busy
    with pytest.raises(AttributeError, match="_Service has no public method 'limit'"):
        _ = handle.limit  # data is not reachable through a handle
    service = _Service()
    local = local_actor_handle(service)
    assert local.serve.remote(2) == 2 and local.serve.remote(3) == 5 and service.served == 5
    assert local.calls == [Call("serve", (2,), {}), Call("serve", (3,), {})]
    with pytest.raises(TypeError, match=r"_Service\.serve"):
        local.serve.remote()


def test_fake_object_has_the_real_methods_and_attributes_only():
    group = fake_object(RayTrainGroup, args="the args", save_model=lambda rollout_id, force_sync=False: rollout_id)
    assert group.args == "the args" and group.save_model(3, force_sync=True) == 3
    assert group.update_weights() is None
    assert group.calls == [Call("save_model", (3,), {"force_sync": True}), Call("update_weights", (), {})]
    with pytest.raises(TypeError, match=r"RayTrainGroup\.save_model"):
        group.save_model(3, True, 4)
    with pytest.raises(AttributeError, match="RayTrainGroup has no public method or attribute 'save'"):
        group.save(3)
    with pytest.raises(AttributeError, match="attribute 'role' was not given"):
        _ = group.role  # a real attribute (assigned in __init__), no value given
    group.role = "critic"
    assert group.role == "critic"
    with pytest.raises(AttributeError, match="RayTrainGroup has no public attribute 'load'"):
        group.load = 3
    with pytest.raises(AttributeError, match="no public method or attribute 'checkpoint_committed'"):
        fake_object(RayTrainGroup, checkpoint_committed=None)
    with pytest.raises(AttributeError, match="no public method or attribute '_actor_handlers'"):
        fake_object(RayTrainGroup, _actor_handlers=[])


def test_fake_object_knows_fields_properties_and_class_attributes():
    server = fake_object(RolloutServer, urls=["http://a"], update_weights=True)
    assert server.urls == ["http://a"] and server.update_weights is True
    server.num_new_engines = 2  # a dataclass field
    assert server.recover() is None and server.recover.calls == [Call("recover", (), {})]
    service = fake_object(_Service, busy=True, limit=1, served=4)
    assert (service.busy, service.limit, service.served) == (True, 1, 4)
    with pytest.raises(AttributeError, match="'_secret'"):
        _ = service._secret
    assert copy.copy(service) is not service  # copying looks up dunders: they must not be faked


def test_fake_object_of_a_dataclass_without_source():
    Point = dataclass(type("Point", (), {"__annotations__": {"x": int}}))
    point = fake_object(Point, x=1)
    assert point.x == 1
    with pytest.raises(AttributeError, match="Point has no public method or attribute 'y'"):
        _ = point.y


def test_handles_of_ray_actor_classes_need_no_ray():
    was = ray.is_initialized()
    fake_actor_handle(RolloutManager).dispose.remote()
    assert ray.is_initialized() == was
