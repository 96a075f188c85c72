"""Chaos: the CPU demo killed like a machine failure at seeded random instants, rerun each time with the same command.

Every kill SIGKILLs every process of the run at once (driver, Ray's GCS and raylet, every Ray worker, the engine
servers) and is checked to leave none alive (`slime.testing.chaos.run_with_kills`). The first kill comes after the
first step trained and before the first commit (a rerun once left that step's prompt groups untrained); of the
others some come during start-up and some within about two steps after a joint commit, so over the kills start-up,
generation, training, saving and weight updates are all hit.
After the last kill the same command runs until the demo reaches its reward target; then `slime-run runs audit`
must prove from the save directory alone that every prompt group was trained exactly once, and the straw pool
must have stayed bounded (garbage collection keeps working across kills).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slime.testing import run_records
from slime.testing.chaos import KillPlan, run_with_kills
from slime.utils.external_utils.slime_run_process import SlimeRunProcess

#: 8 kills: the first between step 0 trained and the first commit; with this seed then 2 during start-up (1.1 and
#: 8.0 s in: before Ray is up, while the engines load) and 5 at 0.4-1.3 s after a commit.
PLAN = KillPlan(kills=8, seed=3)
NUM_ROLLOUT = 100
FINAL_RUN_TIMEOUT_S = 420


@pytest.mark.e2e
@pytest.mark.slow
def test_the_demo_survives_machine_failures_with_nothing_lost_or_trained_twice(tmp_path: Path) -> None:
    save = tmp_path / "run"
    log = tmp_path / "run.log"
    args = ["--plugin", "straw", "--num-rollout", str(NUM_ROLLOUT), "--save-interval", "2", "--save", str(save)]
    kills = run_with_kills(args, save, log, PLAN)
    assert {kill.phase for kill in kills} == {"trained-uncommitted", "startup", "after-commit"}, kills

    final = SlimeRunProcess(args, log, cwd=save.parent)
    run_records.run_until_reward_target(final, save, FINAL_RUN_TIMEOUT_S)
    assert final.processes() == []

    audit = subprocess.run(
        [sys.executable, "-m", "slime.cli", "runs", "audit", str(save)], capture_output=True, text=True, timeout=300
    )
    assert audit.returncode == 0, f"{audit.stdout}\n{audit.stderr}"
    # GC across kills: what the killed runs left that no record of the lineage references (packs of abandoned
    # attempts, the queue of a run restarted before its first commit, queues of branches outside the lineage) stays
    # under what 4 steps write, however many kills there were (8 here); each kill leaving a step behind would not.
    runs = subprocess.run(
        [sys.executable, "-m", "slime.cli", "runs", "--json", str(save)], capture_output=True, text=True, timeout=300
    )
    assert runs.returncode == 0, f"{runs.stdout}\n{runs.stderr}"
    (pool,) = json.loads(runs.stdout)["pools"]
    step_bytes = pool["total_bytes"] / (max(run_records.commits(save)) + 1)
    debris = pool["unreferenced_bytes"] + pool["outside_lineage_bytes"]
    assert debris <= 4 * step_bytes, (pool, step_bytes, [kill.pool_bytes for kill in kills])
