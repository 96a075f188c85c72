"""Real CPU runs (the demo's model and task, object-store transport): contrib/slime-example's rollout function,
data source and dynamic filter, selected by name, each leave their mark on what the run writes; and
`--rollout-router sglang-router` sends every rollout request through a real sglang-router.

The plugin is made discoverable as the entry point `example` (a dist-info beside the package on PYTHONPATH),
whether or not it is pip installed, as a user's `pip install -e contrib/slime-example` would.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from slime.plugins.demo import demo_eval_files, demo_settings
from slime.ray.router import sglang_router_available
from slime.utils.external_utils.slime_run_process import SlimeRunProcess

ROOT = Path(__file__).resolve().parents[1]
NUM_ROLLOUT = 2
BATCH, PER_PROMPT = 4, 2
RUN_TIMEOUT_S = 300

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _discoverable_example_plugin(tmp_path: Path) -> str:
    """A PYTHONPATH under which `slime_example` imports and is the entry point `example` of group `slime`."""
    site = tmp_path / "site"
    dist_info = site / "slime_example-0.1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: slime-example\nVersion: 0.1.0\n")
    (dist_info / "entry_points.txt").write_text("[slime]\nexample = slime_example\n")
    return os.pathsep.join([str(site), str(ROOT / "contrib" / "slime-example"), os.environ.get("PYTHONPATH", "")])


def _run(tmp_path: Path, *extra: str) -> tuple[Path, str]:
    save = tmp_path / "run"
    log = tmp_path / "run.log"
    args = [
        "--rollout-data-transport",
        "object-store",
        "--num-rollout",
        str(NUM_ROLLOUT),
        "--rollout-batch-size",
        str(BATCH),
        "--n-samples-per-prompt",
        str(PER_PROMPT),
        "--save",
        str(save),
        *extra,
    ]
    env = {"PYTHONPATH": _discoverable_example_plugin(tmp_path), "SLIME_DISABLE_PLUGIN_AUTOLOAD": ""}
    SlimeRunProcess(args, log, cwd=tmp_path, env=env).finish(RUN_TIMEOUT_S)
    return save, log.read_text(errors="replace")


def _metrics_lines(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _rollout_metrics(save: Path) -> dict[int, dict]:
    """Per step, the metrics line that carries the rollout function's metrics."""
    return {line["step"]: line for line in _metrics_lines(save) if "rollout/num_samples" in line}


def test_example_rollout_source_and_filter_take_effect_in_a_run(tmp_path: Path) -> None:
    save, output = _run(
        tmp_path,
        "--rollout-function-path",
        "example-rollout",
        "--data-source-path",
        "example-prompts",
        "--dynamic-sampling-filter-path",
        "example-filter",
        "--save-debug-rollout-data",
        str(tmp_path / "dumps" / "rollout_{rollout_id}.pt"),
    )
    metrics = _rollout_metrics(save)
    assert sorted(metrics) == list(range(NUM_ROLLOUT)), output[-3000:]
    for step, line in metrics.items():
        # example-rollout: the groups of the step's batch, counted after the built-in rollout function ran.
        assert line["example/groups"] == BATCH, (step, line)
        # example-prompts: every sample of the batch was served (and stamped) by the plugin's data source.
        assert line["example/stamped_samples"] == BATCH * PER_PROMPT, (step, line)
    # example-filter: the tiny model's answers to one prompt often score alike; those groups were dropped and
    # counted under the filter's reason ...
    drops = sum(line.get("rollout/dynamic_filter/drop_example_low_spread", 0) for line in metrics.values())
    assert drops > 0, metrics
    # ... and no group the run trained on has rewards that are all equal.
    for step in range(NUM_ROLLOUT):
        dump = torch.load(tmp_path / "dumps" / f"rollout_{step}.pt", weights_only=False)
        groups: dict[int, list] = defaultdict(list)
        for sample in dump["samples"]:
            assert sample["metadata"]["source"] == "example-prompts"
            groups[sample["group_index"]].append(sample["reward"])
        assert len(groups) == BATCH and all(max(r) > min(r) for r in groups.values()), (step, dict(groups))


def test_a_run_sends_its_rollout_requests_through_sglang_router(tmp_path: Path) -> None:
    if not sglang_router_available():
        pytest.skip("sglang-router is not installed (pip install 'slime-rl[router]')")
    save, output = _run(tmp_path, "--rollout-router", "sglang-router")
    metrics = _rollout_metrics(save)
    assert sorted(metrics) == list(range(NUM_ROLLOUT)), output[-3000:]
    # The router counted every request of the run (no request went to an engine directly) and recorded the
    # count in its log under --save when the run ended.
    router_log = (save / "logs" / "sglang-router.log").read_text(errors="replace")
    routed = re.search(r"slime-rl: sglang-router at http://\S+ routed (\d+) /generate requests", router_log)
    assert routed, router_log[-3000:]
    trained = sum(line["rollout/num_samples"] for line in metrics.values())
    assert trained == NUM_ROLLOUT * BATCH * PER_PROMPT
    # The demo also evaluates, before step 0 and after the last step: each time every prompt of its eval splits,
    # n_samples_per_eval_prompt times.
    evaluations = [line["step"] for line in _metrics_lines(save) if "eval/copy-all/reward" in line]
    assert evaluations == [0, NUM_ROLLOUT - 1]
    eval_prompts = sum(len(path.read_text().splitlines()) for path in demo_eval_files(save).values())
    evaluated = len(evaluations) * eval_prompts * demo_settings(save)["n_samples_per_eval_prompt"]
    assert int(routed.group(1)) == trained + evaluated
