"""Joint checkpoints: commit validation, selection failure paths, checkpoint policies and retention."""

import json
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace

import pytest
from fakes import Call, fake_actor_handle, fake_object

from slime.data.checkpoint import commit_checkpoint, committed_steps, resolve_checkpoint, save_checkpoint
from slime.plugins.checkpoint_policies import prune_checkpoints, retained_steps
from slime.ray.actor_group import RayTrainGroup
from slime.ray.rollout import RolloutManager


def _step(root: Path, step: int, pool: Path, *, run_id: str = "rollout", commit: bool = True) -> Path:
    """A tiny model payload, both rollout snapshots and (optionally) the joint commit of `step` in `root`."""
    model = root / f"iter_{step:07d}"
    model.mkdir(parents=True)
    (model / "weights.pt").write_bytes(f"weights-{step}".encode())
    (model / "common.json").write_text(json.dumps({"step": step}))
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))
    rollout = root / "rollout"
    rollout.mkdir(exist_ok=True)
    for name in ("queue_state", "builder_state"):
        (rollout / f"{name}_{step}.json").write_text(json.dumps({"name": name, "step": step}))
    if commit:
        args = SimpleNamespace(save=str(root), rollout_data_dir=str(pool), rollout_queue_run_id=run_id)
        commit_checkpoint(args, step, model_args=[args])
    return rollout / f"committed_{step}.json"


def _restore(load, save, *, step=None, **extra) -> SimpleNamespace:
    base = dict(
        rollout_data_transport="straw",
        load=None if load is None else str(load),
        save=str(save),
        ckpt_step=step,
        start_rollout_id=None,
        rollout_data_dir=None,
    )
    return SimpleNamespace(**{**base, **extra})


# ------------------------------------------------------------------------------------------------ commit


def test_commit_records_sizes_hashes_and_defaults(tmp_path):
    marker = _step(tmp_path / "run", 4, tmp_path / "pool")
    value = json.loads(marker.read_text())
    assert value["version"] == 1 and value["rollout_id"] == 4 and value["resumable"]
    assert value["weight_version"] == 5 and value["run_id"] == "rollout"
    assert value["rollout_data_dir"] == str((tmp_path / "pool").resolve())
    assert value["files"]["iter_0000004/weights.pt"] == {"size": len(b"weights-4")}
    assert "sha256" in value["files"]["iter_0000004/common.json"]
    assert "sha256" in value["files"]["rollout/queue_state_4.json"]
    assert committed_steps(tmp_path / "run") == [4]


def test_commit_is_immutable_and_requires_every_component(tmp_path):
    root, pool = tmp_path / "run", tmp_path / "pool"
    _step(root, 1, pool)
    args = SimpleNamespace(save=str(root), rollout_data_dir=str(pool))
    with pytest.raises(FileExistsError, match="immutable"):
        commit_checkpoint(args, 1, model_args=[args])
    _step(root, 2, pool, commit=False)
    (root / "rollout/builder_state_2.json").unlink()
    with pytest.raises(ValueError, match="Missing builder_state checkpoint"):
        commit_checkpoint(args, 2, model_args=[args])
    with pytest.raises(ValueError, match="Missing model checkpoint payloads"):
        commit_checkpoint(args, 3, model_args=[args])
    outside = SimpleNamespace(save=str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match="inside --save"):
        commit_checkpoint(args, 2, model_args=[outside])
    assert committed_steps(root) == [1]


def test_commit_rejects_symlinked_payloads(tmp_path):
    root, pool = tmp_path / "run", tmp_path / "pool"
    _step(root, 0, pool, commit=False)
    (tmp_path / "real.pt").write_bytes(b"x")
    (root / "iter_0000000/link.pt").symlink_to(tmp_path / "real.pt")
    args = SimpleNamespace(save=str(root), rollout_data_dir=str(pool))
    with pytest.raises(ValueError, match="symlinks"):
        commit_checkpoint(args, 0, model_args=[args])
    assert not (root / "rollout/committed_0.json").exists()


def test_commit_through_plan_requires_current_branch(tmp_path):
    from slime.data.checkpoint import RestorePlan

    root, pool = tmp_path / "run", tmp_path / "pool"
    _step(root, 0, pool, commit=False)
    (root / "rollout/current.json").write_text(json.dumps({"version": 1, "directory": str(tmp_path / "other")}))
    args = SimpleNamespace(save=str(root), rollout_data_dir=str(pool))
    with pytest.raises(RuntimeError, match="Current branch changed"):
        commit_checkpoint(args, 0, model_args=[args], restore_plan=RestorePlan(root=str(root)))


