"""The rollout-engine and train-backend contracts (`slime.backend_interfaces`): the built-ins keep them, the
real torch backend's weight export is what the real CPU engine loads, and a plugin that breaks them is
refused at run start, naming itself and what it lacks."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from slime.backend_interfaces import (
    ENGINE_ENDPOINTS,
    EngineLauncher,
    LaunchedEngines,
    PluginContractError,
    TrainBackend,
    check_engine_launcher,
    check_launched_engines,
    check_train_backend,
    data_parallel_size,
    resolve_engine_launcher,
    resolve_train_backend,
    weight_dir,
)
from slime.plugin_manager import PluginSelection
from slime.plugins.cpu_engine import LaunchedEngines as CPULaunchedEngines
from slime.plugins.cpu_engine import launch_cpu_engines
from slime.plugins.torch_backend import TorchTrainRayActor
from slime.weight_sync import WeightUpdate


def test_the_builtin_backends_keep_their_contracts():
    assert resolve_train_backend(SimpleNamespace()) is TorchTrainRayActor
    assert resolve_engine_launcher(SimpleNamespace()) is launch_cpu_engines
    check_train_backend(TorchTrainRayActor, "torch", "torch_backend", SimpleNamespace(use_critic=False))
    check_engine_launcher(launch_cpu_engines, "cpu", "cpu_engine")
    assert isinstance(TorchTrainRayActor(world_size=1, rank=0), TrainBackend)
    assert isinstance(launch_cpu_engines, EngineLauncher)
    launched = CPULaunchedEngines(["http://127.0.0.1:1", "http://127.0.0.1:2"], ["a", "b"])
    assert isinstance(launched, LaunchedEngines)
    assert check_launched_engines(launched, 2, "cpu") == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert weight_dir("/w", 12) == Path("/w/weight_v000012")


def test_data_parallel_size_is_the_world_unless_the_backend_splits_the_model():
    args = SimpleNamespace(model_parallel=2)

    class ModelParallel:
        @staticmethod
        def data_parallel_size(args, world_size):
            return world_size // args.model_parallel

    class Broken:
        @staticmethod
        def data_parallel_size(args, world_size):
            return 3

    assert data_parallel_size(TorchTrainRayActor, args, 4) == 4
    assert data_parallel_size(ModelParallel, args, 4) == 2
    with pytest.raises(PluginContractError, match=r"Broken.data_parallel_size\(args, 4\) returned 3"):
        data_parallel_size(Broken, args, 4)


def test_launcher_results_that_are_not_engine_urls_are_refused():
    with pytest.raises(PluginContractError, match=r"rollout engine 'x': its launcher was asked for 2 engines"):
        check_launched_engines(["http://127.0.0.1:1"], 2, "x")
    with pytest.raises(PluginContractError, match="must return the engines' URLs"):
        check_launched_engines("http://127.0.0.1:1", 1, "x")
    with pytest.raises(PluginContractError, match="1 actors for 2 engine URLs"):
        check_launched_engines(CPULaunchedEngines(["http://a", "http://b"], ["a"]), 2, "x")


class FooActor:
    def init(self, args, role, with_ref=False, with_opd_teacher=False):
        return 0

    def save_model(self, rollout_id, force_sync=False):
        pass

    def update_weights(self, update):
        pass


def test_a_backend_class_that_breaks_the_contract_is_refused_naming_what_it_lacks():
    with pytest.raises(PluginContractError) as error:
        check_train_backend(FooActor, "x", "slime_foo")
    message = "train backend 'x' (plugin 'slime_foo'): FooActor lacks train(rollout_id, rollout_data_ref)"
    assert str(error.value) == message

    class NoArgsTrain(FooActor):
        def train(self):
            return {}

    with pytest.raises(PluginContractError, match=r"NoArgsTrain.train\(self\) does not accept the call train\("):
        check_train_backend(NoArgsTrain, "x")

    class Trains(FooActor):
        def train(self, rollout_id, rollout_data_ref):
            return {}

    check_train_backend(Trains, "x")
    with pytest.raises(PluginContractError, match=r"does not accept the call train\(rollout_id, rollout_data_ref, ext"):
        check_train_backend(Trains, "x", args=SimpleNamespace(use_critic=True))

    class NeedsRank(Trains):
        def __init__(self, rank):
            self.rank = rank

    class OldUpdate(Trains):
        def update_weights(self):
            pass

    with pytest.raises(PluginContractError, match=r"OldUpdate.update_weights\(self\) does not accept the call update_"):
        check_train_backend(OldUpdate, "x")

    with pytest.raises(PluginContractError, match=r"NeedsRank\(\) must be constructible without arguments"):
        check_train_backend(NeedsRank, "x")
    with pytest.raises(PluginContractError, match="must be the class of one training rank"):
        check_train_backend(Trains(), "x")


def test_an_engine_launcher_that_breaks_the_contract_is_refused():
    with pytest.raises(PluginContractError, match=r"rollout engine 'y' \(plugin 'p'\): RolloutEngineSpec.target must"):
        check_engine_launcher("http://127.0.0.1:30000", "y", "p")
    with pytest.raises(PluginContractError, match=r"does not accept the call launcher\(args, num_engines\)"):
        check_engine_launcher(lambda args: [], "y", "p")


BROKEN_PLUGIN = """
from slime import hookimpl
from slime.specs import RolloutEngineSpec, TrainBackendSpec


