"""Component faults on the real CPU stack: one process of a running demo SIGKILLed, then what the run does about it.

One lineage of the demo takes them in turn (each start-up costs ~10 s on 2 cores, so they share it):
- an engine process killed mid-rollout: the run goes on (its requests are retried on the other engine, the
  dead one is relaunched at the step boundary and gets the new weights) and keeps committing;
- the trainer actor, the queue controller and the rollout manager killed: the run stops with exit status 1 and
  a message naming the actor and how to resume, no process of it left; the same command resumes.
At the end `slime-run runs audit` proves from the save directory that nothing was lost or trained twice.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from slime.testing import run_records
from slime.utils.external_utils.slime_run_process import SlimeRunProcess

NUM_ROLLOUT = 14
STEP_TIMEOUT_S = 120


def _wait_for_commit_after(run: SlimeRunProcess, save: Path, step: int) -> int:
    """Wait until the run commits a step after `step`; that step."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while True:
        committed = [s for s in run_records.commits(save) if s > step] if (save / "rollout").exists() else []
        if committed:
            return max(committed)
        assert run.poll() is None, f"the run ended before committing a step after {step}:\n{run.log_tail()}"
        assert time.monotonic() < deadline, f"no commit after step {step} in {STEP_TIMEOUT_S}s:\n{run.log_tail()}"
        time.sleep(0.2)


def _kill_actor(run: SlimeRunProcess, actor: str) -> None:
    pids = run.processes_named(f"ray::{actor}")
    assert len(pids) == 1, f"expected one {actor} process, found {pids}"
    os.kill(pids[0], signal.SIGKILL)


@pytest.mark.e2e
@pytest.mark.slow
def test_killed_components_lose_nothing_and_the_run_resumes(tmp_path: Path) -> None:
    save = tmp_path / "run"
    log = tmp_path / "run.log"
    args = ["--plugin", "straw", "--num-rollout", str(NUM_ROLLOUT), "--save-interval", "1", "--save", str(save)]

    run = SlimeRunProcess(args, log, cwd=tmp_path)
    last = _wait_for_commit_after(run, save, -1)
    engines = run.processes_named("ray::CPUEngineActor")
    assert len(engines) == 2, engines
    time.sleep(0.3)  # past the weight update that follows a commit (~0.2 s), into the next step's generation
    os.kill(engines[0], signal.SIGKILL)
    last = _wait_for_commit_after(run, save, _wait_for_commit_after(run, save, last))
    assert "relaunched" in run.log_tail(200_000), "the killed engine was not relaunched"
    assert len(run.processes_named("ray::CPUEngineActor")) == 2

    for actor in ("TorchTrainRayActor", "RolloutQueueController", "RolloutManager"):
        _kill_actor(run, actor)
        returncode = run.wait(timeout=120)
        tail = run.log_tail()
        assert returncode == 1, f"killing the {actor}: exit status {returncode}\n{tail}"
        assert f"slime-run: error: the {actor} actor died" in tail and "rerun the same command to resume" in tail, tail
        assert run.processes() == []
        before = max(run_records.commits(save))
        run = SlimeRunProcess(args, log, cwd=tmp_path)
        _wait_for_commit_after(run, save, before)

    assert run.wait(timeout=300) == 0, run.log_tail()
    assert sorted(run_records.commits(save)) == list(range(NUM_ROLLOUT))
    run_records.assert_audit_clean(save)
