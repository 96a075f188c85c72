"""The training driver's orchestration: step order, save-before-weights, failures stop the run, observers."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
from fakes import fake_actor_handle, fake_object

from slime import hookimpl
from slime.ray.actor_group import RayTrainGroup
from slime.ray.rollout import RolloutManager

TRAIN_PY = Path(__file__).parents[1] / "train.py"

#: One row of the rollout report's `samples` (what `rollout_examples` returns).
EXAMPLE_ROW = {"group": 0, "prompt": "copy: ab", "response": "ab", "reward": 1.0}


def _manager(log: list, fail_generate_at: int | None = None, **behaviours):
    """The rollout manager's handle, recording into `log` as "manager.<method>"; admission reports paused."""

    def generate(rollout_id):
        if rollout_id == fail_generate_at:
            raise RuntimeError(f"rollout {rollout_id} failed")
        return [f"ref-{rollout_id}"]

    behaviours = {
        "generate": generate,
        "pause_rollout_admission": True,
        "rollout_report": {"metrics": {"rollout/reward": 0.25}, "samples": [EXAMPLE_ROW]},
        "eval": {"eval/held-out/reward": 0.5},
        **behaviours,
    }
    return fake_actor_handle(RolloutManager, log, "manager", **behaviours)


def _group(log: list, role: str, **behaviours):
    """A training group recording into `log` as "<role>.<method>"; `async_train` returns one metrics dict."""

    def async_train(rollout_id, rollout_data_ref, external_data=None):
        return [{"loss": 0.5, "role": role}]

    return fake_object(RayTrainGroup, log, role, **{"async_train": async_train, **behaviours})


@pytest.fixture
def train_module(monkeypatch):
    spec = importlib.util.spec_from_file_location("train_under_test", TRAIN_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.ray, "get", lambda value: value)
    return module


