"""Storage faults on the real CPU stack: the demo's save directory (and with it its straw pool) on a small tmpfs.

- Full: the tmpfs is too small for the run, which fills it after a few joint commits;
- read-only: the tmpfs turns read-only between two commits.

Either way the run stops with exit status 1 (`RunInterrupted`, like a run whose process died: not the user's
mistake in the command, and the same command resumes) and one line naming the fault, what was being written, the
path and the way on; the full traceback is in the log above it. No process of the run is left, and every joint
commit left behind is complete (the marker is written last). Once the filesystem has room again, or is writable
again, the same command resumes from the last joint commit and runs to the end, and `slime-run runs audit` proves
from the records that nothing was lost or trained twice.

Which write meets the fault first depends on where in its step the run is when the space runs out (or the mount
flips), so each test accepts one of the messages `expected_messages` quotes, every one of them exact but for step
numbers. Mounting needs root (CAP_SYS_ADMIN): without it the tests skip.

The read-only flip is `mount --bind D D` then `mount -o remount,bind,ro D`: a plain `mount -o remount,ro` of a
filesystem with files open for writing (the run's metrics file, its engines' logs, its lock files) fails with
"mount point is busy", so the run's new path lookups are turned read-only instead, through a fresh read-only bind
mount stacked on the tmpfs, while the files it holds open stay writable; `mount -o remount,bind,rw D` makes the
path writable again.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slime.testing import run_records
from slime.utils.external_utils.slime_run_process import SlimeRunProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_ROLLOUT = 8
#: Measured on the demo: ~0.5 MiB at start (model, prompts), then per step ~0.96 MiB of joint commit (model,
#: optimizer, queue and builder snapshots), ~0.5 MiB of straw pool and a 0.33 MiB weight export that is removed
#: once the engines loaded it. 6 MiB fills during the fourth step (three or so commits).
FULL_SIZE = "6m"
ROOMY_SIZE = "200m"
STEP_TIMEOUT_S = 180
RUN_TIMEOUT_S = 420
#: The actors of a run and its engine processes: none may outlive the driver's exit.
RUN_ACTORS = ("ray::TorchTrainRayActor", "ray::RolloutManager", "ray::RolloutQueueController", "ray::CPUEngineActor")

NO_SPACE = ("no space left on device", "free space on that filesystem")
READ_ONLY = ("read-only file system", "make that filesystem writable again (remount it read-write)")


def expected_messages(save: Path, fault: tuple[str, str]) -> list[str]:
    """The lines `slime-run` may print for `fault` under `save` (regular expressions: exact but for step numbers),
    one per write that may meet the fault first."""
    reason, remedy = fault
    s = re.escape(str(save))
    on_disk = f"on the filesystem holding {s}"
    places = [
        # seen: the trainer saving the model of the step (the largest write, ~1 MiB)
        rf"saving the model checkpoint \(TorchTrainRayActor\.save_model\), writing {s}/iter_\d{{7}}",
        # seen: the trainer exporting the new weights for the engines after a commit
        rf"exporting the new weights for the engines \(TorchTrainRayActor\.update_weights\), writing {s}/weights/"
        r"weight_v\d{6}",
        # seen: the driver removing the weights the engines loaded
        rf"handing the new weights to the engines, writing {s}/weights/weight_v\d{{6}}",
        # seen: the rollout manager publishing a rollout to the pool
        rf"storing a rollout in the straw pool \(RolloutManager\.generate\), {on_disk}/rollout_data",
        # the pool's other writers
        rf"(recording a trained step|recording the rollout queue|closing the straw pool) in the straw pool "
        rf"\((RolloutManager|RolloutQueueController)\.\w+\), {on_disk}/rollout_data",
        # the joint commit's snapshots and marker
        rf"saving the rollout queue and batch-builder state \(RolloutManager\.save\), "
        rf"(writing {s}/rollout/(queue|builder)_state_\d+\.(json|partial)|{on_disk})",
        rf"committing the joint checkpoint, (writing {s}/rollout/committed_\d+\.json|{on_disk})",
        # a metrics line (the driver's or the rollout manager's)
        rf"writing the run's metrics( \(RolloutManager\.\w+\))?, {on_disk}",
    ]
    resume = (
        "rerun the same command: it resumes from its last joint commit "
        f"(`slime-run runs {save}` shows which step that is)"
    )
    return [
        rf"slime-run: error: {reason} while {place}; {re.escape(remedy)} and {re.escape(resume)}" for place in places
    ]


class Tmpfs:
    """Mounts small tmpfs filesystems under `tmp_path` and the runs writing to them; `close()` kills every run
    (so nothing holds a mount), then unmounts everything, stacked mounts included."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mounts: list[Path] = []
        self.runs: list[SlimeRunProcess] = []

    def mount(self, name: str, size: str) -> Path:
        path = self.root / name
        path.mkdir()
        result = _mount("-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path))
        if result.returncode != 0:
            denied = ("permission denied", "must be superuser", "operation not permitted")
            if any(text in result.stderr.lower() for text in denied):
                pytest.skip(f"mounting a tmpfs is not permitted here (needs root or CAP_SYS_ADMIN): {result.stderr}")
            raise AssertionError(f"mount -t tmpfs {path} failed: {result.stderr}")
        self.mounts.append(path)
        return path

    def start(self, args: list[str], log: Path) -> SlimeRunProcess:
        run = SlimeRunProcess(args, log, cwd=self.root)
        self.runs.append(run)
        return run

    def close(self) -> None:
        for run in self.runs:
            run.kill()
        for path in reversed(self.mounts):
            for _ in range(10):
                if subprocess.run(["mountpoint", "-q", str(path)]).returncode != 0:
                    break
                if _mount_command("umount", str(path)).returncode != 0:
                    time.sleep(1)
            else:
                _mount_command("umount", "-l", str(path))  # last resort: detach it lazily


def _mount_command(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), capture_output=True, text=True, timeout=60)


