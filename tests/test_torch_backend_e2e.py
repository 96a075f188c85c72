"""The CPU demo end to end with the torch backend's `--bf16 --gradient-checkpointing` and with `--fsdp` on two ranks.

Each run is `slime-run --plugin straw` (built-in tiny model, copy task, two CPU engines) with `--save` in a temp
directory, judged from what it left on disk: the demo's target (a mean `rollout/reward` of at least 0.9 over
some 10 consecutive steps of `metrics.jsonl`), the engines serving the trained weights, and a last checkpoint
that `from_pretrained` loads, in float32.

The runs that learned the task reached the target with their 10-step window starting at step 28-42 (measured on
2 cores: float32 28 and 30, bf16 + gradient checkpointing 32, 33 and 42, FSDP 29, 35 and 36); the demo's rewards
are not deterministic (sampling depends on how requests batch in the engines), and some runs sit on a plateau
near 0.45 for 30-50 steps first. One bf16 run in CI stalled for good at 0.78 with every group answering alike:
the backend then skipped every optimizer step, entropy bonus included, so nothing could make it explore again;
since the entropy bonus acts in such steps too (`LossSettings.needs_advantages`), four runs (bf16 twice, float32
twice) reached the target with their windows starting at steps 49, 30, 34 and 30. So each run gets `NUM_ROLLOUT`
steps and ends as soon as it reaches the target (`slime.testing.run_records.run_until_reward_target`); its last
joint commit is then checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slime.plugins import torch_checkpoint as ckpt
from slime.plugins.demo_report import read_metrics
from slime.testing import run_records
from slime.utils.external_utils.slime_run_process import SlimeRunProcess

NUM_ROLLOUT = 100
#: Measured: 60 steps took 118 s (bf16) and 144 s (FSDP) on 2 cores shared with another job's run.
RUN_TIMEOUT_S = 420

RUNS = {
    "bf16-gradient-checkpointing": ("--bf16", "--gradient-checkpointing"),
    "fsdp-two-ranks": ("--fsdp", "--actor-num-gpus-per-node", "2"),
}


@pytest.mark.e2e
@pytest.mark.slow
#: Both runs (about 160 s and 120 s here) are in `nox -s extended`, to keep CI within its time budget: bf16 training
#: with float32 master weights, and FSDP on two ranks against DDP (equal losses, gradient norms and weights, resumes
#: from either's checkpoint), are checked in CI by tests/test_torch_backend_scaling.py.
@pytest.mark.extended
@pytest.mark.parametrize("label", list(RUNS))
def test_demo_reaches_its_target(tmp_path: Path, label: str) -> None:
    from transformers import AutoModelForCausalLM

    save = tmp_path / "save"
    args = ["--plugin", "straw", *RUNS[label], "--num-rollout", str(NUM_ROLLOUT), "--save", str(save)]
    run = SlimeRunProcess(args, tmp_path / "run.log", cwd=tmp_path)
    mean, first = run_records.run_until_reward_target(run, save, RUN_TIMEOUT_S)
    print(f"{label}: {run_records.DEMO_WINDOW}-step mean reward {mean:.3f} from step {first}")
    records = read_metrics(save / "metrics.jsonl")
    # The engines generated with the weights being trained: their log-probs match the trainer's (bf16 computes
    # the trainer's in bfloat16, the engines in float32: close, not equal).
    mismatch = [r["train/rollout_logprob_abs_diff"] for r in records if "train/rollout_logprob_abs_diff" in r]
    assert mismatch and max(mismatch) < 0.05, mismatch

    step = max(run_records.commits(save))  # the last joint commit before the run was ended
    directory = ckpt.iter_dir(save, step)
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    optimizer = torch.load(directory / ckpt.OPTIMIZER_FILE, weights_only=True)
    assert set(optimizer["state"]) == {name for name, _ in model.named_parameters()}
    ranks = 2 if "--fsdp" in RUNS[label] else 1
    assert {p.name for p in directory.glob("rng_state_rank*.pt")} == {f"rng_state_rank{r}.pt" for r in range(ranks)}