class FooActor:
    def init(self, args, role, with_ref=False, with_opd_teacher=False):
        return 0

    def save_model(self, rollout_id, force_sync=False):
        pass

    def update_weights(self, update):
        pass


@hookimpl
def slime_train_backends():
    return [TrainBackendSpec("foo", FooActor)]


@hookimpl
def slime_rollout_engines():
    return [RolloutEngineSpec("remote", "http://10.0.0.1:30000")]
"""


def test_run_start_refuses_a_broken_plugin_before_any_actor_starts(tmp_path, monkeypatch):
    import ray

    from slime.ray.placement_group import create_placement_groups

    (tmp_path / "slime_foo_backend.py").write_text(textwrap.dedent(BROKEN_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    selection = PluginSelection(plugins=("slime_foo_backend",), autoload=False)
    args = SimpleNamespace(plugin_selection=selection, train_backend="foo", rollout_engine="cpu")
    assert not ray.is_initialized()
    with pytest.raises(PluginContractError) as error:
        create_placement_groups(args)  # checks come before Ray is touched: this would fail without a cluster
    assert str(error.value) == (
        "train backend 'foo' (plugin 'slime_foo_backend'): FooActor lacks train(rollout_id, rollout_data_ref)"
    )
    args.train_backend, args.rollout_engine = "torch", "remote"
    with pytest.raises(PluginContractError, match=r"rollout engine 'remote' \(plugin 'slime_foo_backend'\): Rollout"):
        create_placement_groups(args)
    args.debug_train_only = True  # no engines in this run: their launcher is not needed
    with pytest.raises(Exception, match="Ray has not been started|not initialized|ray.init"):
        create_placement_groups(args)
    assert not ray.is_initialized()
    sys.modules.pop("slime_foo_backend", None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from slime.plugins.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def test_the_cpu_engine_serves_the_contract_and_loads_the_torch_backends_export(model_dir, tmp_path):
    from slime.plugins.cpu_engine_server import EngineServer

    engine = EngineServer(str(model_dir), num_threads=1)
    try:
        served = {(method, route.path) for route in engine._http._server.config.app.routes for method in route.methods}
        assert {(e.method, e.path) for e in ENGINE_ENDPOINTS} <= served
        with httpx.Client(base_url=engine.url, timeout=60) as http:
            body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}
            reply = http.post("/generate", json=body).json()
            meta = reply["meta_info"]
            assert isinstance(reply["text"], str) and len(meta["output_token_logprobs"]) == len(reply["output_ids"])
            assert meta["finish_reason"]["type"] in ("stop", "length")
            assert http.get("/health").status_code == 200
            assert http.get("/model_info").json()["tokenizer_path"]
            assert isinstance(http.get("/server_info").json(), dict)
            assert http.post("/abort_request", json={"abort_all": True}).status_code == 200

            args = SimpleNamespace(hf_checkpoint=str(model_dir), save=None, load=None)
            rank = TorchTrainRayActor(world_size=1, rank=0)
            assert rank.init(args, "actor") == 0
            export = weight_dir(tmp_path / "weights", 5)
            rank.update_weights(WeightUpdate(version=5, transport="disk", disk_dir=str(export)))
            assert export.is_dir() and list(export.glob("*.safetensors"))
            loaded = http.post("/update_weights_from_disk", json={"model_path": str(export), "weight_version": "5"})
            assert loaded.status_code == 200, loaded.text
            assert http.get("/model_info").json()["weight_version"] == "5"
            assert http.post("/generate", json=body).json()["meta_info"]["weight_version"] == "5"
    finally:
        engine.stop()
