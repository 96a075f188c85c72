"""slime-wandb's hooks, called directly as the driver calls them, against the real wandb library in offline mode
(and online against an unreachable server); the offline run files are read back with `slime_wandb.offline`."""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("slime_wandb", reason="pip install -e contrib/slime-wandb")

import slime_wandb as sw  # noqa: E402
from slime_wandb.offline import config, history  # noqa: E402


def _args(tmp_path: Path, start: int = 0, num_rollout: int = 4, **overrides: Any) -> argparse.Namespace:
    values = {
        "use_wandb": True,
        "wandb_project": "slime-tests",
        "wandb_group": None,
        "wandb_key": None,
        "wandb_mode": "offline",
        "wandb_run_id": None,
        "wandb_dir": None,
        "wandb_run_file": None,
        "wandb_init_timeout": 30.0,
        "save": str(tmp_path / "save"),
        "start_rollout_id": start,
        "num_rollout": num_rollout,
        **overrides,
    }
    args = argparse.Namespace(**values)
    sw.slime_configure(args)
    return args


def _samples(step: int) -> list[dict[str, Any]]:
    """What the driver passes: `rollout_examples` rows (a `|` and a newline in a cell, as answers can hold)."""
    return [
        {"group": group, "prompt": f"copy: ab{group}", "response": f"ab|{step}\n", "reward": 1.0} for group in (0, 1)
    ]


def _step(args: argparse.Namespace, step: int, reward: float) -> None:
    metrics = {"rollout/reward": reward, "rollout/response_length": 3, "note": "x"}
    sw.slime_after_rollout(args, step, metrics, _samples(step))
    sw.slime_after_train_step(args, step, {"loss": reward / 10, "grad_norm": 1.0})
    sw.slime_checkpoint_committed(args, step, "/ckpt")
    sw.slime_step_end(args, step, {"perf/step_time": 0.5})


def _values(args: argparse.Namespace, key: str) -> list[tuple[int, float]]:
    run_id = sw.read_run_file(Path(args.wandb_run_file))["run_id"]
    return [(row["rollout_step"], row[key]) for row in history(Path(args.wandb_dir), run_id) if key in row]


