"""A third-party transport trains the CPU demo: `slime-run --rollout-data-transport safetensors`.

contrib/slime-safetensors-transport is built on `slime.interfaces.Transport` alone; naming it is all a run needs.
The run is judged from what it left on disk: one batch directory of shard files per step, written owner-only,
and the training metrics of every step (the trainers can only have trained on shards they loaded from those files:
the transport hands them nothing else).
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from slime.utils.external_utils.slime_run_process import SlimeRunProcess

pytest.importorskip("slime_safetensors_transport", reason="pip install -e contrib/slime-safetensors-transport")

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

NUM_ROLLOUT = 3
RUN_TIMEOUT_S = 240


def test_demo_trains_on_the_safetensors_transport(tmp_path: Path) -> None:
    save = tmp_path / "run"
    argv = ["--rollout-data-transport", "safetensors", "--num-rollout", str(NUM_ROLLOUT), "--save", str(save)]
    SlimeRunProcess(argv, tmp_path / "run.log", cwd=tmp_path).finish(RUN_TIMEOUT_S)

    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines() if line.strip()]
    generated = {record["step"]: record["rollout/num_samples"] for record in records if "rollout/num_samples" in record}
    assert sorted(generated) == list(range(NUM_ROLLOUT)), records
    train_steps = sorted({record["step"] for record in records if any(key.startswith("train/") for key in record)})
    assert train_steps == list(range(NUM_ROLLOUT)), records

    directory = save / "safetensors_batches"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    batches = {int(batch.name.split("_")[1]): batch for batch in directory.iterdir()}
    assert sorted(batches) == list(range(NUM_ROLLOUT)), sorted(directory.iterdir())
    for step, batch in batches.items():
        assert stat.S_IMODE(batch.stat().st_mode) == 0o700, batch
        indexes = sorted(batch.glob("rank_*.json"))
        assert indexes and sorted(path.name for path in batch.iterdir()) == sorted(
            name for index in indexes for name in (index.name, index.with_suffix(".safetensors").name)
        ), f"{batch}: not one .json and one .safetensors per rank (or a temporary file was left)"
        shards = [json.loads(index.read_text())["columns"]["dict"] for index in indexes]
        assert sum(len(shard["sample_indices"]) for shard in shards) == generated[step], batch
