"""One live `slime-run` per save directory: the driver holds `<save>/rollout/run.lock` for the whole run.

The lock is an exclusive `flock`, which the kernel (or the shared filesystem's client) releases when the holding
process dies however it dies, so a lock left by a killed run never blocks the next one. After taking it the holder
writes who it is into the file (pid, host, start time, command); a second run on the same directory is refused at
once, before Ray starts, with that record in the message. The queue controller's own `session.lock` stays: it
covers the window where a killed driver's actors are still shutting down.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from slime.errors import UsageError

logger = logging.getLogger(__name__)

LOCK_NAME = "run.lock"


def _holder_record() -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["slime-run", *sys.argv[1:]]),
    }


def _describe_holder(handle: IO[str], path: Path) -> str:
    handle.seek(0)
    text = handle.read()
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']} (`{holder['command']}`)"
    except (ValueError, KeyError, TypeError):
        # The holder has the lock but has not written its record yet (or wrote a foreign file there).
        return f"a process that has not recorded itself in {path} yet"


@contextlib.contextmanager
def hold_save_directory(save: str | os.PathLike) -> Iterator[Path]:
    """Hold `<save>/rollout/run.lock` while the block runs (creating the directories owner-only, and removing them
    again when they were new and the run wrote nothing else); raises UsageError naming the holder when another live
    run has it."""
    root = Path(save).expanduser().resolve()
    created = not root.exists()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory = root / "rollout"
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / LOCK_NAME
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise UsageError(
                f"save directory {root} is in use by another slime-run: {_describe_holder(handle, path)}; "
                "wait for it to finish or stop it, or give this run another --save"
            ) from exc
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(_holder_record()))
        handle.flush()
        os.fsync(handle.fileno())
        try:
            yield path
        finally:
            # Emptied before the lock goes, so no reader ever sees a finished run named as the holder. On storage
            # that turned read-only or full this cannot be done; the lock is released all the same (the record
            # then names a process that is gone), and the error that ended the run is the one to report.
            try:
                handle.truncate(0)
                handle.flush()
            except OSError as exc:
                logger.warning("could not clear the holder record in %s: %s", path, exc)
            if created and [*directory.iterdir()] == [path] and [*root.iterdir()] == [directory]:
                # A run refused before it wrote anything (a bad input) leaves no save directory behind.
                path.unlink()
                directory.rmdir()
                root.rmdir()