def _mount(*arguments: str) -> subprocess.CompletedProcess:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs is not permitted here: not root (needs CAP_SYS_ADMIN)")
    return _mount_command("mount", *arguments)


def _must(*arguments: str) -> None:
    result = _mount(*arguments)
    assert result.returncode == 0, f"mount {' '.join(arguments)} failed: {result.stderr}"


def _must_remount_read_only(path: Path) -> None:
    """Turn the bind mount at `path` read-only. The kernel refuses (EBUSY) while a file is open for writing through
    it, which a running demo does several times a second: try again for up to 10 s."""
    deadline = time.monotonic() + 10
    while (result := _mount("-o", "remount,bind,ro", str(path))).returncode != 0:
        assert "busy" in result.stderr and time.monotonic() < deadline, f"remount read-only failed: {result.stderr}"
        time.sleep(0.01)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    mounts = Tmpfs(tmp_path)
    try:
        yield mounts
    finally:
        mounts.close()


def _wait_for_commits(run: SlimeRunProcess, save: Path, count: int) -> list[int]:
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while True:
        committed = list(run_records.commits(save)) if (save / "rollout").exists() else []
        if len(committed) >= count:
            return committed
        assert run.poll() is None, f"the run ended after committing {committed}:\n{run.log_tail()}"
        assert time.monotonic() < deadline, f"{count} commits took over {STEP_TIMEOUT_S}s:\n{run.log_tail()}"
        time.sleep(0.1)


