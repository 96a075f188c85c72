"""The rollout manager's lifecycle and boundaries, the serving cluster, the engine lock and metrics tracking."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fakes import fake_actor_handle, fake_object

from slime.data.batch_builder import BatchBuilder
from slime.data.queue_controller import RolloutQueueController
from slime.data.queue_reader import QueueDataSource
from slime.observability import logging_utils
from slime.plugin_manager import PluginError
from slime.ray import rollout, serving
from slime.ray.health_monitor import EngineHealthMonitor
from slime.rollout.base_types import RolloutFnTrainOutput
from slime.utils.types import Sample

Manager = rollout.RolloutManager.__ray_metadata__.modified_class
Cluster = serving.ServingCluster.__ray_metadata__.modified_class


def _bare_manager(args, **fields):
    manager = object.__new__(Manager)
    manager.args = args
    manager.serving = None
    manager.servers = {}
    manager.rollout_id = -1
    for name, value in fields.items():
        setattr(manager, name, value)
    return manager


def _server(urls):
    """A real rollout server of live engines at `urls` (no launcher: nothing here relaunches)."""
    return serving.RolloutServer(SimpleNamespace(), None, list(urls), list(urls))


def test_dispose_runs_every_step_in_order_and_reports_the_first_failure(monkeypatch):
    calls = []
    controller = fake_actor_handle(RolloutQueueController, close=lambda: calls.append("controller_close"))

    def failing_close():
        calls.append("source_close")
        raise OSError("source broke")

    from slime.data import transport

    args = SimpleNamespace(rollout_data_transport="straw")
    manager = _bare_manager(
        args,
        data_source=fake_object(QueueDataSource, close=failing_close),
        controller=controller,
        _owns_controller=True,
        _launched_servers=False,
    )
    monkeypatch.setattr(rollout.ray, "get", lambda value, **kw: value)
    monkeypatch.setattr(rollout.ray, "kill", lambda handle, **kw: calls.append(("kill", kw)))
    monkeypatch.setattr(transport, "seal_rollout_store", lambda _: calls.append("seal"))
    monkeypatch.setattr(rollout.logging_utils, "finish_tracking", lambda _: calls.append("finish"))
    with pytest.raises(RuntimeError, match="cleanup failed: source broke"):
        manager.dispose()
    assert calls == ["source_close", "controller_close", ("kill", {"no_restart": True}), "seal", "finish"]


def test_borrowed_controller_is_never_closed(monkeypatch):
    calls = []
    controller = fake_actor_handle(RolloutQueueController, close=lambda: calls.append("controller_close"))
    manager = _bare_manager(
        SimpleNamespace(), data_source=object(), controller=controller, _owns_controller=False, _launched_servers=False
    )
    monkeypatch.setattr(rollout.logging_utils, "finish_tracking", lambda _: calls.append("finish"))
    manager.dispose()
    assert calls == ["finish"] and controller.calls == []


def test_recovery_without_serving_skips_the_first_step(monkeypatch):
    monkeypatch.setattr(serving, "check_engines_fit", lambda args, count: None)  # no Ray cluster here
    launches = []

    def launcher(args, count):
        launches.append(count)
        return [f"http://new-{i}" for i in range(count)]

    server = serving.RolloutServer(SimpleNamespace(), launcher, ["http://old-0"], [None])  # its engine died
    manager = _bare_manager(SimpleNamespace(), servers={"model": server})
    manager.recover_updatable_engines()
    assert launches == []
    manager.rollout_id = 3
    manager.recover_updatable_engines()
    assert launches == [1] and manager.args.rollout_engine_urls == ["http://new-0"]


def test_serving_cluster_checks_monitors_at_the_rollout_boundary():
    events = []
    monitor = fake_object(
        EngineHealthMonitor, pause=lambda: events.append("pause"), check_once=lambda: events.append("check")
    )
    cluster = object.__new__(Cluster)
    cluster.servers = {"model": serving.RolloutServer(SimpleNamespace(), None, ["http://e"], [object()])}
    cluster._health_monitors = [monitor]
    assert cluster.finish_rollout() is cluster.servers
    assert events == ["pause", "check"]
    assert cluster.recover_updatable_engines() is cluster.servers  # every engine alive: nothing relaunched
    assert events == ["pause", "check", "pause"]


def test_rollout_server_relaunches_only_missing_engines(monkeypatch):
    monkeypatch.setattr(serving, "check_engines_fit", lambda args, count: None)  # no Ray cluster here
    launches = []

    def launcher(args, count):
        launches.append(count)
        return [f"http://engine-{len(launches)}-{i}" for i in range(count)]

    server = serving.RolloutServer.launch(SimpleNamespace(), launcher, 2, "fake")
    assert server.urls == ["http://engine-1-0", "http://engine-1-1"] and server.num_new_engines == 2
    server.all_engines[1] = None
    server.recover()
    assert launches == [2, 1]
    assert server.urls == ["http://engine-1-0", "http://engine-2-0"] and server.num_new_engines == 1
    server.recover()
    assert launches == [2, 1] and server.num_new_engines == 0


def test_manager_without_a_registered_engine_fails_clearly():
    args = SimpleNamespace(rollout_engine="no-such-engine", debug_train_only=False)
    with pytest.raises(PluginError, match="No rollout engine named 'no-such-engine'"):
        Manager(args, None)


def test_in_memory_rollout_data_is_flattened_with_metrics():
    groups = [[Sample(index=0, tokens=[1]), Sample(index=1, tokens=[2])], [Sample(index=2, tokens=[3])]]
    manager = _bare_manager(
        SimpleNamespace(load_debug_rollout_data=None),
        data_source=object(),
        batch_builder=fake_object(BatchBuilder),
        generate_rollout=lambda *a, **kw: RolloutFnTrainOutput(samples=groups, metrics={"m": 1}),
    )
    samples, metrics = manager._get_rollout_data(0)
    assert [s.index for s in samples] == [0, 1, 2] and metrics == {"m": 1}
    manager.generate_rollout = lambda *a, **kw: 42
    with pytest.raises(TypeError, match="Unsupported rollout output"):
        manager._get_rollout_data(0)


def test_engine_lock_acquire_release():
    lock = rollout.Lock.__ray_metadata__.modified_class()
    assert lock.acquire() and lock.locked()
    assert not lock.acquire(timeout=0.01)
    lock.release()
    with pytest.raises(RuntimeError, match="released while not held"):
        lock.release()


def test_metrics_are_json_lines_under_the_metrics_dir(tmp_path):
    args = SimpleNamespace(metrics_dir=str(tmp_path / "metrics"), reward_key=None)
    logging_utils.init_tracking(args)
    samples = [Sample(reward=1.0, response_length=4), Sample(reward=0.0, response_length=2)]
    logging_utils.log_rollout_data(3, args, samples, {"custom": 7}, 1.5)
    logging_utils.log_eval_rollout_data(3, args, {"gsm": {"rewards": [1, 0, 1, 0]}}, None)
    logging_utils.finish_tracking(args)
    lines = [json.loads(line) for line in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 3 and lines[0]["rollout/reward"] == 0.5 and lines[0]["rollout/response_length"] == 3
    assert lines[0]["custom"] == 7 and lines[0]["rollout/time"] == 1.5
    assert lines[1]["eval/gsm/reward"] == 0.5
    no_dir = SimpleNamespace()
    logging_utils.init_tracking(no_dir)
    logging_utils.log_rollout_data(0, no_dir, samples, None, 0.0)
    logging_utils.finish_tracking(no_dir)


class _Source:
    def __init__(self, args):
        self.args = args


def test_attached_manager_publishes_engine_urls_without_mutating_args():
    from slime.ray.serving import ServingDeployment

    args = SimpleNamespace(data_source_path=f"{__name__}._Source", rollout_function_path="sglang")
    original = vars(args).copy()
    deployment = ServingDeployment(
        placements={},
        servers={"model": _server(["http://a", "http://b"])},
        controller=None,
        restore_plan=None,
        routers={},
        engine_lock="lock",
    )
    manager = Manager(args, None, deployment=deployment)
    assert vars(args) == original
    assert manager.args.rollout_engine_urls == ["http://a", "http://b"]
    assert manager.data_source.args is manager.args and manager.rollout_engine_lock == "lock"
    assert manager.batch_builder.controller is None


def test_failed_construction_closes_the_controller_it_created(monkeypatch, tmp_path):
    from slime.data import queue_data_source

    calls = []
    handle = fake_actor_handle(RolloutQueueController, close=lambda: calls.append("close"))
    args = SimpleNamespace(
        rollout_data_transport="straw",
        rollout_data_dir=str(tmp_path),
        debug_train_only=True,
        data_source_path="source",
        rollout_function_path="missing.rollout",
    )

    def load(path):
        if path == "source":
            return _Source
        raise ModuleNotFoundError(f"Cannot import 'missing' to load {path!r}")

    monkeypatch.setattr(rollout, "check_rollout_storage", lambda _: None)
    monkeypatch.setattr(rollout, "load_function", load)
    monkeypatch.setattr(queue_data_source, "create_queue_controller", lambda *a, **kw: handle)
    monkeypatch.setattr(rollout.ray, "get", lambda value, **kw: value)
    monkeypatch.setattr(rollout.ray, "kill", lambda h, **kw: calls.append(("kill", h is handle)))
    with pytest.raises(ModuleNotFoundError, match="missing.rollout"):
        Manager(args, None)
    assert calls == ["close", ("kill", True)]


def test_rollout_examples_are_the_first_answer_of_the_first_groups():
    args = SimpleNamespace(reward_key=None)
    samples = [
        Sample(group_index=group, index=2 * group + i, prompt=f"p{group}", response=f"r{group}.{i}", reward=float(i))
        for group in (5, 1, 3, 0, 2)
        for i in range(2)
    ]
    rows = logging_utils.rollout_examples(samples, args, groups=3)
    assert rows == [
        {"group": group, "prompt": f"p{group}", "response": f"r{group}.0", "reward": 0.0} for group in (0, 1, 2)
    ]
    chat = Sample(group_index=0, prompt=[{"role": "user", "content": "hi"}], response="x", reward=1.0)
    assert logging_utils.rollout_examples([chat], args)[0]["prompt"] == '[{"role": "user", "content": "hi"}]'


def _straw_args(tmp_path, **extra):
    return SimpleNamespace(
        rollout_data_transport="straw",
        rollout_data_dir=str(tmp_path),
        data_source_path="source",
        rollout_function_path="sglang",
        **extra,
    )


def _patch_components(monkeypatch, calls):
    """The manager's queue controller as a fake handle whose close and kill are logged in `calls`."""
    from slime.data import queue_data_source

    handle = fake_actor_handle(RolloutQueueController, close=lambda: calls.append("controller closed"))
    monkeypatch.setattr(queue_data_source, "create_queue_controller", lambda *a, **kw: handle)
    monkeypatch.setattr(rollout, "load_function", lambda path: _Source if path == "source" else print)
    monkeypatch.setattr(rollout.ray, "get", lambda value, **kw: value)
    monkeypatch.setattr(rollout.ray, "kill", lambda h, **kw: calls.append("controller killed"))


