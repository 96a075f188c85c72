"""What tracker plugins log: scalars, the redacted configuration, and the steps a tracker run already holds."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from slime.observability.tracker_values import (
    logged_steps,
    paths_under_save,
    read_run_file,
    row_kind,
    run_config,
    scalars,
    write_run_file,
)


def test_scalars_keep_numbers_and_prefix_bare_names():
    metrics = {"loss": 0.5, "train/grad_norm": 2, "flag": True, "note": "x", "steps": 3}
    assert scalars(metrics, prefix="train") == {"train/loss": 0.5, "train/grad_norm": 2.0, "train/steps": 3.0}
    assert scalars({"rollout/reward": 1}) == {"rollout/reward": 1.0}


def test_the_config_is_json_safe_and_redacts_secrets():
    args = argparse.Namespace(
        wandb_key="s3cret", rm_api_token=None, lr=math.inf, paths=("a", 1), nested={1: object}, seed=1
    )
    config = run_config(args)
    json.dumps(config)  # every value JSON can hold
    assert config["wandb_key"] == "<redacted>" and config["rm_api_token"] is None  # nothing to hide when unset
    assert config["lr"] == "inf" and config["paths"] == ["a", 1] and config["seed"] == 1
    assert list(config) == sorted(config)


def test_logged_steps_per_kind_with_the_initial_evaluation_apart():
    rows = [
        {"eval/a/reward": 0.1, "step": 0},
        {"rollout/reward": 1.0, "step": 0},
        {"train/loss": 0.3, "step": 0},
        {"eval/a/reward": 0.2, "step": 0},
        {"checkpoint/committed": 0.0, "step": 0},
        {"perf/step_time": 1.0, "step": 0},
        {"rollout/reward": 1.0, "step": 1},
        {"system/cpu": 3.0},  # no step: not ours
    ]
    assert [row_kind(row) for row in rows[:6]] == ["eval", "rollout", "train", "eval", "checkpoint", "perf"]
    assert logged_steps(rows, "step") == {
        "eval_initial": 0,
        "rollout": 1,
        "train": 0,
        "eval": 0,
        "checkpoint": 0,
        "perf": 0,
    }


def test_tracker_paths_default_under_save_and_are_refused_without_it(tmp_path):
    args = argparse.Namespace(save=str(tmp_path / "run"), t_dir=None, t_file="rel.json")
    paths_under_save(args, "--use-t", {"t_dir": ("--t-dir", "t"), "t_file": ("--t-file", "t.json")})
    assert args.t_dir == str((tmp_path / "run" / "t").resolve())
    assert args.t_file == str(Path("rel.json").resolve())
    with pytest.raises(ValueError, match=r"--use-t needs --t-dir \(or --save DIR, which puts it at DIR/t\)"):
        paths_under_save(argparse.Namespace(save=None, t_dir=None), "--use-t", {"t_dir": ("--t-dir", "t")})


def test_a_run_file_round_trips_and_is_empty_before_the_first_write(tmp_path):
    path = tmp_path / "deep" / "run.json"
    assert read_run_file(path) == {}
    write_run_file(path, {"run_id": "abc", "logged": {"train": 3}})
    assert read_run_file(path) == {"logged": {"train": 3}, "run_id": "abc"}
    assert [p.name for p in path.parent.iterdir()] == ["run.json"], "no temporary file left behind"
