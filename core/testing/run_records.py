"""Checks of a finished or killed run's durable records, for end-to-end tests of slime-rl and its plugins.

They read only what a run leaves under its save directory (joint commit markers, queue and batch-builder
snapshots, branch records, `metrics.jsonl`), never a live process: `assert_trained_once(save, num_rollout)`
checks, across every branch a rerun created, that each committed step consumed exactly the next step's prompt
groups and sample indices and that the training cursor advanced by one step's worth of data per commit.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from straw.protocol import RecordSetRef

from slime.data.refs import DiskPayloadRef
from slime.plugins.demo import demo_settings
from slime.plugins.demo_report import read_metrics, reward_by_step
from slime.utils.external_utils.slime_run_process import SlimeRunProcess

#: The demo's reward target: a mean `rollout/reward` of at least `DEMO_TARGET` over `DEMO_WINDOW` consecutive steps.
DEMO_TARGET, DEMO_WINDOW = 0.9, 10


def branches(save: Path) -> list[Path]:
    """The save root and every branch a rerun created under it, oldest first (a branch a starting run has not
    published yet, with no `branch.json`, is left out)."""
    published = [path for path in (save / "branches").glob("*") if (path / "rollout" / "branch.json").exists()]
    forks = sorted(published, key=lambda p: (p / "rollout" / "branch.json").stat().st_mtime)
    return [save, *forks]


def commits(save: Path) -> dict[int, Path]:
    """Every joint commit of the run's branch chain, by step; a step committed twice is an error."""
    found: dict[int, Path] = {}
    for branch in branches(save):
        for marker in (branch / "rollout").glob("committed_*.json"):
            step = int(marker.stem.removeprefix("committed_"))
            assert step not in found, f"step {step} committed twice: {found[step]} and {marker}"
            found[step] = marker
    return dict(sorted(found.items()))


def consumer_cursors(markers: dict[int, Path]) -> dict[Path, list[tuple[int, int, int]]]:
    """Per branch directory, `(step, fetch, processed)`: the training consumer's cursors recorded with each of its
    committed steps."""
    cursors: dict[Path, list[tuple[int, int, int]]] = {}
    for step, marker in markers.items():
        record = json.loads(marker.read_text())
        assert record["rollout_id"] == step and record["resumable"] is True
        builder = json.loads((marker.parent / f"builder_state_{step}.json").read_text())
        consumer = builder["consumer"]
        entry = (step, consumer["fetch_cursor"], consumer["processed_cursor"])
        cursors.setdefault(marker.parent.parent, []).append(entry)
    return cursors


def best_reward_window(save: Path, window: int = DEMO_WINDOW) -> tuple[float, int | None]:
    """`(mean, first step)` of the best `window` consecutive steps of the run's rewards (latest value per step);
    `(0.0, None)` before `window` steps are logged."""
    by_step = reward_by_step(read_metrics(save / "metrics.jsonl"))
    steps = sorted(by_step)
    best: tuple[float, int | None] = (0.0, None)
    for i in range(len(steps) - window + 1):
        mean = sum(by_step[step] for step in steps[i : i + window]) / window
        if mean > best[0]:
            best = (mean, steps[i])
    return best


