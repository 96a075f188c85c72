"""Machine-failure kills of a `slime-run` lineage, for the chaos test and `benchmarks/chaos.py`.

`run_with_kills` starts the same command again and again, each time SIGKILLing every process of it at once (see
`SlimeRunProcess.kill`) at a seeded random moment, and checks after each kill that none of its processes is left.
A share of the kills (`KillPlan.startup_share`) comes during start-up, a uniform number of seconds after the
command started; the others come a uniform number of seconds after the run's next joint commit, a window about two
steps long, so generation, training, saving and the weight update after a commit are all hit. Measuring from the
commit rather than from the start keeps the kills in the same phases whatever the machine's speed, and makes every
such run add at least one commit to the lineage. The first kill comes between the first trained step and the first
commit (`phase="trained-uncommitted"`): the rerun must train that step's prompt groups again, from the initial model.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from slime.testing import run_records
from slime.utils.external_utils.slime_run_process import SlimeRunProcess


@dataclass(frozen=True)
class KillPlan:
    """How kill moments are drawn (seconds)."""

    kills: int
    seed: int
    startup_share: float = 0.3
    startup_window_s: tuple[float, float] = (1.0, 8.0)
    #: After a commit the demo updates the engines' weights (~0.2 s), then generates and trains the next step
    #: (~0.8 s per step on 2 cores) and commits again (every 2 steps in the chaos runs).
    after_commit_window_s: tuple[float, float] = (0.0, 1.6)
    commit_timeout_s: float = 300.0
    #: The first kill comes once step 0 has trained, within this window (before the first commit at step 1).
    first_step_window_s: tuple[float, float] = (0.0, 0.3)


@dataclass(frozen=True)
class Kill:
    """One kill: its phase (`startup` or `after-commit`), when it came (seconds after the command started), the
    commits and pool size it left."""

    phase: str
    delay_s: float
    committed_steps: int
    pool_bytes: int


def directory_bytes(directory: Path) -> int:
    """The total size of the regular files under `directory` (0 when it does not exist)."""
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file()) if directory.exists() else 0


def joint_commit_count(save: Path) -> int:
    """The joint commits of a straw run's lineage (what a rerun resumes from)."""
    return len(run_records.commits(save)) if (save / "rollout").exists() else 0


def tracked_checkpoint_count(save: Path) -> int:
    """The checkpoints of a run without joint commits (object-store): the `iter_*` directories up to the step that
    `latest_checkpointed_iteration.txt` names (written after the checkpoint it names)."""
    tracker = save / "latest_checkpointed_iteration.txt"
    if not tracker.exists() or not tracker.read_text().strip():
        return 0
    latest = int(tracker.read_text())
    return sum(1 for path in save.glob("iter_*") if int(path.name.removeprefix("iter_")) <= latest)


def _wait_for_commit_beyond(
    run: SlimeRunProcess, save: Path, count: int, timeout_s: float, commit_count: Callable[[Path], int]
) -> None:
    deadline = time.monotonic() + timeout_s
    while commit_count(save) <= count:
        if run.poll() is not None:
            raise AssertionError(f"the run ended before its next commit:\n{run.log_tail()}")
        if time.monotonic() > deadline:
            run.kill()
            raise AssertionError(f"no new commit within {timeout_s:.0f}s:\n{run.log_tail()}")
        time.sleep(0.05)


def _wait_for_trained_step(run: SlimeRunProcess, save: Path, timeout_s: float) -> None:
    """Wait until `metrics.jsonl` has a trained step (a `train/loss` line)."""
    metrics = save / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and '"train/loss"' in metrics.read_text()):
        if run.poll() is not None:
            raise AssertionError(f"the run ended before training a step:\n{run.log_tail()}")
        if time.monotonic() > deadline:
            run.kill()
            raise AssertionError(f"no trained step within {timeout_s:.0f}s:\n{run.log_tail()}")
        time.sleep(0.02)


def run_with_kills(
    args: Sequence[str],
    save: Path,
    log: Path,
    plan: KillPlan,
    commit_count: Callable[[Path], int] = joint_commit_count,
) -> list[Kill]:
    """Run `slime-run ARGS` (saving under `save`, its pool at `save/rollout_data`) `plan.kills` times, each killed
    at a moment drawn by `plan`; raises AssertionError when a run ended before its kill or a process of it
    survived the kill. `commit_count(save)` counts what a rerun can resume from (`tracked_checkpoint_count` for a
    transport without joint commits)."""
    rng = random.Random(plan.seed)
    record = []
    for index in range(plan.kills):
        before = commit_count(save)
        run = SlimeRunProcess(args, log, cwd=save.parent)
        if index == 0:
            phase = "trained-uncommitted"
            _wait_for_trained_step(run, save, plan.commit_timeout_s)
            delay = rng.uniform(*plan.first_step_window_s)
        elif rng.random() < plan.startup_share:
            phase, delay = "startup", rng.uniform(*plan.startup_window_s)
        else:
            phase, delay = "after-commit", rng.uniform(*plan.after_commit_window_s)
            _wait_for_commit_beyond(run, save, before, plan.commit_timeout_s, commit_count)
        time.sleep(delay)
        if run.poll() is not None:
            raise AssertionError(f"the run ended before its kill:\n{run.log_tail()}")
        run.kill()
        if survivors := run.processes():
            raise AssertionError(f"processes of the killed run survived: {survivors}")
        if phase == "trained-uncommitted" and commit_count(save):
            raise AssertionError("the first kill came after the first commit; shorten first_step_window_s")
        elapsed = time.time() - run.started
        record.append(Kill(phase, elapsed, commit_count(save), directory_bytes(save / "rollout_data")))
    return record
