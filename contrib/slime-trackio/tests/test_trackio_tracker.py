"""slime-trackio's hooks, called directly as the driver calls them, against the real trackio library (local SQLite);
what trackio stored is read back with `slime_trackio.logged_rows`.

trackio reads its directory once per process, so every test here stores under one directory and keeps its runs
apart by project.
"""

from __future__ import annotations

import argparse
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("slime_trackio", reason="pip install -e contrib/slime-trackio")

import slime_trackio as st  # noqa: E402


@pytest.fixture(scope="module")
def trackio_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trackio")


@pytest.fixture(autouse=True)
def _finished():
    yield
    st.close()


def _args(tmp_path: Path, store: Path, start: int = 0, num_rollout: int = 4, **overrides: Any):
    values = {
        "use_trackio": True,
        "trackio_project": f"p-{tmp_path.name}",
        "trackio_run_name": None,
        "trackio_dir": str(store),
        "trackio_run_file": None,
        "save": str(tmp_path / "save"),
        "start_rollout_id": start,
        "num_rollout": num_rollout,
        "log_interval": 2,
        **overrides,
    }
    args = argparse.Namespace(**values)
    st.slime_configure(args)
    return args


def _samples(step: int) -> list[dict[str, Any]]:
    return [{"group": group, "prompt": f"copy: ab{group}", "response": f"ab{step}", "reward": 1.0} for group in (0, 1)]


def _step(args: argparse.Namespace, step: int, reward: float) -> None:
    st.slime_after_rollout(args, step, {"rollout/reward": reward, "note": "x"}, _samples(step))
    st.slime_after_train_step(args, step, {"loss": reward / 10})
    st.slime_checkpoint_committed(args, step, "/ckpt")
    st.slime_step_end(args, step, {"perf/step_time": 0.5})


def _rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    name = st.read_run_file(Path(args.trackio_run_file))["run_name"]
    return st.logged_rows(args.trackio_dir, args.trackio_project, name)


def _values(args: argparse.Namespace, key: str) -> list[tuple[int, float]]:
    return [(row["step"], row[key]) for row in _rows(args) if key in row]


def test_metrics_land_at_their_steps_with_sample_tables(tmp_path, trackio_dir):
    args = _args(tmp_path, trackio_dir)
    st.slime_after_eval(args, 0, {"eval/copy/reward": 0.25})
    for step in range(4):
        _step(args, step, reward=step / 4)
    assert _values(args, "rollout/reward") == [(s, s / 4) for s in range(4)]
    assert [s for s, _ in _values(args, "train/loss")] == [0, 1, 2, 3]
    assert _values(args, "checkpoint/committed") == [(s, float(s)) for s in range(4)]
    assert _values(args, "eval/copy/reward") == [(0, 0.25)]
    assert not any("note" in row for row in _rows(args)), "non-numeric metrics are left out"
    # A table every --log-interval steps (0 and 2), stored by trackio with its rows.
    tables = [(row["step"], row["rollout/samples"]) for row in _rows(args) if "rollout/samples" in row]
    assert [step for step, _ in tables] == [0, 2]
    assert "copy: ab1" in str(tables[1][1]) and "ab2" in str(tables[1][1])


def test_a_rerun_continues_the_same_run_without_duplicate_steps(tmp_path, trackio_dir):
    killed = _args(tmp_path, trackio_dir, num_rollout=6)
    st.slime_after_eval(killed, 0, {"eval/copy/reward": 0.1})
    for step in range(3):  # committed up to step 1, then step 2 logged ...
        _step(killed, step, reward=100 + step)
    st.slime_after_rollout(killed, 3, {"rollout/reward": 103.0}, [])  # ... and step 3's rollout before the kill
    st.close()  # the kill (a real kill can also lose the last 0.5 s of rows: see the e2e test)
    name = st.read_run_file(Path(killed.trackio_run_file))["run_name"]

    rerun = _args(tmp_path, trackio_dir, start=2, num_rollout=6)
    st.slime_after_eval(rerun, 0, {"eval/copy/reward": 0.9})  # a rerun from scratch would evaluate again: skipped
    for step in range(2, 6):
        _step(rerun, step, reward=200 + step)
    assert st.read_run_file(Path(rerun.trackio_run_file))["run_name"] == name
    assert _values(rerun, "rollout/reward") == [(0, 100), (1, 101), (2, 102), (3, 103), (4, 204), (5, 205)]
    assert _values(rerun, "eval/copy/reward") == [(0, 0.1)]
    for key in ("rollout/reward", "train/loss", "perf/step_time", "checkpoint/committed"):
        counts = Counter(row["step"] for row in _rows(rerun) if key in row)
        assert set(counts.values()) == {1}, (key, counts)


def test_an_explicit_run_name_is_used_and_recorded(tmp_path, trackio_dir):
    args = _args(tmp_path, trackio_dir, num_rollout=1, trackio_run_name="my-run_1")
    _step(args, 0, 1.0)
    assert st.read_run_file(Path(args.trackio_run_file)) == {"project": args.trackio_project, "run_name": "my-run_1"}
    assert _values(args, "rollout/reward") == [(0, 1.0)]


def test_without_the_flag_nothing_happens(tmp_path, trackio_dir):
    args = _args(tmp_path, trackio_dir, use_trackio=False)
    _step(args, 0, 1.0)
    assert not (tmp_path / "save").exists()


def test_a_failing_trackio_warns_once_and_the_run_goes_on(tmp_path, trackio_dir, caplog):
    other = tmp_path / "elsewhere"  # trackio already stores under trackio_dir in this process
    args = _args(tmp_path, trackio_dir, trackio_dir=str(other))
    with caplog.at_level(logging.WARNING, logger="slime_trackio"):
        for step in range(3):
            _step(args, step, 1.0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "trackio failed" in warnings[0] and "the run continues without trackio" in warnings[0]
    assert f"--trackio-dir {other}" in warnings[0]


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        ({"trackio_project": "has space"}, "--trackio-project"),
        ({"trackio_run_name": "a/b"}, "--trackio-run-name"),
        ({"save": None, "trackio_dir": None}, "--trackio-dir"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(tmp_path, trackio_dir, overrides, flag):
    with pytest.raises(ValueError, match=flag):
        _args(tmp_path, trackio_dir, **overrides)
