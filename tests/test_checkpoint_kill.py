"""A job killed (SIGKILL) at any point of the joint save sequence resumes from the last complete commit."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime.data.checkpoint import committed_steps, resolve_checkpoint

# Runs in a child process: commits step 0 completely, then saves step 1 and kills itself at `point`.
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from types import SimpleNamespace
    import ray
    from slime.data import checkpoint
    from slime.data.checkpoint import save_checkpoint

    root, point = Path(sys.argv[1]), sys.argv[2]
    sys.path.insert(0, sys.argv[3])  # tests/, for fakes
    from fakes import fake_actor_handle, fake_object
    from slime.ray.actor_group import RayTrainGroup
    from slime.ray.rollout import RolloutManager

    ray.get = lambda value, **kw: value

    def die(where, step):
        if step == 1 and point == where:
            os.kill(os.getpid(), signal.SIGKILL)

    def model(save, name):  # a training group whose save_model writes a real payload, then may die
        def save_model(step, force_sync=False):
            directory = save / f"iter_{step:07d}"
            directory.mkdir(parents=True)
            (directory / "weights.pt").write_bytes(os.urandom(64))
            (save / "latest_checkpointed_iteration.txt").write_text(str(step))
            die(f"after_{name}", step)
        return fake_object(RayTrainGroup, args=SimpleNamespace(save=str(save)), save_model=save_model)

    def save_rollout(step):
        (root / "rollout").mkdir(exist_ok=True)
        for name in ("queue_state", "builder_state"):
            (root / f"rollout/{name}_{step}.json").write_text("{}")
        die("after_rollout", step)

    commit = checkpoint.commit_checkpoint

    def commit_then_die(args, step, **kwargs):
        marker = commit(args, step, **kwargs)
        die("after_marker", step)
        return marker

    import slime.plugins.checkpoint_policies as policies

    policies.commit_checkpoint = commit_then_die
    manager = fake_actor_handle(RolloutManager, save=save_rollout, get_weight_version=1)
    args = SimpleNamespace(
        rollout_data_transport="straw", release_train=False, num_rollout=10, use_critic=True,
        debug_train_only=False, debug_rollout_only=False, save=str(root), rollout_data_dir=str(root / "pool"),
    )
    actor, critic = model(root, "actor"), model(root / "critic", "critic")
    for step in (0, 1):
        save_checkpoint(args, step, actor, critic, manager, actor_trains=True)
    """
)


@pytest.mark.parametrize(
    ("point", "expected"),
    [("after_actor", 0), ("after_critic", 0), ("after_rollout", 0), ("after_marker", 1), ("never", 1)],
)
def test_kill_during_save_resumes_from_last_complete_marker(tmp_path, point, expected):
    root = tmp_path / "run"
    command = [sys.executable, "-c", CHILD, str(root), point, str(Path(__file__).parent)]
    child = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if point == "never":
        assert child.returncode == 0, child.stderr
    else:
        assert child.returncode == -signal.SIGKILL, child.stderr
    assert committed_steps(root) == list(range(expected + 1))
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    args = SimpleNamespace(
        rollout_data_transport="straw",
        save=str(root),
        load=str(root),
        ckpt_step=None,
        start_rollout_id=None,
        rollout_data_dir=None,
    )
    args, plan = resolve_checkpoint(args)
    # The selected step is the last complete marker, restored into a fresh branch: nothing of the
    # interrupted step (its model directory, its rollout state) is read or reused.
    assert plan.mode == "snapshot" and plan.branch["parent"]["step"] == expected
    assert args.ckpt_step == expected and args.start_rollout_id == expected + 1
    assert Path(args.save).parent == root / "branches" and not Path(args.save).exists()
    assert json.loads((root / f"rollout/committed_{expected}.json").read_text())["rollout_id"] == expected
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before, "resolution changed the disk"