# ------------------------------------------------------------------------------------------- selection


def test_marker_of_another_version_is_rejected(tmp_path):
    root = tmp_path / "run"
    marker = _step(root, 3, tmp_path / "pool")
    value = json.loads(marker.read_text())
    marker.write_text(json.dumps({**value, "version": 2}))
    with pytest.raises(ValueError, match="incompatible"):
        resolve_checkpoint(_restore(root, tmp_path / "child", step=3))


def test_missing_or_edited_component_is_rejected(tmp_path):
    root = tmp_path / "run"
    _step(root, 3, tmp_path / "pool")
    (root / "iter_0000003/common.json").write_text(json.dumps({"step": 9}))  # same size, other content
    with pytest.raises(ValueError, match="Checkpoint component changed: iter_0000003/common.json"):
        resolve_checkpoint(_restore(root, tmp_path / "child", step=3))
    (root / "iter_0000003/common.json").write_text(json.dumps({"step": 3}))
    (root / "iter_0000003/weights.pt").unlink()
    with pytest.raises(FileNotFoundError, match="weights.pt"):
        resolve_checkpoint(_restore(root, tmp_path / "child", step=3))


def test_edited_tracker_pointing_at_uncommitted_step_fails(tmp_path):
    root = tmp_path / "run"
    _step(root, 2, tmp_path / "pool")
    _step(root, 4, tmp_path / "pool")
    (root / "latest_checkpointed_iteration.txt").write_text("3\n")  # no commit, no model for step 3
    with pytest.raises(ValueError, match="No committed model/source checkpoint for step 3"):
        resolve_checkpoint(_restore(root, root))
    (root / "latest_checkpointed_iteration.txt").write_text("not a step")
    with pytest.raises(ValueError, match="must hold a step number"):
        resolve_checkpoint(_restore(root, root))


def test_named_marker_must_exist(tmp_path):
    root = tmp_path / "run"
    _step(root, 1, tmp_path / "pool")
    with pytest.raises(FileNotFoundError, match="committed_2.json"):
        resolve_checkpoint(_restore(root / "rollout/committed_2.json", tmp_path / "child"))


def test_checkpoint_of_another_run_or_pool_is_rejected(tmp_path):
    root = tmp_path / "run"
    _step(root, 1, tmp_path / "pool", run_id="other")
    with pytest.raises(ValueError, match="another straw run"):
        resolve_checkpoint(_restore(root, tmp_path / "a", step=1))
    pool_args = _restore(root, tmp_path / "b", step=1, rollout_queue_run_id="other")
    pool_args.rollout_data_dir = str(tmp_path / "different-pool")
    with pytest.raises(ValueError, match="original shared straw pool"):
        resolve_checkpoint(pool_args)
    with pytest.raises(ValueError, match="optimizer and RNG"):
        resolve_checkpoint(_restore(root, tmp_path / "c", step=1, rollout_queue_run_id="other", no_load_rng=True))
    with pytest.raises(ValueError, match="checkpoint's next step is 2"):
        bad = _restore(root, tmp_path / "d", step=1, rollout_queue_run_id="other")
        bad.start_rollout_id = 5
        resolve_checkpoint(bad)


def test_non_durable_and_debug_runs_select_nothing(tmp_path):
    root = tmp_path / "run"
    _step(root, 1, tmp_path / "pool")
    from slime.interfaces import run_transport

    for args, resolve in (
        (
            _restore(root, root, step=1, rollout_data_transport="object-store"),
            lambda a: run_transport(a).resolve_restore(),
        ),
        (_restore(root, root, step=1, debug_train_only=True), resolve_checkpoint),
    ):
        before = vars(args).copy()
        resolved, plan = resolve(args)
        assert resolved is args and plan.mode == "new" and plan.root is None and vars(args) == before


def test_concurrent_job_is_refused_by_the_save_dir_lock(tmp_path):
    from slime.data.queue_data_source import RolloutQueueController

    root = tmp_path / "run"
    first, plan_first = resolve_checkpoint(_restore(None, root))
    second, plan_second = resolve_checkpoint(_restore(None, root))
    with closing(RolloutQueueController(first, restore_plan=plan_first)):
        with pytest.raises(RuntimeError, match="Another training job"):
            RolloutQueueController(second, restore_plan=plan_second)


# ---------------------------------------------------------------------------------------------- policies