def _args(**overrides):
    values = dict(
        start_rollout_id=0,
        num_rollout=3,
        save_interval=1,
        eval_interval=None,
        use_critic=False,
        num_critic_only_steps=0,
        save="/unused",
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def _wire(module, monkeypatch, log, *, critic=False, save_fails_at=None):
    actor = _group(log, "actor")
    critic_model = _group(log, "critic") if critic else None
    monkeypatch.setattr(module, "create_training_models", lambda args, pgs, manager: (actor, critic_model))

    def save_checkpoint(args, rollout_id, actor_model, critic_model, rollout_manager, *, actor_trains, restore_plan):
        log.append(("save_checkpoint", (rollout_id, actor_trains, restore_plan), {}))
        if rollout_id == save_fails_at:
            raise OSError("save failed")

    monkeypatch.setattr(module, "save_checkpoint", save_checkpoint)
    return actor


def _names(log):
    return [name for name, *_ in log]


def test_each_step_trains_completes_saves_then_updates_weights(train_module, monkeypatch):
    log: list = []
    _wire(train_module, monkeypatch, log)
    train_module.train(_args(num_rollout=2), {}, _manager(log), None, "plan")
    step = [
        "manager.generate",
        "actor.async_train",
        "manager.training_completed",
        "save_checkpoint",
        "manager.pause_rollout_admission",
        "actor.update_weights",
    ]
    assert _names(log) == [
        "actor.update_weights",
        "manager.training_ready",
        *step,
        "manager.resume_rollout_admission",
        *step,  # No resume after the last step: nothing more will be generated.
        "manager.dispose",
    ]
    assert ("save_checkpoint", (1, True, "plan"), {}) in log
    assert ("manager.training_completed", (1,), {}) in log


def test_save_interval_and_critic_only_steps(train_module, monkeypatch):
    log: list = []
    _wire(train_module, monkeypatch, log, critic=True)
    args = _args(start_rollout_id=4, num_rollout=8, save_interval=2, use_critic=True, num_critic_only_steps=6)
    train_module.train(args, {}, _manager(log), 4, None)
    assert [a[0] for n, a, _ in log if n == "save_checkpoint"] == [5, 7]
    assert [a[1] for n, a, _ in log if n == "save_checkpoint"] == [False, True]  # actor_trains by step
    assert [a[0] for n, a, _ in log if n == "actor.async_train"] == [6, 7]
    # The actor receives the critic's value refs.
    assert ("actor.async_train", (6, ["ref-6"]), {"external_data": [{"loss": 0.5, "role": "critic"}]}) in log
    assert _names(log).count("actor.update_weights") == 5


def test_failed_save_stops_the_run_before_new_weights(train_module, monkeypatch):
    log: list = []
    _wire(train_module, monkeypatch, log, save_fails_at=1)
    with pytest.raises(OSError, match="save failed"):
        train_module.train(_args(num_rollout=3), {}, _manager(log), None, None)
    names = _names(log)
    assert names[-1] == "save_checkpoint"
    assert names.count("manager.generate") == 2 and names.count("actor.update_weights") == 2
    assert "manager.dispose" not in names


def test_failed_rollout_trains_nothing(train_module, monkeypatch):
    log: list = []
    _wire(train_module, monkeypatch, log)
    with pytest.raises(RuntimeError, match="rollout 0 failed"):
        train_module.train(_args(), {}, _manager(log, fail_generate_at=0), None, None)
    assert _names(log) == ["actor.update_weights", "manager.training_ready", "manager.generate"]


def test_release_train_recreates_ranks_and_always_saves(train_module, monkeypatch):
    log: list = []
    _wire(train_module, monkeypatch, log)
    train_module.train(_args(num_rollout=2, save_interval=None, release_train=True), {}, _manager(log), None, None)
    names = _names(log)
    assert names.count("actor.create") == 2 and names.count("save_checkpoint") == 2
    assert names.index("actor.create") < names.index("actor.async_train")


def test_eval_before_training_and_periodically(train_module, monkeypatch):
    log: list = []
    _wire(train_module, monkeypatch, log)
    train_module.train(_args(num_rollout=4, eval_interval=2, save_interval=None), {}, _manager(log), None, None)
    assert [a[0] for n, a, _ in log if n == "manager.eval"] == [0, 1, 3]
    log.clear()
    # The last step is evaluated whatever the interval: the run ends with its final model's scores.
    train_module.train(_args(num_rollout=5, eval_interval=3, save_interval=None), {}, _manager(log), None, None)
    assert [a[0] for n, a, _ in log if n == "manager.eval"] == [0, 2, 4]


def _eval_observer(monkeypatch, seen: list):
    from slime.plugin_manager import PluginSelection

    plugin = types.ModuleType("slime_test_eval_observer")

    @hookimpl
    def slime_after_eval(args, rollout_id, metrics):
        seen.append((rollout_id, metrics))

    plugin.slime_after_eval = slime_after_eval
    monkeypatch.setitem(sys.modules, plugin.__name__, plugin)
    return PluginSelection(plugins=(plugin.__name__,), autoload=False)


def test_each_eval_reaches_the_observers_with_its_metrics(train_module, monkeypatch):
    seen: list = []
    selection = _eval_observer(monkeypatch, seen)
    log: list = []
    _wire(train_module, monkeypatch, log)
    args = _args(num_rollout=2, eval_interval=1, save_interval=None, plugin_selection=selection)
    train_module.train(args, {}, _manager(log), None, None)
    assert seen == [(step, {"eval/held-out/reward": 0.5}) for step in (0, 0, 1)]


@pytest.mark.parametrize(("start", "logged_at"), [(0, 0), (5, 4)])
def test_eval_only_evaluates_the_loaded_weights_once_and_trains_nothing(train_module, monkeypatch, start, logged_at):
    seen: list = []
    log: list = []
    _wire(train_module, monkeypatch, log)
    args = _args(
        num_rollout=None, start_rollout_id=start, eval_only=True, plugin_selection=_eval_observer(monkeypatch, seen)
    )
    train_module.train(args, {}, _manager(log), None, None)
    names = _names(log)
    assert names.index("actor.update_weights") < names.index("manager.eval")
    assert "manager.generate" not in names and "actor.async_train" not in names and "save_checkpoint" not in names
    assert names[-1] == "manager.dispose"
    assert seen == [(logged_at, {"eval/held-out/reward": 0.5})]


def test_observer_hooks_are_called_with_the_run_plugins(train_module, monkeypatch):
    from slime.plugin_manager import PluginSelection

    seen: list = []
    plugin = types.ModuleType("slime_test_train_observer")

    @hookimpl
    def slime_after_rollout(args, rollout_id, metrics, samples):
        seen.append(("rollout", rollout_id, metrics, samples))

    @hookimpl
    def slime_after_train_step(args, rollout_id, metrics):
        seen.append(("train", rollout_id, metrics["loss"]))

    @hookimpl
    def slime_checkpoint_committed(args, rollout_id, path):
        seen.append(("commit", rollout_id, path))

    plugin.slime_after_rollout = slime_after_rollout
    plugin.slime_after_train_step = slime_after_train_step
    plugin.slime_checkpoint_committed = slime_checkpoint_committed
    monkeypatch.setitem(sys.modules, plugin.__name__, plugin)
    log: list = []
    _wire(train_module, monkeypatch, log)
    args = _args(num_rollout=1, plugin_selection=PluginSelection(plugins=(plugin.__name__,), autoload=False))
    train_module.train(args, {}, _manager(log), None, None)
    assert seen == [
        ("rollout", 0, {"rollout/reward": 0.25}, [EXAMPLE_ROW]),
        ("train", 0, 0.5),
        ("commit", 0, "/unused"),
    ]


def test_joint_commit_records_the_weights_that_generated_the_step(train_module, monkeypatch, tmp_path):
    """With the real joint checkpoint: the marker of step s names weight version s + 1 and the saved files."""
    log: list = []
    updates = []

    def save_model(step, force_sync=False):
        model = tmp_path / f"iter_{step:07d}"
        model.mkdir()
        (model / "weights.pt").write_bytes(b"w")

    actor = _group(
        log,
        "actor",
        args=SimpleNamespace(save=str(tmp_path)),
        save_model=save_model,
        update_weights=lambda: updates.append(1),
    )
    monkeypatch.setattr(train_module, "create_training_models", lambda *a: (actor, None))

    def save_rollout(step):
        for name in ("queue_state", "builder_state"):
            (tmp_path / "rollout").mkdir(exist_ok=True)
            (tmp_path / "rollout" / f"{name}_{step}.json").write_text("{}")

    manager = _manager(log, save=save_rollout, get_weight_version=lambda: 5 + len(updates))
    args = _args(
        start_rollout_id=5,
        num_rollout=7,
        save=str(tmp_path),
        rollout_data_dir=str(tmp_path / "pool"),
        rollout_data_transport="straw",
        release_train=False,
        debug_train_only=False,
        debug_rollout_only=False,
    )
    train_module.train(args, {}, manager, None, None)
    for step in (5, 6):
        marker = json.loads((tmp_path / "rollout" / f"committed_{step}.json").read_text())
        assert marker["weight_version"] == step + 1
        assert set(marker["files"]) == {
            f"iter_{step:07d}/weights.pt",
            f"rollout/queue_state_{step}.json",
            f"rollout/builder_state_{step}.json",
        }
    assert [call.args for call in manager.save.calls] == [(5,), (6,)]
