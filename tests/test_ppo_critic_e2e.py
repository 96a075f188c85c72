"""PPO with a critic end to end on the CPU demo (`--advantage-estimator ppo --use-critic`, docs/ppo.md).

- A run killed at a random moment (every process at once) and rerun ends with bitwise the policy, the critic, the
  rewards and the losses of an uninterrupted run: the joint checkpoint restores the critic's weights, optimizer
  and schedule with the policy's, and every step trained its batch exactly once across the kills.
- The demo reaches its reward target with PPO's settings from docs/ppo.md; in `nox -s extended`, to keep CI
  within its time budget.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime.testing import run_records
from slime.testing.chaos import KillPlan, joint_commit_count, run_with_kills

PPO_FLAGS = ["--advantage-estimator", "ppo", "--use-critic"]
#: docs/ppo.md: PPO's demo settings, the critic trained alone for the first steps (its fresh head's first
#: estimates are noise, which the policy would otherwise learn from).
DEMO_FLAGS = ["--num-critic-only-steps", "5"]
RUN_TIMEOUT_S = 420
COMPARED_METRICS = ("rollout/reward", "train/loss", "train/pg_loss", "critic/value_loss", "critic/values")


def _args(save: Path, num_rollout: int, save_interval: int, *extra: str) -> list[str]:
    steps = ["--num-rollout", str(num_rollout), "--save-interval", str(save_interval), "--save", str(save)]
    return ["--plugin", "straw", *PPO_FLAGS, *extra, *steps]


def _weights(save: Path, part: str, step: int) -> dict:
    from safetensors.torch import load_file

    pattern = f"**/{part}iter_{step:07d}/model.safetensors"
    found = [path for path in sorted(save.glob(pattern)) if part or "critic" not in path.parts]
    assert len(found) == 1, f"expected one {part or 'policy '}checkpoint of step {step} under {save}, found {found}"
    return load_file(found[0])


@pytest.mark.e2e
@pytest.mark.slow
def test_a_killed_ppo_run_resumes_to_bitwise_the_policy_and_critic_of_an_uninterrupted_one(tmp_path: Path) -> None:
    import torch

    # Step 1 trains the critic alone and commits nothing (its saves are the next commit's base); 3 and 5 commit.
    num_rollout, interval, critic_only = 6, 2, ("--num-critic-only-steps", "2")
    reference = tmp_path / "uninterrupted" / "run"
    run_records.run_to_end(
        _args(reference, num_rollout, interval, *critic_only), reference, tmp_path / "uninterrupted.log", RUN_TIMEOUT_S
    )

    save = tmp_path / "killed" / "run"
    save.parent.mkdir(parents=True)
    args = _args(save, num_rollout, interval, *critic_only)
    plan = KillPlan(kills=1, seed=5)
    kills = run_with_kills(args, save, tmp_path / "killed.log", plan, commit_count=joint_commit_count)
    run_records.run_to_end(args, save, tmp_path / "killed.log", RUN_TIMEOUT_S)

    expected_metrics = run_records.metrics_by_step(reference, COMPARED_METRICS)
    # Every step logs the critic's metrics; the policy's from step 2 on, once it trains.
    assert all(set(COMPARED_METRICS) <= set(expected_metrics[step]) for step in range(2, num_rollout))
    assert all({"critic/value_loss", "critic/values"} <= set(expected_metrics[step]) for step in range(2))
    assert run_records.metrics_by_step(save, COMPARED_METRICS) == expected_metrics, f"kills: {kills}"
    for part in ("", "critic/"):
        expected, got = _weights(reference, part, num_rollout - 1), _weights(save, part, num_rollout - 1)
        assert expected.keys() == got.keys()
        assert all(torch.equal(expected[name], got[name]) for name in expected), f"{part or 'policy'}; kills: {kills}"
    committed = list(run_records.commits(reference))
    assert committed and list(run_records.commits(save)) == committed
    run_records.assert_trained_once(save, committed)
    # Each joint commit binds the critic's checkpoint with the policy's: its marker lists (and sized) both.
    for step, marker in run_records.commits(save).items():
        listed = json.loads(marker.read_text())["files"]
        for part in ("", "critic/"):
            assert f"{part}iter_{step:07d}/model.safetensors" in listed, (step, part, sorted(listed))


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.extended  # a few minutes; `nox -s extended` runs it, CI's time goes to the resume test above
def test_ppo_trains_the_demo_to_its_reward_target(tmp_path: Path) -> None:
    from slime.utils.external_utils.slime_run_process import SlimeRunProcess

    save = tmp_path / "run"
    run = SlimeRunProcess(_args(save, 120, 1000, *DEMO_FLAGS), tmp_path / "run.log", cwd=tmp_path)
    mean, first = run_records.run_until_reward_target(run, save, 600)
    assert mean >= run_records.DEMO_TARGET, (mean, first)
