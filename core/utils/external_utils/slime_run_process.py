"""`SlimeRunProcess`: one `slime-run` command, every process of which can be killed at once, for tests and benchmarks.

The command runs as `python -m slime.cli ARGS` in a new session, so it starts its own local Ray instance. Its
environment carries a tag of its own (`run_processes.TAG_VARIABLE`) that everything it spawns inherits: Ray's
GCS and raylet, every Ray worker (each in a process group of its own) and the engine servers. `kill()` freezes
and SIGKILLs all of them at once, the way a machine failure would end a run, and `processes()` lists what is
still alive (nothing, after a kill); `wait()` also removes any Ray helper that outlived a driver which exited
normally. Output goes to a log file, whose tail every error shows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from slime.utils.external_utils.run_processes import (
    TAG_VARIABLE,
    command_line,
    kill_tagged,
    new_tag,
    tagged_processes,
)


class SlimeRunProcess:
    """A started `slime-run ARGS`; see the module docstring."""

    def __init__(self, args: Sequence[str], log: Path, cwd: Path, env: Mapping[str, str] | None = None) -> None:
        self.log = Path(log)
        self.tag = new_tag()
        environment = {**os.environ, "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1", **(env or {})}
        environment[TAG_VARIABLE] = self.tag
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

    def processes(self) -> list[int]:
        """The pids of this run's live processes (driver, Ray's, workers', engines')."""
        return tagged_processes(self.tag)

    def processes_named(self, prefix: str) -> list[int]:
        """The pids of this run's live processes whose command line starts with `prefix` (a Ray actor's process
        is `ray::<class name>`, e.g. `ray::TorchTrainRayActor`)."""
        return [pid for pid in self.processes() if command_line(pid).startswith(prefix)]

    def kill(self) -> float:
        """SIGKILL every process of the run at once (see the module docstring); returns the wall-clock time of
        the kill. Raises RuntimeError when a process survives it."""
        killed_at = time.time()
        kill_tagged(self.tag)
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
