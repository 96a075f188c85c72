"""`ray_head`, `ray_worker`: a Ray cluster started with `ray start` for a test or a benchmark to join.

The head runs in its own processes with its own temporary directory (kept short: Ray's socket paths are limited to
about 100 characters), listens on loopback, and is stopped with everything it started when the context ends.
`ray_worker` adds a worker node on this machine: its own raylet and workers, its own resources, a node of the
cluster like one on another machine; `WorkerNode.kill()` ends every process of it at once, as a lost machine.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from slime.utils.external_utils.run_processes import TAG_VARIABLE, kill_tagged, new_tag

#: Seconds a worker node may take to join the cluster.
JOIN_TIMEOUT_S = 60.0


def free_port() -> int:
    """A TCP port of loopback that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def ray_head(num_cpus: int, resources: Mapping[str, float] | None = None) -> Iterator[tuple[str, dict[str, str]]]:
    """Start a head node with `num_cpus` CPUs (and custom `resources`); yields its address (`127.0.0.1:PORT`, for
    `--ray-address`) and the environment to start its clients with (without `RAY_ADDRESS`)."""
    temp_dir = tempfile.mkdtemp(prefix="sray-", dir="/tmp")
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    command = ["ray", "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}"]
    command += ["--disable-usage-stats", "--include-dashboard=false", f"--temp-dir={temp_dir}"]
    if resources:
        command.append(f"--resources={json.dumps(dict(resources))}")
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


class WorkerNode:
    """A worker node started by `ray_worker`; `kill()` SIGKILLs its raylet, agents and every worker process."""

    def __init__(self, process: subprocess.Popen, tag: str, log: Path, address: str, env: Mapping[str, str]) -> None:
        self.process = process
        self.tag = tag
        self.log = log
        self.address = address
        self.env = dict(env)
        self.killed = False

    def kill(self) -> None:
        """SIGKILL every process of the node, then wait until the cluster no longer counts it alive (Ray notices a
        lost node only after missed heartbeats, about 15 s)."""
        if self.killed:
            return
        alive = _alive_nodes(self.address, self.env)
        kill_tagged(self.tag)
        self.process.wait(timeout=30)
        self.killed = True
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while _alive_nodes(self.address, self.env) >= alive:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster at {self.address} still counts the killed node alive")
            time.sleep(1)


_CLUSTER_STATE = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
print("slime-cluster-state:", json.dumps({
    "alive_nodes": sum(1 for node in ray.nodes() if node["Alive"]),
    "total_cpus": ray.cluster_resources().get("CPU", 0),
    "free_cpus": ray.available_resources().get("CPU", 0),
}))
"""


def cluster_state(address: str, env: Mapping[str, str]) -> dict[str, float]:
    """What a fresh driver sees of the cluster at `address`: `alive_nodes`, `total_cpus` and `free_cpus` (from a
    separate process, so the caller never joins the cluster itself)."""
    result = subprocess.run(
        [sys.executable, "-c", _CLUSTER_STATE, address],
        env={**env, "RAY_AUTH_MODE": "token"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    # Ray may print its own warnings to stdout around the line (e.g. about a raylet's lagging heartbeats).
    lines = [line for line in result.stdout.splitlines() if line.startswith("slime-cluster-state: ")]
    if not lines:
        raise RuntimeError(f"the cluster-state probe printed no state line; stdout: {result.stdout[-2000:]!r}")
    return json.loads(lines[-1].removeprefix("slime-cluster-state: "))


def _alive_nodes(address: str, env: Mapping[str, str]) -> int:
    return int(cluster_state(address, env)["alive_nodes"])


@contextmanager
def ray_worker(
    address: str, env: Mapping[str, str], num_cpus: int, resources: Mapping[str, float] | None = None
) -> Iterator[WorkerNode]:
    """Add a worker node with `num_cpus` CPUs (and custom `resources`) to the cluster at `address` (`env`: what
    `ray_head` yielded); yields once the cluster counts one more alive node. Killed at the end if still running."""
    tag = new_tag()
    before = _alive_nodes(address, env)
    command = ["ray", "start", f"--address={address}", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}"]
    command += ["--disable-usage-stats", "--block"]
    if resources:
        command.append(f"--resources={json.dumps(dict(resources))}")
    log = Path(tempfile.mkdtemp(prefix="sray-worker-", dir="/tmp")) / "ray-start.log"
    with open(log, "wb") as handle:
        process = subprocess.Popen(
            command,
            env={**env, "RAY_AUTH_MODE": "token", TAG_VARIABLE: tag},
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    node = WorkerNode(process, tag, log, address, env)
    try:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while _alive_nodes(address, env) <= before:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`{' '.join(command)}` did not join the cluster:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield node
    finally:
        if not node.killed:
            kill_tagged(tag)
            process.wait(timeout=30)
        shutil.rmtree(log.parent, ignore_errors=True)