def run_until_reward_target(
    run: SlimeRunProcess, save: Path, timeout_s: float, target: float = DEMO_TARGET, window: int = DEMO_WINDOW
) -> tuple[float, int]:
    """Watch `run` (writing under `save`) until its rewards reach `target` over `window` consecutive steps, then
    kill it; `(mean, first step of the window)`.

    The demo learns in a varying number of steps (its sampling depends on how requests batch in the engines), so a
    test gives it room (`--num-rollout` well past the usual) and ends it as soon as it got there. Raises
    AssertionError with the rewards when the run ends, or `timeout_s` passes, first.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        mean, first = best_reward_window(save, window)
        if first is not None and mean >= target:
            run.kill()
            return mean, first
        if run.poll() is not None or time.monotonic() > deadline:
            run.kill()
            rewards = reward_by_step(read_metrics(save / "metrics.jsonl"))
            raise AssertionError(
                f"the run {'ended' if run.poll() is not None else 'timed out'} before reaching a {window}-step mean "
                f"reward of {target} (best {mean:.3f}); rewards by step: {rewards}\n{run.log_tail()}"
            )
        time.sleep(1.0)


def run_to_end(args: list[str], save: Path, log: Path, timeout_s: float) -> None:
    """Run `slime-run ARGS` (writing under `save`, from its parent directory) to its end; RuntimeError with the log's
    tail when it fails, and a kill past `timeout_s` (`SlimeRunProcess.finish`)."""
    save.parent.mkdir(parents=True, exist_ok=True)
    SlimeRunProcess(args, log, cwd=save.parent).finish(timeout_s)


def metrics_by_step(save: Path, keys: tuple[str, ...]) -> dict[int, dict[str, float]]:
    """The latest value of each of `keys` per step of the run's `metrics.jsonl` (a step rerun after a kill logs its
    lines again)."""
    values: dict[int, dict[str, float]] = {}
    for line in (save / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key in keys:
            if key in record:
                values.setdefault(record["step"], {})[key] = record[key]
    return values


def rewards(save: Path) -> list[tuple[int, float]]:
    """`(step, rollout/reward)` of every line of the run's `metrics.jsonl`, in file order."""
    lines = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(line["step"], line["rollout/reward"]) for line in lines if "rollout/reward" in line]


def prompt_source(marker: Path, step: int) -> dict:
    """The queue's prompt-source record saved with the joint commit of `step` (dataset cursor, pending leases)."""
    state = json.loads((marker.parent / f"queue_state_{step}.json").read_text())
    return DiskPayloadRef(RecordSetRef.from_dict(state["manifest"]), state["root"]).load()


def _branch_origin(branch: Path) -> int:
    """The last step before `branch` trained its first: its parent's committed step (-1 for the save root)."""
    record = branch / "rollout" / "branch.json"
    parent = json.loads(record.read_text()).get("parent") if record.exists() else None
    return -1 if parent is None else int(parent["step"])


def assert_trained_once(save: Path, committed_steps: list[int]) -> None:
    """The run under `save` (all branches) committed exactly `committed_steps`, and up to each commit it trained
    exactly the prompt groups and samples of the steps before it, nothing twice and nothing lost, with no lease
    outstanding at a commit (a demo run: its prompt groups and samples per step come from the demo's settings)."""
    markers = commits(save)
    assert list(markers) == list(committed_steps), f"committed steps {list(markers)}, expected {committed_steps}"
    settings = demo_settings(save)
    groups = settings["rollout_batch_size"]
    samples = groups * settings["n_samples_per_prompt"]
    for step, marker in markers.items():
        source = prompt_source(marker, step)
        cursor = source["dataset"]["cursor"]
        # Each committed step consumed exactly the next step's prompt groups and sample indices, across the kill:
        # the resumed branch issued the killed run's uncommitted samples again instead of skipping or repeating
        # indices, and no prompt lease was left outstanding at a commit.
        assert (cursor["sample_group_index"], cursor["sample_index"]) == ((step + 1) * groups, (step + 1) * samples)
        assert source["pending"] == [], (step, source["pending"])
    strides = set()
    for branch, cursors in consumer_cursors(markers).items():
        # At every commit the consumer has processed all it fetched (nothing half-trained is checkpointed) ...
        assert all(fetch == processed for _, fetch, processed in cursors), (branch, cursors)
        # ... and the branch queue's training cursor advanced by one step's worth of accepted positions per step
        # since the queue's origin (a resumed branch trains from a fork of its parent's last commit): a position
        # trained twice would repeat a cursor, a lost one would make it jump.
        origin = _branch_origin(branch)
        trained = [(step - origin, processed) for step, _, processed in cursors]
        stride = trained[0][1] // trained[0][0]
        assert stride > 0 and all(processed == stride * n for n, processed in trained), (branch, trained)
        strides.add(stride)
    assert len(strides) == 1, f"steps accepted different amounts of data: {strides}"


def assert_audit_clean(save: Path) -> None:
    """`slime-run runs audit` of `save` finds the final lineage clean: every prompt group issued up to the last commit
    trained exactly once (or dropped with a recorded reason, or pending), no sample twice, each step's batch the one
    its plan recorded; AssertionError with the violations otherwise."""
    from slime.data.lineage_audit import audit_run

    report = audit_run(save)
    assert report.clean, "\n".join(f"[{v.check}] {v.message} ({', '.join(v.records)})" for v in report.violations)
