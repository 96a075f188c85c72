"""`SlimeRunProcess`: one `slime-run` command in a process group of its own, for tests and benchmarks.

The command runs as `python -m slime.cli ARGS` in a new session, so it starts its own local Ray instance and
everything it spawns (Ray's GCS and raylet, engine and trainer workers) shares its process group. `kill()`
SIGKILLs that whole group at once, the way a machine failure would end a run; `wait()` also removes any Ray
helper that outlived a driver which exited normally. Output goes to a log file, whose tail every error shows.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


class SlimeRunProcess:
    """A started `slime-run ARGS`; see the module docstring."""

    def __init__(self, args: Sequence[str], log: Path, cwd: Path, env: Mapping[str, str] | None = None) -> None:
        self.log = Path(log)
        environment = {**os.environ, "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1", **(env or {})}
        environment.pop("RAY_ADDRESS", None)  # never join a cluster the caller happens to run
        self.started = time.time()
        with open(self.log, "ab") as handle:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "slime.cli", *args],
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=environment,
                cwd=cwd,
                start_new_session=True,
            )

    def poll(self) -> int | None:
        return self.process.poll()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def kill(self) -> float:
        """SIGKILL the whole process group; returns the wall-clock time of the kill."""
        killed_at = time.time()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)
        return killed_at

    def wait(self, timeout: float) -> int:
        """Wait for the command to exit and return its status; past `timeout` seconds, kill it and raise
        `TimeoutError` with the log's tail."""
        try:
            returncode = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            self.kill()
            raise TimeoutError(f"slime-run did not finish in {timeout:.0f}s; log tail:\n{self.log_tail()}") from exc
        self.kill()  # Ray's helper processes may outlive the driver in its session
        return returncode

    def finish(self, timeout: float) -> None:
        """`wait`, then raise `RuntimeError` with the log's tail unless the command succeeded."""
        returncode = self.wait(timeout)
        if returncode != 0:
            raise RuntimeError(f"slime-run exited {returncode}; log tail:\n{self.log_tail()}")
