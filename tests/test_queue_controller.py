"""RolloutQueueController: save-directory lock, crash recovery, online GC failure, input validation."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace

import pytest
from fakes import local_actor_handle

from slime.data import queue_data_source
from slime.data.checkpoint import RestorePlan
from slime.data.queue_data_source import RolloutQueueController
from slime.utils.types import Sample


def _args(root: Path, **extra) -> SimpleNamespace:
    return SimpleNamespace(
        **{"rollout_data_transport": "straw", "save": str(root), "load": None, "rollout_data_dir": None, **extra}
    )


def _plan(root: Path, *, mode="new", queue_id=None) -> RestorePlan:
    current = root / "rollout" / "current.json"
    queue_id = queue_id or f"run:{uuid.uuid4().hex}"
    branch = {"version": 1, "parent": None, "initial_load": None, "initial_configuration": {}, "queue_id": queue_id}
    expected = current.read_text() if current.exists() else None
    return RestorePlan(mode, str(root), expected, branch, queue_id)


def _collect(controller, step, value):
    """Accept one collection the way accept_raw_rollout does: lease, publish with its binding, complete."""
    lease = controller.begin_collection(str(step))
    ref = controller.codec.publish(
        value,
        submission_id=f"collection:{lease.attempt_id}",
        metadata={"task_id": lease.task_id, "attempt_id": lease.attempt_id},
    )
    return controller.complete(lease, ref)


def test_lock_excludes_a_second_job_and_rejects_stale_selection(tmp_path):
    root = tmp_path / "run"
    first, stale = _plan(root), _plan(root)
    with closing(RolloutQueueController(_args(root), restore_plan=first)) as controller:
        current = json.loads((root / "rollout" / "current.json").read_text())
        assert current == {"version": 1, "directory": str(root), "tracker": None}
        branch = json.loads((root / "rollout" / "branch.json").read_text())
        assert branch["queue_id"] == first.queue_id and branch["pool"] == controller.args.rollout_data_dir
        with pytest.raises(RuntimeError, match="Another training job owns save directory"):
            RolloutQueueController(_args(root), restore_plan=stale)
    with pytest.raises(RuntimeError, match="changed during startup"):
        RolloutQueueController(_args(root), restore_plan=stale)
    with closing(RolloutQueueController(_args(root), restore_plan=_plan(root))):
        pass


@pytest.mark.parametrize("stage", ["publication", "coordinator", "after_coordinator"])
def test_failed_constructor_releases_lock_even_with_live_traceback(tmp_path, monkeypatch, stage):
    root = tmp_path / "run"
    plan = _plan(root)

    def fail(*args, **kwargs):
        raise OSError("disk went away")

    with monkeypatch.context() as patch:
        if stage == "publication":
            patch.setattr(queue_data_source, "write_report", fail)
        elif stage == "coordinator":
            patch.setattr(queue_data_source.Coordinator, "__init__", fail)
        else:
            patch.setattr(RolloutQueueController, "_start_gc", fail)
        with pytest.raises(OSError, match="disk went away") as error:
            RolloutQueueController(_args(root), restore_plan=plan)
    assert error.value.__traceback__ is not None
    # Resuming the interrupted start recovers the queue only if its run.json was created.
    resume = _plan(root, mode="resume", queue_id=plan.queue_id) if stage != "publication" else _plan(root)
    with closing(RolloutQueueController(_args(root), restore_plan=resume)) as controller:
        assert controller.queue.queue_id == resume.queue_id


def test_close_keeps_lock_through_seal_and_releases_it_when_seal_fails(tmp_path, monkeypatch):
    root = tmp_path / "run"
    controller = RolloutQueueController(_args(root), restore_plan=_plan(root))
    during = []

    def failing_seal():
        with pytest.raises(RuntimeError, match="Another training job"):
            RolloutQueueController(_args(root), restore_plan=_plan(root))
        during.append(True)
        raise OSError("seal failed")

    with monkeypatch.context() as patch:  # the writer is cached per process: unpatch before the next owner
        patch.setattr(controller.store, "seal", failing_seal)
        with pytest.raises(OSError, match="seal failed"):
            controller.close()
    assert during == [True]
    with closing(RolloutQueueController(_args(root), restore_plan=_plan(root))):
        pass


_CRASHING_OWNER = """
import json, sys, pickle
from slime.data.queue_data_source import RolloutQueueController
from slime.utils.types import Sample
args, plan = pickle.load(sys.stdin.buffer)
controller = RolloutQueueController(args, restore_plan=plan)
lease = controller.begin_collection("0")
ref = controller.codec.publish({"step": 0}, submission_id=f"collection:{lease.attempt_id}",
                               metadata={"task_id": lease.task_id, "attempt_id": lease.attempt_id})
