"""The experiment trackers (contrib/slime-tensorboard, -wandb, -trackio) on the CPU demo, killed and rerun.

The demo runs with both trackers (wandb offline: no network), is SIGKILLed with every process of it right after
step 2's joint commit, and the same command runs to the end (it resumes at step 3). What the trackers left on disk
is read back: TensorBoard's own reader sees every step 0..3 once, each with the value the run's metrics.jsonl
holds last for it (the rerun's for a step trained again); the wandb run is one run id over two offline segments,
and the trackio run one run, every step's metrics logged once in each.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from slime.testing import run_records
from slime.utils.external_utils.slime_run_process import SlimeRunProcess

pytest.importorskip("slime_tensorboard", reason="pip install -e 'contrib/slime-tensorboard[test]'")
pytest.importorskip("slime_wandb", reason="pip install -e contrib/slime-wandb")
pytest.importorskip("slime_trackio", reason="pip install -e contrib/slime-trackio")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

import slime_trackio  # noqa: E402
from slime_wandb import read_run_file  # noqa: E402
from slime_wandb.offline import history, offline_run_files  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

NUM_ROLLOUT = 4
KILL_AFTER_COMMIT = 2
RUN_TIMEOUT_S = 240
#: Steps 0 and 2 log a sample table (step 2 in the killed run, which the rerun keeps: it resumes at step 3).
LOG_INTERVAL = 2
#: Metrics the driver reports after a step's commit is on disk: a kill right after the commit may come first.
REPORTED_BY_THE_DRIVER = ("checkpoint/committed", "perf/step_time")


def _argv(save: Path) -> list[str]:
    return [
        *("--plugin", "straw", "--plugin", "tensorboard", "--plugin", "wandb", "--plugin", "trackio"),
        *("--use-tensorboard", "--use-wandb", "--wandb-mode", "offline", "--use-trackio"),
        *("--num-rollout", str(NUM_ROLLOUT), "--save-interval", "1", "--eval-interval", "2", "--save", str(save)),
        *("--log-interval", str(LOG_INTERVAL)),
        # 64 prompt groups a step (the demo has 16): a step of about 3 s here, so the next commit cannot come inside
        # the second the kill waits after step 2's (where a tracker's last rows could be lost).
        *("--rollout-batch-size", "64"),
    ]


def _kill_after_commit(save: Path, log: Path, step: int) -> None:
    run = SlimeRunProcess(_argv(save), log, cwd=save.parent)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not ((save / "rollout").exists() and step in run_records.commits(save)):
            assert run.poll() is None, f"the run ended before step {step}'s commit:\n{run.log_tail()}"
            assert time.monotonic() < deadline, f"no commit of step {step} in {RUN_TIMEOUT_S}s:\n{run.log_tail()}"
            time.sleep(0.05)
        # wandb writes its offline file every 0.2 s (slime_wandb.FLUSH_INTERVAL_S), trackio its database every
        # 0.5 s: rows of the committed steps handed to them in the last moment before a kill are lost and no rerun
        # trains those steps again.
        time.sleep(1.0)
        later = sorted(run_records.commits(save))[-1]
        assert later == step, f"step {later} was committed within 1 s of step {step}'s: the kill came too late"
    finally:
        run.kill()
    assert not run.processes(), "a process of the killed run survived"


def _latest_metric(save: Path, key: str) -> dict[int, float]:
    values: dict[int, float] = {}
    for line in (save / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if key in record:
            values[record["step"]] = record[key]
    return values


def test_trackers_continue_one_run_across_a_kill_without_duplicate_steps(tmp_path: Path) -> None:
    save = tmp_path / "run"
    save.parent.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "run.log"
    _kill_after_commit(save, log, KILL_AFTER_COMMIT)
    SlimeRunProcess(_argv(save), log, cwd=tmp_path).finish(RUN_TIMEOUT_S)
    output = log.read_text(errors="replace")[-3000:]
    rewards = _latest_metric(save, "rollout/reward")
    assert sorted(rewards) == list(range(NUM_ROLLOUT)), output

    accumulator = event_accumulator.EventAccumulator(str(save / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    for tag in ("rollout/reward", "train/loss"):
        steps = [event.step for event in accumulator.Scalars(tag)]
        assert steps == list(range(NUM_ROLLOUT)), (tag, steps)
    # The kill came once step 2's commit was on disk, before the driver reported it (or the step's end): what was
    # never reported is in neither metrics.jsonl nor the trackers; the rest is in both, each step once.
    for tag in REPORTED_BY_THE_DRIVER:
        steps = [event.step for event in accumulator.Scalars(tag)]
        assert steps == sorted(_latest_metric(save, tag)), (tag, steps)
    assert {e.step: e.value for e in accumulator.Scalars("rollout/reward")} == pytest.approx(rewards)
    eval_tags = [tag for tag in accumulator.Tags()["scalars"] if tag.startswith("eval/")]
    assert eval_tags, "the demo evaluates before the first step and every --eval-interval steps"
    for tag in eval_tags:
        assert {event.step for event in accumulator.Scalars(tag)} <= set(range(NUM_ROLLOUT)), tag

    samples = accumulator.Tensors("rollout/samples/text_summary")
    assert [event.step for event in samples] == [0, 2]
    table = samples[0].tensor_proto.string_val[0].decode()
    assert table.startswith("| step | group | prompt | response | reward |"), table
    assert len(table.splitlines()) == 2 + 4, "a header, its rule, the first answer of the first 4 groups"

    run_id = read_run_file(save / "wandb_run.json")["run_id"]
    assert len(offline_run_files(save / "wandb", run_id)) == 2, "one offline segment per start, one run id"
    rows = history(save / "wandb", run_id)
    for key in ("rollout/reward", "train/loss", *REPORTED_BY_THE_DRIVER):
        counts = Counter(row["rollout_step"] for row in rows if key in row)
        assert counts == dict.fromkeys(sorted(_latest_metric(save, key)), 1), (key, counts)
    tables = [row for row in rows if row.get("rollout/samples/_type") == "table-file"]
    assert [row["rollout_step"] for row in tables] == [0, 2]
    assert all(row["rollout/samples/nrows"] == 4 for row in tables), "the first answer of the first 4 groups"
    by_step = {row["rollout_step"]: row["rollout/reward"] for row in rows if "rollout/reward" in row}
    assert by_step == pytest.approx(rewards)

    record = slime_trackio.read_run_file(save / "trackio_run.json")
    trackio_rows = slime_trackio.logged_rows(save / "trackio", record["project"], record["run_name"])
    for key in ("rollout/reward", "train/loss", *REPORTED_BY_THE_DRIVER):
        counts = Counter(row["step"] for row in trackio_rows if key in row)
        assert counts == dict.fromkeys(sorted(_latest_metric(save, key)), 1), ("trackio", key, counts)
    by_step = {row["step"]: row["rollout/reward"] for row in trackio_rows if "rollout/reward" in row}
    assert by_step == pytest.approx(rewards)
    assert [row["step"] for row in trackio_rows if "rollout/samples" in row] == [0, 2]
