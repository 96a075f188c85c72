"""Debug archives on the CPU job: archive a live run, replay it train-only twice, train on the same batches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slime.plugins.demo import DEMO_GLOBAL_BATCH_SIZE, demo_settings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _slime_run(*argv: str, cwd: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "slime.cli", *argv], cwd=cwd, capture_output=True, text=True, timeout=400
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _train_metrics(save: Path) -> dict[int, dict[str, float]]:
    metrics: dict[int, dict[str, float]] = {}
    for line in (save / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "train/loss" in record:
            metrics[record["step"]] = {k: v for k, v in record.items() if k.startswith("train/")}
    return metrics


def test_archived_run_replays_identical_training_batches(tmp_path: Path) -> None:
    run, dumps = tmp_path / "run", tmp_path / "dumps"
    template = str(dumps / "{rollout_id}.straw.json")
    _slime_run(
        "--plugin",
        "straw",
        "--save",
        str(run),
        "--num-rollout",
        "2",
        "--save-debug-rollout-data",
        template,
        cwd=tmp_path,
    )
    # One archive per training step, and one per evaluation of the demo's, before step 0 and after the last step
    # (eval samples never reach the run's pool, so those archives keep them in a pool of their own, straw-data/).
    assert sorted(p.name for p in dumps.iterdir()) == [
        "0.straw.json",
        "1.straw.json",
        "eval_0.straw.json",
        "eval_1.straw.json",
        "straw-data",
    ]
    live = _train_metrics(run)
    commits = sorted(p.name for p in (run / "rollout").glob("committed_*.json"))

    demo = demo_settings(run)
    replays = []
    for name in ("replay1", "replay2"):
        save = tmp_path / name
        _slime_run(
            "--plugin",
            "straw",
            "--hf-checkpoint",
            str(run / "model"),
            "--prompt-data",
            str(run / "prompts.jsonl"),
            "--input-key",
            "input",
            "--label-key",
            "label",
            "--rm-type",
            "copy",
            # The live run's demo settings, spelled out: a replay names a model and prompts, so it is no demo.
            "--lr",
            str(demo["lr"]),
            "--entropy-coef",
            str(demo["entropy_coef"]),
            "--adam-beta2",
            str(demo["adam_beta2"]),
            "--lr-decay-style",
            demo["lr_decay_style"],
            "--min-lr",
            str(demo["min_lr"]),
            "--rollout-batch-size",
            str(demo["rollout_batch_size"]),
            "--n-samples-per-prompt",
            str(demo["n_samples_per_prompt"]),
            "--global-batch-size",
            str(DEMO_GLOBAL_BATCH_SIZE),
            "--save",
            str(save),
            "--rollout-data-dir",
            str(run / "rollout_data"),
            "--num-rollout",
            "2",
            "--debug-train-only",
            "--load-debug-rollout-data",
            template,
            cwd=tmp_path,
        )
        replays.append(_train_metrics(save))

    assert sorted(replays[0]) == [0, 1]
    assert replays[0] == replays[1], "two replays of one archive trained on different batches"
    assert replays[0][1]["train/grad_norm"] > 0, "the replayed step carried no learning signal"
    assert live[0] == replays[0][0], "replayed step 0 differs from the live step 0"
    if live[0]["train/grad_norm"] == 0:
        # Step 0 left the weights unchanged, so the live step 1 trained on the same weights as the replays.
        assert live[1] == replays[0][1], "replayed step 1 differs from the live step 1"
    assert sorted(p.name for p in (run / "rollout").glob("committed_*.json")) == commits, "replay touched the run"
