"""Joining an existing Ray cluster (`--ray-address`, `RAY_ADDRESS`): address checks, an unreachable address named
with how long it was tried, and the demo run on a cluster started with `ray start --head`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime.errors import UsageError
from slime.ray.cluster import RaySettings, split_address, wait_for_address
from slime.testing import run_records
from slime.testing.ray_head import cluster_state, free_port, ray_head
from slime.utils.external_utils.slime_run_process import SlimeRunProcess


def test_addresses_are_host_and_port():
    assert split_address("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert split_address("[fd00::2]:6379") == ("fd00::2", 6379)
    for bad in ("10.0.0.5", "10.0.0.5:", ":6379", "head:port", "head:70000"):
        with pytest.raises(ValueError, match="expected host:port"):
            split_address(bad)
    with pytest.raises(ValueError, match=r"Ray Client addresses \(ray://\) are not supported.*ray job submit"):
        split_address("ray://head:10001")


def test_an_address_that_nothing_answers_is_named_with_the_time_tried():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(UsageError) as caught:
        wait_for_address(f"127.0.0.1:{port}", timeout_s=1.0)
    waited = time.monotonic() - started
    assert 1.0 <= waited < 5.0
    message = str(caught.value)
    assert message.startswith(f"--ray-address 127.0.0.1:{port}: no Ray cluster answered there within 1 s")
    assert "refused" in message.lower() and f"ray start --head --port {port}" in message


def test_an_address_that_answers_is_accepted_at_once():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        started = time.monotonic()
        wait_for_address(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=5.0)
        assert time.monotonic() - started < 1.0


def test_ray_address_comes_from_the_flag_then_the_environment(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert RaySettings.from_environment(SimpleNamespace()).ray_address is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert RaySettings.from_environment(SimpleNamespace()).ray_address == "10.0.0.5:6379"
    assert RaySettings.from_environment(SimpleNamespace(ray_address="auto")).ray_address == "auto"
    with pytest.raises(ValueError, match="--ray-connect-timeout"):
        RaySettings.from_args(SimpleNamespace(ray_connect_timeout=-1))


@pytest.mark.slow
def test_slime_run_stops_with_the_address_when_no_cluster_answers(tmp_path: Path):
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-m", "slime.cli", "--plugin", "straw", "--num-rollout", "1"]
        + ["--ray-address", f"127.0.0.1:{port}", "--ray-connect-timeout", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2, result.stderr
    assert f"slime-run: error: --ray-address 127.0.0.1:{port}: no Ray cluster answered there within" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture
def head():
    with ray_head(num_cpus=4) as started:
        yield started


@pytest.mark.e2e
def test_the_demo_runs_on_a_cluster_it_joins_and_leaves_it_running_and_free(tmp_path: Path, head):
    address, env = head
    save = tmp_path / "run"
    log = tmp_path / "run.log"
    run = SlimeRunProcess(
        ["--plugin", "straw", "--num-rollout", "3", "--save", str(save), "--ray-address", address], log, cwd=tmp_path
    )
    run.finish(600)
    text = log.read_text()
    assert f"joined the Ray cluster at {address}: 1 node, 4 CPUs" in text
    assert sorted(run_records.metrics_by_step(save, ("rollout/reward",))) == [0, 1, 2]
    # The run's actors and placement groups ended with it; the cluster is still up, every CPU free again.
    deadline = time.monotonic() + 60
    while (cpus := cluster_state(address, env))["free_cpus"] != cpus["total_cpus"] and time.monotonic() < deadline:
        time.sleep(2)
    assert cpus == {"alive_nodes": 1, "total_cpus": 4.0, "free_cpus": 4.0}