def _save_args(tmp_path, **extra):
    base = dict(
        rollout_data_transport="straw",
        release_train=False,
        num_rollout=10,
        use_critic=False,
        debug_train_only=False,
        debug_rollout_only=False,
        save=str(tmp_path),
    )
    return SimpleNamespace(**{**base, **extra})


def _writing_models(tmp_path):
    """An actor group and a manager handle that write real payloads, so the joint policy can commit."""

    def save_model(step, force_sync=False):
        (tmp_path / f"iter_{step:07d}").mkdir(parents=True)
        (tmp_path / f"iter_{step:07d}/weights.pt").write_bytes(b"w")
        (tmp_path / "latest_checkpointed_iteration.txt").write_text(str(step))

    def save_rollout(step):
        (tmp_path / "rollout").mkdir(exist_ok=True)
        for name in ("queue_state", "builder_state"):
            (tmp_path / f"rollout/{name}_{step}.json").write_text("{}")

    actor = fake_object(RayTrainGroup, args=SimpleNamespace(save=str(tmp_path)), save_model=save_model)
    manager = fake_actor_handle(RolloutManager, save=save_rollout, get_weight_version=42)
    return actor, manager


def test_joint_policy_commits_with_serving_weight_version(tmp_path, monkeypatch):
    monkeypatch.setattr("ray.get", lambda value: value)
    actor, manager = _writing_models(tmp_path)
    save_checkpoint(_save_args(tmp_path), 3, actor, None, manager, actor_trains=True)
    assert actor.save_model.calls == [Call("save_model", (3,), {"force_sync": True})]
    assert json.loads((tmp_path / "rollout/committed_3.json").read_text())["weight_version"] == 42


def test_checkpoint_policy_flag_overrides_the_transport(tmp_path, monkeypatch):
    monkeypatch.setattr("ray.get", lambda value: value)
    actor, manager = _writing_models(tmp_path)
    save_checkpoint(_save_args(tmp_path, checkpoint_policy="plain"), 3, actor, None, manager, actor_trains=True)
    assert not (tmp_path / "rollout/committed_3.json").exists()
    assert manager.save.calls == [Call("save", (3,), {})]
    from slime.plugin_manager import PluginError

    with pytest.raises(PluginError, match="'nope'"):
        save_checkpoint(_save_args(tmp_path, checkpoint_policy="nope"), 4, actor, None, manager, actor_trains=True)


def test_object_store_final_step_forces_sync(tmp_path, monkeypatch):
    monkeypatch.setattr("ray.get", lambda value: value)
    actor, manager = fake_object(RayTrainGroup), fake_actor_handle(RolloutManager)
    args = _save_args(tmp_path, rollout_data_transport="object-store")
    save_checkpoint(args, 9, actor, None, manager, actor_trains=True)
    assert actor.save_model.calls == [Call("save_model", (9,), {"force_sync": True})]
    assert manager.save.calls == [Call("save", (9,), {})]


# --------------------------------------------------------------------------------------------- retention


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "protected", "expected"),
    [
        (None, None, (), set(range(10))),
        (2, None, (), {8, 9}),
        (2, 4, (), {0, 4, 8, 9}),
        (1, 5, (3,), {0, 3, 5, 9}),
        (3, None, (42,), {7, 8, 9}),
    ],
)
def test_retained_steps(keep_last, keep_every, protected, expected):
    assert retained_steps(range(10), keep_last=keep_last, keep_every=keep_every, protected=protected) == expected


def test_retained_steps_rejects_bad_counts():
    with pytest.raises(ValueError, match="must be >= 1"):
        retained_steps([1, 2], keep_last=0)
    with pytest.raises(ValueError, match="must be >= 1"):
        retained_steps([1, 2], keep_last=1, keep_every=0)


def test_prune_keeps_branch_parents_trackers_and_pins(tmp_path):
    root, pool = tmp_path / "run", tmp_path / "pool"
    for step in range(6):
        _step(root, step, pool)
    child = root / "branches" / "abc" / "rollout"
    child.mkdir(parents=True)
    (child / "branch.json").write_text(json.dumps({"parent": {"directory": str(root), "step": 1}}))
    (root / "rollout/retained_steps.json").write_text("[2]")
    args = SimpleNamespace(save=str(root), keep_last_checkpoints=1, keep_every_checkpoint=None)
    assert prune_checkpoints(args) == [0, 3, 4]
    assert committed_steps(root) == [1, 2, 5]
    assert not (root / "iter_0000000").exists() and not (root / "rollout/queue_state_3.json").exists()
    assert (root / "iter_0000001/weights.pt").exists()
    assert prune_checkpoints(SimpleNamespace(save=str(root))) == []  # default: keep all