receipt = controller.complete(lease, ref)
controller.begin_collection("1")  # leased, never completed: the process dies here
print(json.dumps({"position": receipt.position, "digest": receipt.result_ref.digest}), flush=True)
sys.stdin.buffer.read(1)
"""


def test_killed_owner_between_begin_and_complete_loses_and_duplicates_nothing(tmp_path):
    import pickle

    root = tmp_path / "run"
    plan = _plan(root)
    process = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        pickle.dump((_args(root), plan), process.stdin)
        process.stdin.flush()
        line = process.stdout.readline()
        assert line, process.stderr.read().decode()
        accepted = json.loads(line)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        for stream in (process.stdin, process.stdout, process.stderr):
            stream.close()
    resume = _plan(root, mode="resume", queue_id=plan.queue_id)
    with closing(RolloutQueueController(_args(root), restore_plan=resume)) as controller:
        assert controller.queue.pending_tasks(task_prefix="collection:") == []
        receipt = _collect(controller, 1, {"step": 1})
        commits = controller.queue.read_commits().commits
        assert [c.position for c in commits] == [0, 1]
        assert commits[0].result_ref.digest == accepted["digest"]
        assert receipt.position == 1 and commits[1] == receipt
        assert controller.codec.load(commits[0].result_ref) == {"step": 0}
        assert len({c.task_id for c in commits}) == 2
        # Re-completing the same attempt is idempotent, not a second accepted result.
        assert controller.complete(controller.begin_collection("1"), receipt.result_ref) == receipt
        assert len(controller.queue.read_commits().commits) == 2


def test_online_gc_failure_stops_queue_work_loudly(tmp_path):
    args = SimpleNamespace(
        rollout_data_transport="straw",
        rollout_data_dir=str(tmp_path / "pool"),
        save=None,
        rollout_queue_online_gc=True,
        rollout_queue_gc_interval=0.01,
    )
    controller = RolloutQueueController(args, defer_gc=True)

    def broken():
        raise OSError("pack directory unreadable")

    controller._queue.collect_garbage = broken
    controller._start_gc()
    deadline = time.monotonic() + 10
    while controller._gc_error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="online GC failed; queue work has stopped"):
        controller.begin_collection("0")
    with pytest.raises(RuntimeError, match="online GC failed"):
        controller.close()


def test_bad_inputs_get_clear_errors(tmp_path):
    from dataclasses import replace

    args = SimpleNamespace(rollout_data_transport="straw", rollout_data_dir=str(tmp_path / "pool"), save=None)
    with closing(RolloutQueueController(args)) as controller:
        receipt = _collect(controller, 0, {"step": 0})
        assert controller.accepted(receipt) == receipt
        with pytest.raises(ValueError, match="not in this run's accepted log"):
            controller.accepted(replace(receipt, position=7))
        with pytest.raises(ValueError, match="unknown or unready training batch"):
            controller.finish_batch("batch:missing")
        bad = controller.codec.publish({"positions": [5], "reason": "filter"}, submission_id="bad-disposition")
        with pytest.raises(ValueError, match="Invalid accepted-output disposition"):
            controller.record_dispositions(bad)
        plan = controller.codec.publish({"plan": 1}, submission_id="plan")
        batch = controller.plan_batch("batch:x", [0], plan)
        lease = batch["lease"]
        ready = controller.codec.publish(
            {"converted": 1},
            submission_id="ready",
            metadata={"task_id": "batch:x", "attempt_id": lease["attempt_id"]},
        )
        controller.ready_batch("batch:x", ready)
        assert controller.training_state()["processed_cursor"] == 1
        other = controller.codec.publish({"converted": 2}, submission_id="other")
        with pytest.raises(ValueError, match="already published with another ready reference"):
            controller.ready_batch("batch:x", other)
        controller.finish_batch("batch:x")
        assert controller.training_state()["processed_cursor"] == 2
        assert controller.queue._usage()["accepted_unprocessed"]["bytes"] == 0


def test_prompt_tasks_are_produced_once_and_handed_back(tmp_path, monkeypatch):
    from slime.data import queue_reader
    from slime.data.transport import pack_rollout_group

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"p{i}"}) + "\n" for i in range(3)))
    args = SimpleNamespace(
        rollout_data_transport="straw",
        rollout_data_dir=str(tmp_path / "pool"),
        save=str(tmp_path / "save"),
        load=None,
        prompt_data=str(prompts),
        n_samples_per_prompt=2,
        rollout_queue_take_timeout=1,
    )
    monkeypatch.setattr(queue_reader.ray, "get", lambda value: value)
    with closing(RolloutQueueController(args)) as controller:
        handle = local_actor_handle(controller)
        source = queue_data_source.QueueDataSource(args, controller=handle)
        try:
            assert source.dataset_size == 3 and source.reader_config.dataset_size == 3
            groups = source.get_samples(2)
            assert [[s.prompt for s in g] for g in groups] == [["p0", "p0"], ["p1", "p1"]]
            assert all(s._queue_lease == groups[0][0]._queue_lease for s in groups[0])
            produced = controller.queue.producer_state("dataset")
            assert produced["cursor"]["sample_group_index"] == 8  # one refill of 8 groups, committed with them
            receipt_group = groups[0]
            for sample in receipt_group:
                sample.response, sample.tokens, sample.response_length = "ok", [1, 2], 1
                sample.status = sample.Status.COMPLETED
            ref = pack_rollout_group(receipt_group, args, 0, controller=handle)
            assert ref.receipt.position == 0
            groups[1][0].status = groups[1][0].Status.ABORTED
            source.add_samples([groups[1]])
            again = source.get_samples(1)
            assert again[0][0].prompt == "p1" and again[0][0].status == again[0][0].Status.ABORTED  # priority first
            source.save(0)
            saved = json.loads((tmp_path / "save" / "rollout" / "queue_state_0.json").read_text())
            assert saved["storage_owner"].startswith("checkpoint:") and saved["version"] == 1
            with pytest.raises(ValueError, match="carry its lease"):
                source.add_samples([[Sample()]])
        finally:
            source.close()
        # 8 produced, p0 accepted; the re-taken p1 went back to the queue when the reader closed.
        assert controller.pending_count() == 7


def test_fork_queue_activates_once(tmp_path):
    parent, child = tmp_path / "run", tmp_path / "run" / "branches" / "child"
    args = _args(child, rollout_data_dir=str(tmp_path / "pool"))
    args.load = str(parent)
    fork = dataclasses.replace(_plan(parent, mode="snapshot"), queue_id=None)
    with closing(RolloutQueueController(args, restore_plan=fork)) as controller:
        assert controller.queue.queue_id.startswith("fork:")
        assert not (child / "rollout" / "fork-active.json").exists()  # nothing published before first use
        _collect(controller, 0, {"step": 0})
        active = json.loads((child / "rollout" / "fork-active.json").read_text())
        assert active == {"queue_id": controller.queue.queue_id}
    again = _args(child, rollout_data_dir=str(tmp_path / "pool"))
    again.load = str(parent)
    with pytest.raises(ValueError, match="already started"):
        RolloutQueueController(again, restore_plan=dataclasses.replace(_plan(parent, mode="snapshot"), queue_id=None))
    same = _args(parent, rollout_data_dir=str(tmp_path / "pool"))
    same.load = str(parent)
    with pytest.raises(ValueError, match="isolated output branch"):
        RolloutQueueController(same, restore_plan=_plan(parent, mode="snapshot"))


def test_a_run_that_trained_before_its_first_commit_reruns_on_a_fresh_queue(tmp_path):
    """Its trained progress belongs to a model no commit kept: the rerun, back at the initial model, must train
    those prompt groups again rather than find them marked processed."""
    from slime.data.queue_controller import TRAINING_CONSUMER

    root = tmp_path / "run"
    plan = _plan(root)
    with closing(RolloutQueueController(_args(root), restore_plan=plan)) as first:
        receipt = _collect(first, 0, {"step": 0})
        state = {"version": 1, "processed_cursor": 0, "fetch_cursor": 0, "processed_positions": [], "batches": []}
        first._advance(state, [receipt.position])  # what the batch builder records once step 0 trained
        first._save_training_state(state)
        assert first.queue.load_consumer_state(TRAINING_CONSUMER) is not None
    resume = _plan(root, mode="resume", queue_id=plan.queue_id)
    with closing(RolloutQueueController(_args(root), restore_plan=resume)) as again:
        fresh = again.restore_plan.queue_id
        assert fresh != plan.queue_id and again.restore_plan.mode == "new"
        assert again.training_state() is None and list(again.queue.read_commits().commits) == []
        branch = json.loads((root / "rollout" / "branch.json").read_text())
        assert branch["queue_id"] == fresh and branch["restarted_from_queue"] == plan.queue_id
