"""One live slime-run per save directory: a second is refused at once naming the holder; a dead holder never blocks."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slime.data.run_lock import hold_save_directory
from slime.errors import UsageError

HOLDER = """
import sys, time
from slime.data.run_lock import hold_save_directory

with hold_save_directory(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def _start_holder(save: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(save)], stdout=subprocess.PIPE)
    assert select.select([holder.stdout], [], [], 60)[0], "the holder did not take the lock"
    assert holder.stdout.readline() == b"held\n"
    return holder


def test_a_second_run_is_refused_naming_the_holder_and_a_killed_holder_never_blocks(tmp_path):
    save = tmp_path / "save"
    holder = _start_holder(save)
    try:
        with pytest.raises(UsageError, match=rf"in use by another slime-run: pid {holder.pid} on host \S+, started"):
            with hold_save_directory(save):
                pytest.fail("a second holder took the lock")
        # The command line: refused before Ray starts, as a user's error (no traceback, status 2).
        result = subprocess.run(
            [sys.executable, "-m", "slime.cli", "--plugin", "straw", "--save", str(save)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2, result.stderr
        assert f"slime-run: error: save directory {save} is in use by another slime-run: pid {holder.pid}" in (
            result.stderr
        )
        assert "Traceback" not in result.stderr and "Started a local Ray instance" not in result.stderr
        assert not (save / "model").exists(), "the refused run wrote into the save directory"
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        holder.stdout.close()
    with hold_save_directory(save) as lock:  # the kernel released the dead holder's lock
        assert lock == save / "rollout" / "run.lock"
        assert str(os.getpid()) in lock.read_text()
    assert lock.read_text() == "", "a finished run is still named as the holder"


def test_the_lock_creates_the_save_directory_owner_only(tmp_path):
    with hold_save_directory(tmp_path / "new" / "save"):
        (tmp_path / "new" / "save" / "model").mkdir()
    for directory in (tmp_path / "new" / "save", tmp_path / "new" / "save" / "rollout"):
        assert (directory.stat().st_mode & 0o777) == 0o700, directory


def test_a_new_save_directory_the_run_wrote_nothing_into_is_removed(tmp_path):
    with hold_save_directory(tmp_path / "refused"):
        pass
    assert not (tmp_path / "refused").exists()
    with hold_save_directory(tmp_path / "used"):
        (tmp_path / "used" / "metrics.jsonl").write_text("{}\n")
    assert (tmp_path / "used" / "metrics.jsonl").exists() and (tmp_path / "used" / "rollout" / "run.lock").exists()