def test_engines_start_while_the_storage_probe_runs_and_are_stopped_when_it_fails(monkeypatch, tmp_path):
    import threading

    from slime import backend_interfaces

    calls: list = []
    probing = threading.Event()
    server = _server(["http://a"])
    monkeypatch.setattr(server, "shutdown", lambda: calls.append("engines stopped"))

    def launch(args, launcher):
        # Returns only once the probe has started: with a launch that waited for the probe this would time out.
        calls.append(("launch saw the probe running", probing.wait(timeout=10)))
        return {"model": server}

    def probe(args):
        probing.set()
        raise OSError("the pool at /shared/pool is read-only")

    _patch_components(monkeypatch, calls)
    monkeypatch.setattr(backend_interfaces, "resolve_engine_launcher", lambda args: "cpu launcher")
    monkeypatch.setattr(serving, "launch_rollout_servers", launch)
    monkeypatch.setattr(rollout, "check_rollout_storage", probe)
    with pytest.raises(OSError, match="read-only"):
        Manager(_straw_args(tmp_path), None)
    assert calls == [("launch saw the probe running", True), "engines stopped"]


def test_an_engine_launch_that_fails_creates_no_queue_controller(monkeypatch, tmp_path):
    """Nothing is written under --save for a run whose engines never came up: a rerun with fixed flags starts new."""
    from slime import backend_interfaces

    calls: list = []

    def launch(args, launcher):
        raise RuntimeError("CPU engine 1/2 did not come up")

    _patch_components(monkeypatch, calls)
    monkeypatch.setattr(backend_interfaces, "resolve_engine_launcher", lambda args: "cpu launcher")
    monkeypatch.setattr(serving, "launch_rollout_servers", launch)
    monkeypatch.setattr(rollout, "check_rollout_storage", lambda _: None)
    with pytest.raises(RuntimeError, match="did not come up"):
        Manager(_straw_args(tmp_path), None)
    assert calls == []


