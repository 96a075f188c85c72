"""A run on a Ray cluster of two nodes started with `ray start`, its straw pool on a JuiceFS volume.

The head node offers the custom resource `slime_train`, the worker node `slime_rollout`; the run pins its training
rank to the first (`--train-resources`) and its engines to the second (`--rollout-resources`). The worker node is
then killed mid-run, every process of it at once, as a lost machine: the run stops with one line saying the engines
cannot be relaunched and how to resume. With a new worker node, the same command resumes and finishes, every step
trained exactly once. A layout the cluster cannot hold is refused first, naming what each node lacks.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from slime.testing import juicefs, run_records
from slime.testing.ray_head import ray_head, ray_worker
from slime.utils.external_utils.slime_run_process import SlimeRunProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.juicefs]

NUM_ROLLOUT = 10
RUN_TIMEOUT_S = 420.0
TRAIN_NODE = {"slime_train": 1}
ROLLOUT_NODE = {"slime_rollout": 2}


def _args(save: Path, pool: Path, address: str, num_engines: int = 2) -> list[str]:
    return [
        "--plugin",
        "straw",
        "--num-rollout",
        str(NUM_ROLLOUT),
        "--save",
        str(save),
        "--rollout-data-dir",
        str(pool),
        "--ray-address",
        address,
        "--train-resources",
        "slime_train=1",
        "--rollout-resources",
        "slime_rollout=1",
        "--rollout-num-engines",
        str(num_engines),
        "--rollout-health-check-interval",
        "1",
        "--save-interval",
        "2",
    ]


@pytest.fixture
def shared_pool(tmp_path: Path):
    reason = juicefs.unavailable()
    if reason is not None:
        pytest.skip(reason)
    with juicefs.juicefs_volume(tmp_path / "volume", [tmp_path / "shared"]) as (mount,):
        yield mount / "pool"


def _wait_for_commits(run: SlimeRunProcess, save: Path, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not (save / "rollout" / "branch.json").exists() or len(run_records.commits(save)) < count:
        if run.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the run made no {count} commits (exit {run.poll()}):\n{run.log_tail()}")
        time.sleep(0.5)


def test_a_run_whose_engine_node_is_lost_stops_and_resumes_exactly_once(tmp_path: Path, shared_pool: Path) -> None:
    save = tmp_path / "run"
    with ray_head(num_cpus=2, resources=TRAIN_NODE) as (address, env):
        with ray_worker(address, env, num_cpus=2, resources=ROLLOUT_NODE) as worker:
            # Three engines need three slime_rollout: refused before anything starts, per node.
            refused = SlimeRunProcess(_args(save, shared_pool, address, 3), tmp_path / "refused.log", cwd=tmp_path)
            assert refused.wait(180) == 2
            text = (tmp_path / "refused.log").read_text()
            assert "slime-run: error: the cluster cannot hold this run's layout: 3 rollout engine(s) need " in text
            assert text.count("lacks slime_rollout 1 (has 0)") == 2 and "Traceback" not in text
            assert not (save / "rollout" / "branch.json").exists()  # no queue was created

            run = SlimeRunProcess(_args(save, shared_pool, address), tmp_path / "first.log", cwd=tmp_path)
            _wait_for_commits(run, save, 2, RUN_TIMEOUT_S)
            worker.kill()
            assert run.wait(RUN_TIMEOUT_S) == 1
            text = (tmp_path / "first.log").read_text()
            layout = re.search(r"layout fits the cluster: actor -> node\(s\) (\w+); engines -> node\(s\) (\w+)", text)
            assert layout and layout[1] != layout[2], layout  # the trainer and the engines on different nodes
            error = text[text.rindex("slime-run: error:") :]
            assert "rerun the same command to resume" in error, error
        first_commits = list(run_records.commits(save))
        assert 2 <= len(first_commits) and first_commits[-1] < NUM_ROLLOUT - 1

        with ray_worker(address, env, num_cpus=2, resources=ROLLOUT_NODE):
            SlimeRunProcess(_args(save, shared_pool, address), tmp_path / "resumed.log", cwd=tmp_path).finish(
                RUN_TIMEOUT_S
            )
    committed = list(run_records.commits(save))
    assert committed[-1] == NUM_ROLLOUT - 1 and committed[: len(first_commits)] == first_commits
    run_records.assert_trained_once(save, committed)
    assert sorted(run_records.metrics_by_step(save, ("rollout/reward",))) == list(range(NUM_ROLLOUT))
    # The pool is the JuiceFS volume: the run's rollout data went through it.
    assert any(shared_pool.rglob("*")), f"nothing under {shared_pool}"
