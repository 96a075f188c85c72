"""LoRA end to end on the CPU demo (`--lora-rank 8`, docs/lora.md's settings).

- A run killed at random moments (every process at once) and rerun ends with bitwise the adapters, the rewards and
  the losses of an uninterrupted run: a resume restores the adapters, their optimizer state and the RNG exactly.
  Its checkpoints hold adapters only, and every step trained its batch exactly once across the kills.
- The reward rises above what the untrained model scores (docs/lora.md says how far LoRA gets on the demo's randomly
  initialised model, and why); in `nox -s extended`, to keep CI within its time budget.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slime.testing import run_records
from slime.testing.chaos import KillPlan, joint_commit_count, run_with_kills

pytest.importorskip("peft")

#: docs/lora.md: rank 8 adapters on every linear layer, every RMSNorm trained in full, a learning rate for adapters.
LORA_FLAGS = ["--lora-rank", "8", "--lora-modules-to-save", "norm", "--lr", "0.03"]
RUN_TIMEOUT_S = 420
COMPARED_METRICS = ("rollout/reward", "train/loss", "train/pg_loss", "train/grad_norm")


def _args(save: Path, num_rollout: int, save_interval: int) -> list[str]:
    steps = ["--num-rollout", str(num_rollout), "--save-interval", str(save_interval), "--save", str(save)]
    return ["--plugin", "straw", *LORA_FLAGS, *steps]


def _final_adapter(save: Path, step: int) -> dict:
    from safetensors.torch import load_file

    from slime.plugins import torch_lora

    found = sorted(save.glob(f"**/iter_{step:07d}/{torch_lora.ADAPTER_WEIGHTS_FILE}"))
    assert len(found) == 1, f"expected one final adapter under {save}, found {found}"
    return load_file(found[0])


@pytest.mark.e2e
@pytest.mark.slow
def test_a_killed_lora_run_resumes_to_bitwise_the_adapters_of_an_uninterrupted_one(tmp_path: Path) -> None:
    import torch

    num_rollout, interval = 8, 2
    reference = tmp_path / "uninterrupted" / "run"
    run_records.run_to_end(
        _args(reference, num_rollout, interval), reference, tmp_path / "uninterrupted.log", RUN_TIMEOUT_S
    )

    save = tmp_path / "killed" / "run"
    save.parent.mkdir(parents=True)
    args = _args(save, num_rollout, interval)
    plan = KillPlan(kills=3, seed=4)
    kills = run_with_kills(args, save, tmp_path / "killed.log", plan, commit_count=joint_commit_count)
    run_records.run_to_end(args, save, tmp_path / "killed.log", RUN_TIMEOUT_S)

    expected_metrics = run_records.metrics_by_step(reference, COMPARED_METRICS)
    assert run_records.metrics_by_step(save, COMPARED_METRICS) == expected_metrics, f"kills: {kills}"
    expected, got = _final_adapter(reference, num_rollout - 1), _final_adapter(save, num_rollout - 1)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected), f"kills: {kills}"
    committed = list(run_records.commits(reference))
    assert committed and list(run_records.commits(save)) == committed
    run_records.assert_trained_once(save, committed)
    for directory in save.glob("**/iter_*"):
        assert not (directory / "model.safetensors").exists(), f"{directory} holds full weights under LoRA"


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.extended  # about 140 s; `nox -s extended` runs it, CI's time goes to the resume test above
def test_the_lora_demo_raises_its_reward(tmp_path: Path) -> None:
    save = tmp_path / "run"
    run_records.run_to_end(_args(save, 40, 1000), save, tmp_path / "run.log", RUN_TIMEOUT_S)
    rewards = [reward for _, reward in sorted(run_records.rewards(save))]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= 2 * first and last >= 0.08, rewards