def _stopped_cleanly(run: SlimeRunProcess, save: Path, fault: tuple[str, str]) -> str:
    """Wait for the run the fault stopped: exit status 1, the fault's line after the last traceback of the log, no
    actor or engine left once the driver exited, every joint commit complete. Returns the printed line."""
    try:
        returncode = run.process.wait(timeout=STEP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the run did not stop on the storage fault in {STEP_TIMEOUT_S}s:\n{run.log_tail()}")
    deadline = time.monotonic() + 60
    while survivors := [pid for actor in RUN_ACTORS for pid in run.processes_named(actor)]:
        assert time.monotonic() < deadline, f"actors of the run outlived its driver by 60 s: {survivors}"
        time.sleep(0.5)
    assert run.wait(timeout=60) == returncode  # removes Ray's own helpers, as after any driver exit
    assert run.processes() == []
    log = run.log.read_text(errors="replace")
    tail = run.log_tail()
    assert returncode == 1, f"exit status {returncode}\n{tail}"
    errors = re.findall(r"slime-run: error: [^\r\n]*", log)
    assert len(errors) == 1, tail
    printed = errors[0]
    assert any(re.fullmatch(pattern, printed) for pattern in expected_messages(save, fault)), printed
    assert log.rfind("Traceback") < log.rfind(printed), f"a traceback follows the error line:\n{tail}"
    _assert_commits_complete(save)
    return printed


def _assert_commits_complete(save: Path) -> None:
    """`slime-run runs` shows every commit complete and no problem, and no marker names a missing or changed file."""
    result = subprocess.run(
        [sys.executable, "-m", "slime.cli", "runs", str(save), "--json"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    report = json.loads(result.stdout)
    assert report["problems"] == [], report["problems"]
    commits = [commit for branch in report["branches"] for commit in branch["commits"]]
    assert commits and all(commit["problem"] is None for commit in commits), commits
    for step, marker in run_records.commits(save).items():
        branch = marker.parent.parent
        for name, expected in json.loads(marker.read_text())["files"].items():
            path = branch / name
            assert path.is_file() and path.stat().st_size == expected["size"], f"step {step}: {path}"


def _resume_to_the_end(tmpfs: Tmpfs, args: list[str], log: Path, save: Path) -> None:
    """Rerun the same command: it resumes after the last joint commit, runs to the end, and the audit is clean."""
    last = max(run_records.commits(save))
    started = time.monotonic()
    run = tmpfs.start(args, log)
    returncode = run.wait(timeout=RUN_TIMEOUT_S)
    assert returncode == 0, run.log_tail()
    print(f"rerun from step {last + 1}: {time.monotonic() - started:.0f}s")
    commits = run_records.commits(save)
    assert sorted(commits) == list(range(NUM_ROLLOUT))
    resumed = {step for step, marker in commits.items() if marker.parent.parent != save}
    assert resumed == set(range(last + 1, NUM_ROLLOUT)), "the rerun did not continue after the last joint commit"
    audit = subprocess.run(
        [sys.executable, "-m", "slime.cli", "runs", "audit", str(save)], capture_output=True, text=True, timeout=300
    )
    assert audit.returncode == 0, f"{audit.stdout}\n{audit.stderr}"


def _args(save: Path) -> list[str]:
    return ["--plugin", "straw", "--num-rollout", str(NUM_ROLLOUT), "--save-interval", "1", "--save", str(save)]


def test_a_full_filesystem_stops_the_run_clearly_and_the_same_command_resumes(tmpfs: Tmpfs) -> None:
    disk = tmpfs.mount("disk", FULL_SIZE)
    save, log = disk / "run", tmpfs.root / "run.log"
    run = tmpfs.start(_args(save), log)

    printed = _stopped_cleanly(run, save, NO_SPACE)
    print(printed)
    committed = list(run_records.commits(save))
    assert 1 <= len(committed) < NUM_ROLLOUT, f"{FULL_SIZE} should fill after a few commits, not at {committed}"

    _must("-o", f"remount,size={ROOMY_SIZE}", str(disk))
    _resume_to_the_end(tmpfs, _args(save), log, save)


def test_a_filesystem_turned_read_only_stops_the_run_clearly_and_the_same_command_resumes(tmpfs: Tmpfs) -> None:
    disk = tmpfs.mount("disk", ROOMY_SIZE)
    save, log = disk / "run", tmpfs.root / "run.log"
    run = tmpfs.start(_args(save), log)
    _wait_for_commits(run, save, 2)  # between two commits: the run goes on to its next step
    _must("--bind", str(disk), str(disk))
    tmpfs.mounts.append(disk)  # the stacked bind mount: unmounted first
    _must_remount_read_only(disk)

    printed = _stopped_cleanly(run, save, READ_ONLY)
    print(printed)

    _must("-o", "remount,bind,rw", str(disk))
    _resume_to_the_end(tmpfs, _args(save), log, save)