@pytest.fixture(autouse=True)
def _finished(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    yield
    sw.close()


def test_metrics_land_at_their_rollout_steps_and_the_config_is_logged(tmp_path: Path) -> None:
    args = _args(tmp_path, wandb_key="secret-value")
    sw.slime_after_eval(args, 0, {"eval/copy/reward": 0.1, "eval/copy/pass@4": 0.5})
    for step in range(4):
        _step(args, step, reward=step / 4)
    assert not sw._trackers, "the last step finishes the run"
    assert _values(args, "rollout/reward") == [(s, s / 4) for s in range(4)]
    assert [s for s, _ in _values(args, "train/loss")] == [0, 1, 2, 3]
    assert [s for s, _ in _values(args, "perf/step_time")] == [0, 1, 2, 3]
    assert _values(args, "eval/copy/pass@4") == [(0, 0.5)]
    run_id = sw.read_run_file(Path(args.wandb_run_file))["run_id"]
    rows = history(Path(args.wandb_dir), run_id)
    assert [row["_step"] for row in rows] == list(range(len(rows))), "wandb's own steps increase by one"
    assert not any("note" in row for row in rows)
    logged = config(Path(args.wandb_dir), run_id)
    assert logged["num_rollout"] == 4 and logged["wandb_key"] == "<redacted>"


def test_a_resumed_run_continues_the_same_run_without_duplicate_steps(tmp_path: Path) -> None:
    killed = _args(tmp_path, num_rollout=6)
    for step in range(3):  # committed up to step 1, then step 2 logged ...
        _step(killed, step, reward=100 + step)
    sw.slime_after_rollout(killed, 3, {"rollout/reward": 103.0}, [])  # ... and step 3's rollout before the kill
    sw.close()
    first_id = sw.read_run_file(Path(killed.wandb_run_file))["run_id"]
    time.sleep(1.1)  # wandb names a segment's directory by the second it started (a real rerun takes longer)
    rerun = _args(tmp_path, start=2, num_rollout=6)
    for step in range(2, 6):
        _step(rerun, step, reward=200 + step)
    record = sw.read_run_file(Path(rerun.wandb_run_file))
    assert record["run_id"] == first_id
    assert len(list(Path(rerun.wandb_dir).glob(f"wandb/offline-run-*-{first_id}"))) == 2
    # Steps the killed run logged keep its values; the rest are the rerun's; each step once.
    assert _values(rerun, "rollout/reward") == [(0, 100), (1, 101), (2, 102), (3, 103), (4, 204), (5, 205)]
    assert [v for _, v in _values(rerun, "train/loss")] == pytest.approx([10, 10.1, 10.2, 20.3, 20.4, 20.5])
    rows = history(Path(rerun.wandb_dir), first_id)
    for key in ("rollout/reward", "train/loss", "perf/step_time", "checkpoint/committed"):
        counts = Counter(row["rollout_step"] for row in rows if key in row)
        assert set(counts.values()) == {1}, (key, counts)
    steps = [row["_step"] for row in rows]
    assert steps == sorted(set(steps)), "wandb's steps keep increasing across the resume"


def test_rows_a_kill_lost_are_logged_again_by_the_rerun(tmp_path: Path) -> None:
    killed = _args(tmp_path, num_rollout=6)
    for step in range(2):
        _step(killed, step, reward=100 + step)
    sw.close()
    run_file = Path(killed.wandb_run_file)
    record = sw.read_run_file(run_file)
    # As if steps 2 and 3 had been recorded and handed to wandb, and the kill came before wandb wrote them.
    sw.write_run_file(run_file, {**record, "logged": dict.fromkeys(record["logged"], 3), "next_step": 40})
    time.sleep(1.1)
    rerun = _args(tmp_path, start=2, num_rollout=6)
    for step in range(2, 6):
        _step(rerun, step, reward=200 + step)
    assert _values(rerun, "rollout/reward") == [(0, 100), (1, 101), (2, 202), (3, 203), (4, 204), (5, 205)]
    steps = [row["_step"] for row in history(Path(rerun.wandb_dir), record["run_id"])]
    assert steps == sorted(set(steps)) and steps[8] >= 40


def test_an_explicit_run_id_is_used_and_recorded(tmp_path: Path) -> None:
    args = _args(tmp_path, num_rollout=1, wandb_run_id="my-run_1")
    _step(args, 0, 1.0)
    assert sw.read_run_file(Path(args.wandb_run_file))["run_id"] == "my-run_1"
    assert _values(args, "rollout/reward") == [(0, 1.0)]


def test_without_the_flag_nothing_happens(tmp_path: Path) -> None:
    args = argparse.Namespace(use_wandb=False, save=str(tmp_path), num_rollout=1)
    sw.slime_configure(args)
    _step(args, 0, 1.0)
    assert list(tmp_path.iterdir()) == [] and not sw._trackers


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        ({"wandb_mode": "sometimes"}, "--wandb-mode"),
        ({"wandb_run_id": "a/b"}, "--wandb-run-id"),
        ({"wandb_init_timeout": 0}, "--wandb-init-timeout"),
        ({"save": None}, "--wandb-dir"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(tmp_path: Path, overrides: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        _args(tmp_path, **overrides)


def test_an_unreachable_server_warns_once_and_the_run_goes_on(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    args = _args(tmp_path, num_rollout=3, wandb_mode="online", wandb_key="x" * 40, wandb_init_timeout=5.0)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="slime_wandb"):
        for step in range(3):
            _step(args, step, 1.0)
    warnings = [r.getMessage() for r in caplog.records if r.name == "slime_wandb" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "wandb" in warnings[0] and "--wandb-mode offline" in warnings[0]
    assert time.monotonic() - started < 20


def test_the_flags_parse_through_slime_run(tmp_path: Path) -> None:
    from slime.utils.arguments import parse_args

    args = parse_args(["--use-wandb", "--wandb-mode", "offline", "--save", str(tmp_path / "s"), "--prompt-data", "p"])
    assert args.wandb_dir == str((tmp_path / "s" / "wandb").resolve())
    assert args.wandb_run_file == str((tmp_path / "s" / "wandb_run.json").resolve())


def test_sample_tables_every_log_interval_steps(tmp_path: Path) -> None:
    args = _args(tmp_path, num_rollout=5, log_interval=2)
    for step in range(5):
        _step(args, step, reward=0.5)
    run_id = sw.read_run_file(Path(args.wandb_run_file))["run_id"]
    rows = history(Path(args.wandb_dir), run_id)
    # wandb records a table as a file reference, its fields flattened into the row as `rollout/samples/<field>`.
    tables = [row for row in rows if row.get("rollout/samples/_type") == "table-file"]
    assert [row["rollout_step"] for row in tables] == [0, 2, 4]
    assert all(row["rollout/samples/nrows"] == 2 for row in tables)
    (run_dir,) = Path(args.wandb_dir).glob(f"wandb/offline-run-*-{run_id}")
    content = json.loads((run_dir / "files" / tables[1]["rollout/samples/path"]).read_text())
    assert content["columns"] == ["step", "group", "prompt", "response", "reward"]
    assert content["data"] == [[2, 0, "copy: ab0", "ab|2\n", 1.0], [2, 1, "copy: ab1", "ab|2\n", 1.0]]
