"""`slime-run runs` and `slime-run runs audit` on a real demo run that was killed after its first commit and rerun.

One module-scoped run (the demo, 4 steps, a commit per step, killed once) is kept pristine; each test restores it
to the same path (the run's records hold absolute paths), tampers with it, and checks what the commands say.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from slime.cli import main
from slime.data import lineage_audit
from slime.data.lineage_audit import PLAN_IDENTITY_KEYS, _Queue
from slime.data.run_inspection import lineage, queue_directory, read_queue_journal
from slime.plugins.demo import demo_settings
from slime.testing import run_records
from slime.utils.external_utils.slime_run_process import SlimeRunProcess

NUM_ROLLOUT = 4
RUN_TIMEOUT_S = 300
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """`(save, pristine copy, last step the killed run committed)`."""
    root = tmp_path_factory.mktemp("killed_and_rerun")
    save = root / "run"
    args = ["--plugin", "straw", "--num-rollout", str(NUM_ROLLOUT), "--save-interval", "1", "--save", str(save)]
    first = SlimeRunProcess(args, root / "first.log", root)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not list((save / "rollout").glob("committed_*.json")):
        assert first.poll() is None, f"the first run ended before its first commit:\n{first.log_tail()}"
        assert time.monotonic() < deadline, "no joint commit appeared in time"
        time.sleep(0.2)
    first.kill()
    killed_at = max(run_records.commits(save))
    assert killed_at <= NUM_ROLLOUT - 3, "the kill came too late: the rerun must train at least two steps"
    SlimeRunProcess(args, root / "rerun.log", root).finish(RUN_TIMEOUT_S)
    copy = root / "pristine"
    shutil.copytree(save, copy, symlinks=True)
    return save, copy, killed_at


@pytest.fixture
def run(pristine: tuple[Path, Path, int]) -> Path:
    """The killed-and-rerun save directory, as the runs left it."""
    save, copy, _ = pristine
    shutil.rmtree(save, ignore_errors=True)
    shutil.copytree(copy, save, symlinks=True)
    return save


def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    status = main(["runs", *argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return status, captured.out


def _files(save: Path) -> dict[str, tuple[int, int]]:
    return {str(path): (path.stat().st_size, path.stat().st_mtime_ns) for path in save.rglob("*") if path.is_file()}


def _batch_plan(save: Path, step: int) -> tuple[Path, dict]:
    """The pool file holding step `step`'s batch plan (in the current branch's queue) and the plan's segment."""
    segment = lineage(save)[-1]
    pool = Path(segment.record["pool"])
    queue = _Queue.index(read_queue_journal(pool, segment.record["queue_id"], named_in=segment.directory), pool)
    _, collection = next(
        value for task, value in queue.completed.items() if task.startswith("collection:") and task.endswith(f":{step}")
    )
    _, spec = queue.specs[f"batch:{collection['commit_id']}"]
    location = spec["input_ref"]["manifest"]["segment"]
    return pool / location["path"], location


def test_audit_proves_each_prompt_group_was_trained_once(run: Path, capsys: pytest.CaptureFixture) -> None:
    status, out = _cli(capsys, "audit", str(run), "--json")
    report = json.loads(out)
    assert status == 0 and report["clean"] and report["violations"] == [], report["violations"][:1]
    settings = demo_settings(run)
    groups = NUM_ROLLOUT * settings["rollout_batch_size"]
    counts = report["counts"]
    assert counts["branches in lineage"] == 2 and counts["steps verified"] == NUM_ROLLOUT
    assert counts["prompt groups issued"] == counts["prompt groups trained once"] == groups
    assert counts["samples trained"] == groups * settings["n_samples_per_prompt"]
    assert counts["commits verified"] == NUM_ROLLOUT
    status, out = _cli(capsys, "audit", str(run))
    assert status == 0 and "result: CLEAN" in out
    run_records.assert_trained_once(run, list(range(NUM_ROLLOUT)))  # the count-based check agrees


def test_runs_reports_branches_commits_rerun_and_pool_without_writing(
    run: Path, pristine: tuple[Path, Path, int], capsys: pytest.CaptureFixture
) -> None:
    killed_at = pristine[2]
    before = _files(run)
    status, out = _cli(capsys, str(run), "--json")
    report = json.loads(out)
    assert status == 0 and report["problems"] == []
    root, branch = report["branches"]
    assert root["reason"] == "new run" and root["lineage_steps"] == [0, killed_at]
    assert branch["current"] and branch["parent"]["step"] == killed_at
    assert branch["reason"].startswith(f"rerun of the same command: resumed step {killed_at} of (root)")
    steps = [commit["step"] for b in (root, branch) for commit in b["commits"]]
    assert steps == list(range(NUM_ROLLOUT)) and all(c["problem"] is None for b in (root, branch) for c in b["commits"])
    assert report["rerun"]["action"] == "fork" and report["rerun"]["step"] == NUM_ROLLOUT - 1
    (pool,) = report["pools"]
    assert pool["total_bytes"] > 0 and {queue["branch"] for queue in pool["queues"]} == {"(root)", branch["name"]}
    status, out = _cli(capsys, str(run))
    assert status == 0 and f"fork: resume step {NUM_ROLLOUT - 1} of branch {branch['name']}" in out
    assert "PROBLEMS: none" in out
    _cli(capsys, "audit", str(run))
    assert _files(run) == before, "inspection must not write into the save directory or the pool"


