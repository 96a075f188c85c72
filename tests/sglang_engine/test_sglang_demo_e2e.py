"""The CPU demo with `--rollout-engine sglang` and the straw transport: real SGLang servers generate, the torch
backend trains, weights reach the servers every step over a gloo group (`--update-weight-transport
distributed`); the run is killed once (its whole process group) and
resumed from its last joint commit, every step is trained exactly once, no SGLang process outlives the kill,
and the reward rises.

SGLang's CPU path decodes ~20 tokens/s per request, so the run is `NUM_ROLLOUT` steps rather than the demo's
full 150; `python -m benchmarks.engines` measures the step time against the CPU engine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest

from slime.utils.external_utils.slime_run_process import SlimeRunProcess

pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.slow]

NUM_ROLLOUT = 10
RUN_TIMEOUT_S = 600


def _start(save: Path, log: Path) -> SlimeRunProcess:
    argv = ["--plugin", "straw", "--rollout-engine", "sglang", "--rollout-num-engines", "1"]
    argv += ["--update-weight-transport", "distributed"]  # disk and tensor: test_sglang_weights.py
    argv += ["--num-rollout", str(NUM_ROLLOUT), "--save-interval", "1", "--save", str(save)]
    return SlimeRunProcess(argv, log, cwd=save.parent)


def _commits(save: Path) -> dict[int, Path]:
    markers = [save / "rollout", *sorted((save / "branches").glob("*/rollout"))]
    commits: dict[int, Path] = {}
    for directory in markers:
        for marker in directory.glob("committed_*.json"):
            step = int(marker.stem.removeprefix("committed_"))
            assert step not in commits, f"step {step} committed twice: {commits[step]} and {marker}"
            commits[step] = marker
    return dict(sorted(commits.items()))


def _rewards(save: Path) -> list[tuple[int, float]]:
    lines = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(line["step"], line["rollout/reward"]) for line in lines if "rollout/reward" in line]


def _sglang_servers_under(save: Path) -> list[int]:
    """Live `sglang.launch_server` processes serving this run's model."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if "sglang.launch_server" in cmdline and str(save) in cmdline:
            found.append(process.info["pid"])
    return found


def test_demo_on_sglang_learns_and_resumes_after_a_kill(tmp_path: Path) -> None:
    save = tmp_path / "run"
    log = tmp_path / "run.log"
    first = _start(save, log)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(_commits(save)) < 3:
        assert first.poll() is None, f"the first run ended before its third commit:\n{first.log_tail()}"
        assert time.monotonic() < deadline, f"no third joint commit in time:\n{first.log_tail()}"
        time.sleep(0.5)
    assert _sglang_servers_under(save), "the run's SGLang server is not running"
    first.kill()
    time.sleep(5.0)
    assert _sglang_servers_under(save) == [], "an SGLang server outlived its killed run"
    last = max(_commits(save))
    assert last < NUM_ROLLOUT - 1, "the kill came too late to test a resume"

    _start(save, log).finish(RUN_TIMEOUT_S)

    commits = _commits(save)
    assert list(commits) == list(range(NUM_ROLLOUT)), f"committed steps are not contiguous: {list(commits)}"
    for step, marker in commits.items():
        assert json.loads(marker.read_text())["weight_version"] == step + 1
    rewards = dict(_rewards(save))
    assert sorted(rewards) == list(range(NUM_ROLLOUT))
    early = sum(rewards[step] for step in range(3)) / 3
    late = sum(rewards[step] for step in range(NUM_ROLLOUT - 3, NUM_ROLLOUT)) / 3
    assert late > early, f"reward did not rise on SGLang: {rewards}"
    assert "sglang" in log.read_text().lower() and "slime-run finished" in log.read_text()
