"""Every process of one `slime-run`, found by an environment tag, and a kill that takes them all at once.

A run's processes do not share one process group: Ray starts its GCS, raylet and dashboard from the driver,
each Ray worker gets a process group of its own, and engine servers are children of those workers; a
`killpg` of the driver's group leaves the workers running (an actor was seen writing 2.2 s after such a
"kill"), and a process whose parent died is re-parented away from the driver's tree. What they all keep is
the environment they inherited: the process that starts `slime-run` puts a unique `SLIME_RUN_TAG` into it,
and `tagged_processes(tag)` finds every live process carrying it by reading `/proc/<pid>/environ` (Linux).

`kill_tagged(tag)` is a machine failure for tests and benchmarks: it SIGSTOPs every tagged process (repeating
the scan until no new one appears, so nothing spawns or writes past the freeze), then SIGKILLs them all.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

TAG_VARIABLE = "SLIME_RUN_TAG"
_PROC = Path("/proc")


def new_tag() -> str:
    """A fresh tag for one run's environment (`{TAG_VARIABLE: new_tag()}`)."""
    return uuid.uuid4().hex


def _state(pid: int) -> str | None:
    """The process's state letter from `/proc/<pid>/stat` (`Z` for a zombie); None once it is gone."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def tagged_processes(tag: str) -> list[int]:
    """The pids of the live (not zombie) processes whose environment has `SLIME_RUN_TAG=<tag>`."""
    marker = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environment = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if marker in environment.split(b"\0") and _state(int(entry.name)) not in (None, "Z"):
            found.append(int(entry.name))
    return sorted(found)


def command_line(pid: int) -> str:
    """The process's command line as one string (Ray workers show `ray::<Actor class>.<method>` there); empty once
    it is gone."""
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def kill_tagged(tag: str, settle_s: float = 10.0) -> list[int]:
    """Freeze every process tagged `tag`, then SIGKILL them all; returns the pids killed.

    Raises RuntimeError naming the survivors when some tagged process is still alive `settle_s` seconds later.
    """
    frozen: set[int] = set()
    while True:
        fresh = [pid for pid in tagged_processes(tag) if pid not in frozen]
        if not fresh:
            break
        _signal(fresh, signal.SIGSTOP)
        frozen.update(fresh)
    killed = sorted(frozen)
    _signal(killed, signal.SIGKILL)
    deadline = time.monotonic() + settle_s
    while survivors := tagged_processes(tag):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of run {tag} survived SIGKILL: {survivors}")
        _signal(survivors, signal.SIGKILL)
        time.sleep(0.05)
    return killed
