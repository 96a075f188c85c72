"""slime-tensorboard's hooks, called directly as the driver calls them; the event files are read back with
TensorBoard's own reader (EventAccumulator), which applies the purge a resumed run asks for."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("slime_tensorboard", reason="pip install -e 'contrib/slime-tensorboard[test]'")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

import slime_tensorboard as tb  # noqa: E402


def _args(tmp_path: Path, start: int = 0, num_rollout: int = 4, **extra: Any) -> argparse.Namespace:
    args = argparse.Namespace(
        use_tensorboard=True,
        tensorboard_dir=None,
        save=str(tmp_path / "save"),
        start_rollout_id=start,
        num_rollout=num_rollout,
        wandb_key="secret-value",
        **extra,
    )
    tb.slime_configure(args)
    return args


def _samples(step: int) -> list[dict[str, Any]]:
    """What the driver passes: `rollout_examples` rows (a `|` and a newline in a cell, as answers can hold)."""
    return [
        {"group": group, "prompt": f"copy: ab{group}", "response": f"ab|{step}\n", "reward": 1.0} for group in (0, 1)
    ]


def _step(args: argparse.Namespace, step: int, reward: float) -> None:
    metrics = {"rollout/reward": reward, "rollout/response_length": 3, "note": "x"}
    tb.slime_after_rollout(args, step, metrics, _samples(step))
    tb.slime_after_train_step(args, step, {"loss": reward / 10, "grad_norm": 1.0, "flag": True})
    tb.slime_checkpoint_committed(args, step, "/ckpt")
    tb.slime_step_end(args, step, {"perf/step_time": 0.5})


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = event_accumulator.EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


@pytest.fixture(autouse=True)
def _closed():
    yield
    tb.close()


def test_scalars_land_at_their_steps_with_prefixes_and_the_config(tmp_path: Path) -> None:
    args = _args(tmp_path)
    assert args.tensorboard_dir == str((tmp_path / "save" / "tensorboard").resolve())
    tb.slime_after_eval(args, 0, {"eval/copy/reward": 0.1, "eval/copy/pass@4": 0.5})
    for step in range(4):
        _step(args, step, reward=step / 4)
    assert not tb._trackers, "the last step closes the writer"
    scalars = _scalars(Path(args.tensorboard_dir))
    assert scalars["rollout/reward"] == [(s, s / 4) for s in range(4)]
    assert [s for s, _ in scalars["train/loss"]] == [0, 1, 2, 3]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([s / 40 for s in range(4)])
    assert [s for s, _ in scalars["perf/step_time"]] == [0, 1, 2, 3]
    assert scalars["checkpoint/committed"] == [(s, float(s)) for s in range(4)]
    assert scalars["eval/copy/pass@4"] == [(0, 0.5)]
    assert "note" not in scalars and "train/flag" not in scalars
    accumulator = event_accumulator.EventAccumulator(args.tensorboard_dir, size_guidance={"tensors": 0})
    accumulator.Reload()
    (config_event,) = accumulator.Tensors("config/text_summary")
    text = config_event.tensor_proto.string_val[0].decode()
    config = json.loads(text.removeprefix("```json\n").removesuffix("\n```"))
    assert config["num_rollout"] == 4 and config["wandb_key"] == "<redacted>"


def test_a_resumed_run_replaces_the_killed_runs_steps_from_its_start(tmp_path: Path) -> None:
    killed = _args(tmp_path, num_rollout=6)
    for step in range(4):  # committed up to step 1, then steps 2 and 3 logged and the run killed
        _step(killed, step, reward=100 + step)
    tb.close()  # the kill: what was flushed stays
    rerun = _args(tmp_path, start=2, num_rollout=6)
    for step in range(2, 6):
        _step(rerun, step, reward=200 + step)
    scalars = _scalars(Path(rerun.tensorboard_dir))
    assert scalars["rollout/reward"] == [(0, 100), (1, 101), (2, 202), (3, 203), (4, 204), (5, 205)]
    for tag, events in scalars.items():
        steps = [s for s, _ in events]
        assert steps == sorted(set(steps)), (tag, steps)


def test_a_run_killed_before_its_first_commit_starts_over_at_step_0(tmp_path: Path) -> None:
    killed = _args(tmp_path)
    _step(killed, 0, reward=1.0)
    tb.close()
    rerun = _args(tmp_path)
    for step in range(4):
        _step(rerun, step, reward=2.0)
    assert _scalars(Path(rerun.tensorboard_dir))["rollout/reward"] == [(s, 2.0) for s in range(4)]


def test_without_the_flag_nothing_is_written(tmp_path: Path) -> None:
    args = argparse.Namespace(use_tensorboard=False, tensorboard_dir=None, save=str(tmp_path), num_rollout=1)
    tb.slime_configure(args)
    _step(args, 0, 1.0)
    assert list(tmp_path.iterdir()) == [] and not tb._trackers


def test_without_a_directory_the_flag_is_refused_naming_it() -> None:
    args = argparse.Namespace(use_tensorboard=True, tensorboard_dir=None, save=None)
    with pytest.raises(ValueError, match="--use-tensorboard.*--tensorboard-dir"):
        tb.slime_configure(args)


def test_an_explicit_directory_needs_no_save(tmp_path: Path) -> None:
    args = argparse.Namespace(use_tensorboard=True, tensorboard_dir=str(tmp_path / "tb"), save=None, num_rollout=1)
    tb.slime_configure(args)
    _step(args, 0, 1.0)
    assert _scalars(tmp_path / "tb")["rollout/reward"] == [(0, 1.0)]


def test_an_unwritable_directory_warns_once_and_the_run_goes_on(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    args = argparse.Namespace(use_tensorboard=True, tensorboard_dir=str(blocker / "tb"), save=None, num_rollout=3)
    tb.slime_configure(args)
    with caplog.at_level(logging.WARNING, logger="slime_tensorboard"):
        for step in range(3):
            _step(args, step, 1.0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "TensorBoard" in warnings[0].getMessage()


def test_the_flags_parse_through_slime_run(tmp_path: Path) -> None:
    from slime.utils.arguments import parse_args

    argv = ["--use-tensorboard", "--save", str(tmp_path / "s"), "--prompt-data", "p"]
    args = parse_args(argv)
    assert args.tensorboard_dir == str((tmp_path / "s" / "tensorboard").resolve())
    with pytest.raises((ValueError, SystemExit)):
        parse_args(["--use-tensorboard", "--prompt-data", "p", "--rollout-data-transport", "object-store"])


def test_sample_tables_every_log_interval_steps(tmp_path: Path) -> None:
    args = _args(tmp_path, num_rollout=5, log_interval=2)
    for step in range(5):
        _step(args, step, reward=0.5)
    accumulator = event_accumulator.EventAccumulator(args.tensorboard_dir, size_guidance={"tensors": 0})
    accumulator.Reload()
    events = accumulator.Tensors("rollout/samples/text_summary")
    assert [event.step for event in events] == [0, 2, 4]
    table = events[1].tensor_proto.string_val[0].decode().splitlines()
    assert table[0] == "| step | group | prompt | response | reward |"
    assert table[2:] == ["| 2 | 0 | copy: ab0 | ab\\|2\\n | 1.0 |", "| 2 | 1 | copy: ab1 | ab\\|2\\n | 1.0 |"]