def test_audit_names_the_pack_of_a_corrupted_batch_plan(run: Path, capsys: pytest.CaptureFixture) -> None:
    path, location = _batch_plan(run, 2)
    data = bytearray(path.read_bytes())
    data[location["offset"] + location["size"] // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    status, out = _cli(capsys, "audit", str(run))
    assert status == 1
    assert "[unreadable record] batch plan of step 2 cannot be read: CorruptData" in out
    assert f"{path} (offset {location['offset']})" in out


def _recompute_digest(plan: dict) -> None:
    from straw.protocol import digest

    plan["digest"] = digest({key: plan[key] for key in PLAN_IDENTITY_KEYS})


def test_audit_finds_a_sample_repeated_in_a_batch_plan(
    run: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    load = lineage_audit._load

    def tampered(pool: Path, ref: object, what: str, **kwargs: object) -> object:
        value = load(pool, ref, what, **kwargs)
        if what == "batch plan of step 2":  # the plan as a builder bug would have written it: digest and all
            value["sample_indices"][1] = value["sample_indices"][0]
            _recompute_digest(value)
        return value

    monkeypatch.setattr(lineage_audit, "_load", tampered)
    path, location = _batch_plan(run, 2)
    status, out = _cli(capsys, "audit", str(run))
    assert status == 1
    assert "[sample trained twice] the batch plan of step 2 selects sample" in out and " 2 times" in out
    assert f"{path} (offset {location['offset']}), planned in " in out and "control/journal.log" in out


def test_audit_finds_a_group_trained_at_two_steps(
    run: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    load = lineage_audit._load
    stolen: list = []

    def tampered(pool: Path, ref: object, what: str, **kwargs: object) -> object:
        value = load(pool, ref, what, **kwargs)
        if what == "collection of step 2" and isinstance(value, list):
            stolen.append(value[0])
        if what == "collection of step 3" and isinstance(value, list):
            return [*value, stolen[0]]  # step 3 trains step 2's first group again, consistently recorded
        indices = [sample.index for sample in stolen[0].load()] if stolen else []
        if what == "batch plan of step 3":
            value["sample_indices"] = [*value["sample_indices"], *indices]
            value["rollout_ids"] = [*value["rollout_ids"], *[None] * len(indices)]
            _recompute_digest(value)
        if what == "converted batch of step 3":
            value["sample_indices"] = [*value["sample_indices"], *indices]
            value["rollout_ids"] = [*value["rollout_ids"], *[3] * len(indices)]
        return value

    monkeypatch.setattr(lineage_audit, "_load", tampered)
    status, out = _cli(capsys, "audit", str(run))
    assert status == 1
    first = next(line for line in out.splitlines() if line.startswith("  ["))
    assert first.startswith("  [sample trained twice] sample ") and " was trained at step 2 (branch " in first
    assert "and again at step 3" in first


def test_a_deleted_commit_component_is_named(run: Path, capsys: pytest.CaptureFixture) -> None:
    deleted = lineage(run)[-1].directory / "iter_0000002" / "optimizer.pt"
    deleted.unlink()
    status, out = _cli(capsys, "audit", str(run))
    assert status == 1
    assert "[damaged commit] the joint commit of step 2 is damaged: step 2 component iter_0000002/optimizer.pt" in out
    assert f"    {deleted}" in out
    status, out = _cli(capsys, str(run))
    assert status == 1 and f"{deleted}: step 2 component iter_0000002/optimizer.pt listed by the commit marker" in out
    assert any(line.split()[1:3] == ["2", "TORN"] for line in out.splitlines() if line.startswith("  "))
    assert f"fork: resume step {NUM_ROLLOUT - 1}" in out  # the newest commit is intact: a rerun still resumes it


def test_a_truncated_snapshot_is_named_and_stops_a_rerun(run: Path, capsys: pytest.CaptureFixture) -> None:
    snapshot = lineage(run)[-1].directory / "rollout" / f"builder_state_{NUM_ROLLOUT - 1}.json"
    size = snapshot.stat().st_size
    snapshot.write_text(snapshot.read_text()[: size // 2])
    status, out = _cli(capsys, "audit", str(run))
    assert status == 1 and f"has {size // 2} bytes but the commit marker listed {size}" in out
    assert f"    {snapshot}" in out
    status, out = _cli(capsys, str(run))
    assert status == 1 and str(snapshot) in out
    assert "refuse: a rerun would stop before training: Checkpoint component missing or changed" in out


def test_a_pool_from_another_run_is_named(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from straw import Coordinator, Record, SharedFilesystemStore, TaskSpec

    other = tmp_path / "other_pool"
    store = SharedFilesystemStore(other, "rollout", codecs=("bytes.v1", "json.v1"))
    ref = store.publish([Record("prompt", b"x")], submission_id="input")
    queue = Coordinator(store, queue_id="run:another", namespace=True, exclusive_owner="test")
    queue.submit_tasks("submit", [TaskSpec("prompt:0", ref)])
    queue.close()
    store.close()
    pool = run / "rollout_data"
    shutil.rmtree(pool)
    shutil.copytree(other, pool)
    queue_id = lineage(run)[0].record["queue_id"]
    missing = queue_directory(pool, queue_id) / "run.json"
    status, out = _cli(capsys, str(run))
    assert status == 1
    assert (
        f"{missing}: the straw pool {pool} holds no queue {queue_id!r}, which {run / 'rollout' / 'branch.json'}" in out
    )
    assert "queue 'run:another' belongs to no branch of this save directory" in out
    status, out = _cli(capsys, "audit", str(run))
    assert status == 1 and f"[queue journal] the straw pool {pool} holds no queue {queue_id!r}" in out
    assert f"    {missing}" in out