def test_a_step_whose_engines_died_stops_the_run_with_how_to_resume():
    """A step fails because its engines died (their node lost): `RunInterrupted` naming them, not a traceback; a
    failure with every engine alive is raised as it is."""
    from slime.errors import RunInterrupted

    server = serving.RolloutServer(SimpleNamespace(), None, ["http://a", "http://b"], ["a", "b"])
    manager = _bare_manager(
        SimpleNamespace(), servers={"model": server}, _health_monitors=[], batch_builder=SimpleNamespace()
    )

    def engines_gone(rollout_id, start_time):
        server.all_engines[:] = [None, None]  # what the health check finds afterwards
        raise RuntimeError("Rollout engine http://a/generate failed 4 time(s)\nmore detail")

    manager._generate = engines_gone
    with pytest.raises(RunInterrupted) as stopped:
        manager.generate(3)
    message = str(stopped.value)
    assert message.startswith("rollout step 3 failed because engine(s) http://a, http://b died during it (last error: ")
    assert "Rollout engine http://a/generate failed 4 time(s))" in message and "more detail" not in message
    assert "rerun the same command to resume from its last joint commit" in message

    server.all_engines[:] = ["a", "b"]
    manager._generate = lambda rollout_id, start_time: (_ for _ in ()).throw(ValueError("a bug"))
    with pytest.raises(ValueError, match="a bug"):
        manager.generate(4)
