"""`ray_head`: a Ray cluster of one head node started with `ray start` for a test or a benchmark to join.

The head runs in its own processes with its own temporary directory (kept short: Ray's socket paths are limited to
about 100 characters), listens on loopback, and is stopped with everything it started when the context ends.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    """A TCP port of loopback that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def ray_head(num_cpus: int) -> Iterator[tuple[str, dict[str, str]]]:
    """Start a head node with `num_cpus` CPUs; yields its address (`127.0.0.1:PORT`, for `--ray-address`) and the
    environment to start its clients with (without `RAY_ADDRESS`)."""
    temp_dir = tempfile.mkdtemp(prefix="sray-", dir="/tmp")
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    command = ["ray", "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}"]
    command += ["--disable-usage-stats", "--include-dashboard=false", f"--temp-dir={temp_dir}"]
    try:
        subprocess.run(command, env=env, check=True, capture_output=True, text=True, timeout=120)
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise RuntimeError(f"`{' '.join(command)}` failed:\n{exc.stdout}\n{exc.stderr}") from exc
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp_dir, ignore_errors=True)
