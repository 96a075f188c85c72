"""The CPU demo (`slime-run --plugin straw`) trained by the Megatron backend learns, at TP=1 and at TP=2, and a TP=2
run killed mid-way resumes from its joint commit (Megatron's distributed checkpoint inside it) with every committed
step's prompts and samples trained exactly once.

The Megatron backend does not declare `--deterministic`, so these runs sample differently every time, and the demo's
learning varies from run to run: measured over 16 seeds with `benchmarks/demo_floor.py --eps-clip-high 0.28`, every
seed reached a 10-step mean reward of 0.6 within 73 steps, but one in 16 had not reached 0.9 after 100 (without the
clip-higher range, one in 8, and a CI run sat at 0.27 for 80 steps). The runs therefore use `--eps-clip-high 0.28`
and are held to LEARNED_REWARD (0.6, from about 0.02 at step 0) rather than the deterministic demo's 0.9; that the
Megatron backend computes the same loss and updates as one rank of the torch backend is checked exactly by
test_model.py and test_actor_parallel.py. Each run gets `--num-rollout` well past that and is ended as soon as it
gets there (`slime.testing.run_records.run_until_reward_target`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from slime.testing import run_records
from slime.utils.external_utils.slime_run_process import SlimeRunProcess

pytestmark = [pytest.mark.megatron, pytest.mark.e2e, pytest.mark.slow]

NUM_ROLLOUT = 100
SAVE_INTERVAL = 5
RUN_TIMEOUT_S = 600
#: A 10-step mean reward that shows the demo learned (see the module docstring).
LEARNED_REWARD = 0.6
TP2 = ["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--train-num-cpus-per-rank", "0.5"]


def _start(save: Path, log: Path, *extra: str) -> SlimeRunProcess:
    args = [
        "--plugin",
        "straw",
        "--train-backend",
        "megatron",
        "--num-rollout",
        str(NUM_ROLLOUT),
        "--eps-clip-high",
        "0.28",
    ]
    args += ["--save", str(save), "--save-interval", str(SAVE_INTERVAL)]
    return SlimeRunProcess([*args, *extra], log, cwd=save.parent)


def _assert_committed_every_interval_and_trained_once(save: Path) -> dict[int, Path]:
    commits = run_records.commits(save)
    assert commits, "the run made no joint commit"
    expected = list(range(SAVE_INTERVAL - 1, max(commits) + 1, SAVE_INTERVAL))
    run_records.assert_trained_once(save, expected)
    return commits


def _train_state(commits: dict[int, Path]) -> dict:
    step = max(commits)
    return json.loads((commits[step].parent.parent / f"iter_{step:07d}" / "train_state.json").read_text())


def test_demo_on_megatron_learns(tmp_path: Path) -> None:
    save = tmp_path / "run"
    run = _start(save, tmp_path / "run.log")
    mean, first = run_records.run_until_reward_target(run, save, RUN_TIMEOUT_S, target=LEARNED_REWARD)
    print(f"TP=1: {run_records.DEMO_WINDOW}-step mean reward {mean:.3f} from step {first}")
    commits = _assert_committed_every_interval_and_trained_once(save)
    state = _train_state(commits)
    assert state["tensor_model_parallel_size"] == 1 and state["optimizer_saved"]


def test_demo_on_megatron_tp2_killed_resumes_and_learns(tmp_path: Path) -> None:
    save = tmp_path / "run"
    log = tmp_path / "run.log"
    first_run = _start(save, log, *TP2)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (save / "rollout" / "committed_9.json").exists():
        assert first_run.poll() is None, f"the first run ended before its second commit:\n{first_run.log_tail()}"
        assert time.monotonic() < deadline, "no joint commit of step 9 appeared in time"
        time.sleep(0.2)
    first_run.kill()
    assert (save / "iter_0000009" / "dist").is_dir(), "the joint commit lacks Megatron's distributed checkpoint"

    rerun = _start(save, log, *TP2)
    mean, first = run_records.run_until_reward_target(rerun, save, RUN_TIMEOUT_S, target=LEARNED_REWARD)
    print(f"TP=2, killed at step 9+: {run_records.DEMO_WINDOW}-step mean reward {mean:.3f} from step {first}")
    branch = json.loads((run_records.branches(save)[-1] / "rollout" / "branch.json").read_text())
    assert branch["parent"]["step"] >= 9
    commits = _assert_committed_every_interval_and_trained_once(save)
    assert max(commits) > branch["parent"]["step"], "the rerun committed nothing"
    assert _train_state(commits)["tensor_model_parallel_size"] == 2
