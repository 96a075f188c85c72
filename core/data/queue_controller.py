"""`RolloutQueueController`: the one owner of a run's straw queue (a Ray actor in production).

It wraps a `straw.coordinator.Coordinator` and holds, for checkpoint-managed runs, an exclusive `flock` on
`<logical save>/rollout/session.lock`. Collections (one per rollout step) and training batches (one per
conversion) are queue tasks, so every accepted result - raw collections and conversions alike - gets a commit
position in one accepted log. Training progress is the `"training"` consumer: a codec-published state plus a
`json.v1` progress record that lists sparse processed positions (straw computes `accepted_unprocessed` from it).

Names tests patch (`write_report`, `Coordinator`) are looked up on `slime.data.queue_data_source` at call time.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from slime.data.checkpoint import RestorePlan
from slime.data.queue_prompts import PromptTasks
from slime.data.queue_state import QueueState
from slime.data.refs import DiskPayloadRef
from slime.data.straw_settings import StrawSettings
from slime.data.transport import resolve_rollout_data_dir, rollout_store

logger = logging.getLogger(__name__)

TRAINING_CONSUMER = "training"
MANAGER_WORKER = "manager"
_RELEASE_BATCH = 128


def _facade() -> Any:
    """The public module, whose attributes tests monkeypatch."""
    import slime.data.queue_data_source as facade

    return facade


def _record_set(value: Any) -> Any:
    from straw.protocol import RecordSetRef

    if value is None or isinstance(value, RecordSetRef):
        return value
    return RecordSetRef.from_dict(value)


def _default_training_state() -> dict:
    return {"version": 1, "processed_cursor": 0, "fetch_cursor": 0, "processed_positions": [], "batches": []}


class RolloutQueueController(PromptTasks):
    """Queue owner: collection and batch tasks, the training consumer, and the save-directory lock."""

    def __init__(
        self, args: Any, *, producer: Any = None, restore_plan: RestorePlan | None = None, defer_gc: bool = False
    ) -> None:
        self.args = args
        self._lock_file = None
        self._gc_stop = threading.Event()
        self._gc_thread: threading.Thread | None = None
        self._gc_error: BaseException | None = None
        # Everything opened here is closed explicitly on failure: a caller that keeps the exception's
        # traceback alive must not keep the save-directory lock alive with it.
        with contextlib.ExitStack() as cleanup:
            plan = restore_plan or RestorePlan()
            debug = getattr(args, "load_debug_rollout_data", None)
            if isinstance(debug, str) and debug.endswith(".straw.json"):
                plan = RestorePlan(queue_id=f"debug:{uuid.uuid4().hex}")
            self.restore_plan = plan
            if plan.root:
                self._lock_file = self._acquire_save_lock(Path(plan.root), cleanup)
                self._publish_branch(plan)
            else:
                resolve_rollout_data_dir(args)
            self.store, self.codec, self._writer_lock = rollout_store(args)
            coordinator = _facade().Coordinator
            if not hasattr(coordinator, "yield_tasks"):
                raise RuntimeError("straw-queue is too old for slime: upgrade with `pip install -U straw-queue`")
            options, recover, fork = self._queue_options(plan)
            if recover and plan.mode == "resume" and self._training_advanced(coordinator, options):
                plan = self._start_over(plan)
                self.restore_plan = plan
                options, recover, fork = self._queue_options(plan)
            self._queue = coordinator(
                self.store,
                **options,
                exclusive_owner=f"slime rollout controller pid={os.getpid()}",
                recover=recover,
                lease_seconds=StrawSettings.from_args(args).lease_seconds,
            )
            cleanup.callback(self._queue.close)
            self.producer = producer
            self._initial_cursor = plan.dataset_cursor
            self._producer_lock = threading.Lock()
            self._training_lock = threading.RLock()
            self._retired_readers: set[str] = set()
            self.branch_id = uuid.uuid4().hex
            self._training_token = None
            self._fork_ready = not fork
            self._fork_active = False
            if fork and self._queue.producer_state("fork-active") is not None:
                raise ValueError("This queue branch has already started; resolve checkpoint selection again")
            if plan.mode == "resume":
                reads = list(self._queue.outstanding_reads())
                for start in range(0, len(reads), _RELEASE_BATCH):
                    self._queue.release_task_reads(reads[start : start + _RELEASE_BATCH])
            for spec in self._queue.pending_tasks(task_prefix="collection:"):
                self._queue.cancel_task(spec.task_id, request_id=f"abandon:{self.branch_id}:{spec.task_id}")
            if not fork and not defer_gc:
                self._start_gc()
            cleanup.pop_all()

    # ----------------------------------------------------------------------------------------- startup

    @staticmethod
    def _acquire_save_lock(root: Path, cleanup: contextlib.ExitStack) -> Any:
        directory = root / "rollout"
        directory.mkdir(parents=True, exist_ok=True)
        handle = cleanup.enter_context(open(directory / "session.lock", "a"))  # noqa: SIM115 - owned by the stack
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise RuntimeError(f"Another training job owns save directory {root}") from exc
        return handle

    def _publish_branch(self, plan: RestorePlan) -> None:
        """Publish this run's branch (branch.json, logical tracker, current.json) before any queue write."""
        write_report = _facade().write_report
        root = Path(plan.root)
        current_path = root / "rollout" / "current.json"
        current = current_path.read_text() if current_path.exists() else None
        if current != plan.expected_current:
            raise RuntimeError("Current checkpoint branch changed during startup; restart to resolve it again")
        args = self.args
        resolve_rollout_data_dir(args)
        branch = dict(plan.branch or {})
        write_report(Path(args.save) / "rollout" / "branch.json", {**branch, "pool": args.rollout_data_dir})
        tracker_path = root / "latest_checkpointed_iteration.txt"
        parent = branch.get("parent")
        if parent:
            write_report(tracker_path, parent["step"])
        tracker = tracker_path.read_text() if tracker_path.exists() else None
        write_report(current_path, {"version": 1, "directory": args.save, "tracker": tracker})
        source = f"{parent['directory']} step {parent['step']}" if parent else "no checkpoint (new run)"
        logger.info(
            "Rollout queue branch: physical save dir %s, logical save dir %s, restored from %s",
            args.save,
            root,
            source,
        )

    def _queue_exists(self, queue_id: str) -> bool:
        from straw.protocol import digest

        return (Path(self.store.backend.root) / "queues" / digest(queue_id) / "run.json").exists()

    def _training_advanced(self, coordinator: Any, options: dict) -> bool:
        """Whether the interrupted run's queue records training progress (a saved `"training"` consumer state).

        Before a run's first joint commit, such progress belongs to a model that was never committed: the rerun
        starts from the initial model again, and continuing this queue would leave the prompt groups that model
        trained marked processed, so the lineage would never train them."""
        peek = coordinator(self.store, **options, exclusive_owner=f"slime resume check pid={os.getpid()}", recover=True)
        try:
            return peek.load_consumer_state(TRAINING_CONSUMER) is not None
        finally:
            peek.close()

    def _start_over(self, plan: RestorePlan) -> RestorePlan:
        """A fresh queue for a run whose interrupted attempt trained before its first commit (see
        `_training_advanced`): the same branch directory, configuration and pool; the dataset from its start. The
        old queue is left to the pool's garbage collection."""
        queue_id = f"run:{uuid.uuid4().hex}"
        branch = {**(plan.branch or {}), "queue_id": queue_id, "restarted_from_queue": plan.queue_id}
        logger.warning(
            "The interrupted run trained before its first joint commit; that progress is lost with its model, so this "
            "run starts over on a fresh queue %s (was %s)",
            queue_id,
            plan.queue_id,
        )
        _facade().write_report(
            Path(self.args.save) / "rollout" / "branch.json", {**branch, "pool": self.args.rollout_data_dir}
        )
        return RestorePlan("new", plan.root, plan.expected_current, branch, queue_id, None)

    def _queue_options(self, plan: RestorePlan) -> tuple[dict, bool, bool]:
        """(Coordinator queue options, recover flag, whether this is a fork of a checkpoint)."""
        args = self.args
        queue_id = plan.queue_id
        if plan.mode == "snapshot":
            save, load = getattr(args, "save", None), getattr(args, "load", None)
            if not save or not load:
                raise ValueError("Checkpoint restore requires resolved load and save paths")
            save_path, load_path = Path(save).resolve(), Path(load).resolve()
            if save_path == load_path:
                raise ValueError("Checkpoint restore requires an isolated output branch (--save differs from --load)")
            if (save_path / "rollout" / "fork-active.json").exists():
                raise ValueError("This queue branch has already started; resolve checkpoint selection again")
            if queue_id is None:
                from straw.protocol import digest

                queue_id = "fork:" + digest(str(save_path))
            return {"queue_id": queue_id, "namespace": True}, self._queue_exists(queue_id), True
        recover = plan.mode == "resume"
        if recover and queue_id is None and getattr(args, "load", None):
            active = Path(args.load) / "rollout" / "fork-active.json"
            if active.exists():
                import json

                queue_id = json.loads(active.read_text())["queue_id"]
        if queue_id is None:
            if recover:
                recover = (Path(self.store.backend.root) / "run.json").exists()
            return {}, recover, False
        if recover:
            recover = self._queue_exists(queue_id)
        return {"queue_id": queue_id, "namespace": True}, recover, False

    # ----------------------------------------------------------------------------------------- GC and close

    def _start_gc(self) -> None:
        """Start the online GC thread (only with --rollout-queue-online-gc)."""
        if not StrawSettings.from_args(self.args).online_gc or self._gc_thread is not None:
            return
        self._gc_thread = threading.Thread(target=self._gc_loop, name="straw-gc", daemon=True)
        self._gc_thread.start()

    def _gc_loop(self) -> None:
        interval = StrawSettings.from_args(self.args).gc_interval_s
        while not self._gc_stop.wait(interval):
            try:
                with self._training_lock:
                    self._queue.collect_garbage()
            except BaseException as exc:  # noqa: BLE001 - stored and re-raised on every queue access
                logger.exception("Straw online GC failed; queue work has stopped")
                self._gc_error = exc
                return

    def _check_gc(self) -> None:
        if self._gc_error is not None:
            raise RuntimeError("Straw online GC failed; queue work has stopped") from self._gc_error

    @property
    def queue(self) -> Any:
        """The coordinator; raises once online GC has failed."""
        self._check_gc()
        return self._queue

    def close(self) -> None:
        """Close the queue and seal the store while still holding the save-directory lock; then release it."""
        try:
            self._gc_stop.set()
            if self._gc_thread is not None:
                self._gc_thread.join()
                self._gc_thread = None
            try:
                self._queue.close()
            finally:
                with self._writer_lock:
                    self.store.seal()
                self._check_gc()
        finally:
            if self._lock_file is not None:
                self._lock_file.close()
                self._lock_file = None

    # ----------------------------------------------------------------------------------------- collections

    def _activate_fork(self) -> None:
        if self._fork_ready or self._fork_active:
            return
        queue_id = self._queue.queue_id
        self.queue.submit_tasks(
            f"fork-active:{queue_id}",
            [],
            producer_id="fork-active",
            producer_state={"version": 1, "queue_id": queue_id},
        )
        _facade().write_report(Path(self.args.save) / "rollout" / "fork-active.json", {"queue_id": queue_id})
        self._fork_active = self._fork_ready = True
        self._start_gc()

    def _manager_lease(self, task_id: str, what: str) -> Any:
        """The manager's current lease on `task_id` (reusing an existing one), acquiring it when pending."""
        from straw.protocol import Lease

        status = self.queue.task_status(task_id)
        lease = (status or {}).get("lease")
        if lease and lease.get("worker_id") == MANAGER_WORKER and status.get("state") in {"leased", "completed"}:
            return Lease(**lease)
        acquired = self.queue.acquire(MANAGER_WORKER, 1, task_ids=[task_id], control=True)
        if not acquired.assignments:
            raise RuntimeError(f"{what} task is not available: {task_id} ({acquired.status}, state {status})")
        return acquired.assignments[0].lease

    def begin_collection(self, request_id: str) -> Any:
        """Lease (idempotently) the collection task for rollout step `request_id`."""
        from straw.protocol import TaskSpec

        self._activate_fork()
        task_id = f"collection:{self.branch_id}:{request_id}"
        spec = TaskSpec(task_id, allow_empty=True, control=True, estimated_records=0)
        self.queue.submit_tasks(task_id, [spec])
        return self._manager_lease(task_id, "Collection")

    def complete(self, lease: Any, result_ref: Any) -> Any:
        """Accept `result_ref` (published with the lease's task/attempt metadata) as the task's result."""
        from straw.errors import StaleAttempt

        result_ref = _record_set(result_ref)
        if lease.worker_id in self._retired_readers and self.result(lease) is None:
            raise StaleAttempt(f"Reader {lease.worker_id} was retired; its lease for {lease.task_id} is stale")
        return self.queue.complete_task(
            lease, submission_id=f"result:{lease.attempt_id}", result_ref=result_ref, result_digest=result_ref.digest
        )

    def result(self, lease: Any) -> Any:
        """The receipt of the lease's accepted result, or None."""
        return self.queue.lookup_submission(f"result:{lease.attempt_id}")

    def results(self, leases: list) -> list:
        return [None if lease is None else self.result(lease) for lease in leases]

    def accepted(self, receipt: Any) -> Any:
        """Check that `receipt` is in this run's accepted log and its result is readable; return it."""
        found = self.queue.lookup_submission(receipt.submission_id)
        if found != receipt:
            raise ValueError("Raw rollout reference is not in this run's accepted log")
        self.store.validate(found.result_ref)
        return found

    def reject(self, lease: Any, reason: str) -> None:
        """Drop a leased task's result for good (e.g. a dynamic filter), recording its replaced inputs."""
        status = self.queue.task_status(lease.task_id) or {}
        self.queue.fail_task(
            lease,
            request_id=f"reject:{lease.attempt_id}",
            failure={"category": "Filtered", "message": reason},
            retryable=False,
        )
        positions = ((status.get("spec") or {}).get("metadata") or {}).get("source_positions")
        if positions:
            self.record_dispositions(self._publish_disposition(positions, reason))

    def heartbeat(self, leases: list) -> Any:
        return self.queue.heartbeat(leases)

    # ----------------------------------------------------------------------------------------- batches

    def batch(self, batch_id: str) -> dict | None:
        """The batch task's plan, input positions, lease and (once converted) ready reference."""
        status = self.queue.task_status(batch_id)
        if status is None:
            return None
        from straw.protocol import Lease

        lease = status.get("lease")
        receipt = self.result(Lease(**lease)) if lease else None
        spec = status["spec"]
        return {
            "plan_ref": spec["input_ref"],
            "input_positions": (spec.get("metadata") or {}).get("source_positions", []),
            "lease": lease,
            "ready": receipt is not None,
            "ready_ref": asdict(receipt.result_ref) if receipt is not None else None,
        }

    def plan_batch(self, batch_id: str, positions: list[int], plan_ref: Any) -> dict:
        """Submit (idempotently) the batch as a control task whose input is the plan, and lease it."""
        from straw.protocol import TaskSpec

        with self._training_lock:
            spec = TaskSpec(
                batch_id,
                _record_set(plan_ref),
                control=True,
                estimated_records=0,
                metadata={"source_positions": sorted(int(p) for p in positions)},
            )
            self.queue.submit_tasks(batch_id, [spec])
            status = self.queue.task_status(batch_id)
            if status["state"] == "pending":
                self._manager_lease(batch_id, "Batch")
            state = self._training_state()
            if not state.get("conversion_started"):
                state["conversion_started"] = True
                self._save_training_state(state)
            return self.batch(batch_id)

    def ready_batch(self, batch_id: str, ready_ref: Any) -> Any:
        """Accept the conversion as the batch task's result, then mark the batch's inputs processed."""
        ready_ref = _record_set(ready_ref)
        with self._training_lock:
            batch = self.batch(batch_id)
            if batch is None:
                raise ValueError(f"Cannot publish an unknown training batch: {batch_id}")
            if batch["ready"]:
                if _record_set(batch["ready_ref"]) != ready_ref:
                    raise ValueError("Batch was already published with another ready reference")
            else:
                self.complete(self._manager_lease(batch_id, "Batch"), ready_ref)
            state = self._training_state()
            self._advance(state, batch["input_positions"])
            ref = DiskPayloadRef(ready_ref, str(self.store.backend.root))
            if ref not in state["batches"]:
                state["batches"].append(ref)
            return self._save_training_state(state)

    def finish_batch(self, batch_id: str) -> Any:
        """Training consumed the batch: mark the conversion's own commit processed."""
        with self._training_lock:
            batch = self.batch(batch_id)
            if batch is None or not batch["ready"]:
                raise ValueError(f"Cannot finish an unknown or unready training batch: {batch_id}")
            from straw.protocol import Lease

            receipt = self.result(Lease(**batch["lease"]))
            state = self._training_state()
            self._advance(state, [receipt.position])
            ready = _record_set(batch["ready_ref"])
            state["batches"] = [ref for ref in state["batches"] if ref.manifest != ready]
            state_ref = self._save_training_state(state)
            if StrawSettings.from_args(self.args).online_gc:
                self.queue.collect_garbage()
            return state_ref

    # ----------------------------------------------------------------------------------------- training state

    def _training_state(self) -> dict:
        saved = self.queue.load_consumer_state(TRAINING_CONSUMER)
        if not saved or not saved.get("state_ref"):
            return _default_training_state()
        return self.codec.load(_record_set(saved["state_ref"]))

    def _task_source_positions(self, position: int) -> list[int]:
        page = self.queue.read_commits(cursor=position, limit=1)
        if not page.commits or page.commits[0].position != position:
            return []
        status = self.queue.task_status(page.commits[0].task_id) or {}
        return list(((status.get("spec") or {}).get("metadata") or {}).get("source_positions") or [])

    def _advance(self, state: dict, positions: Any) -> None:
        """Mark `positions` (and the older accepted versions they replaced) processed; move the cursor."""
        positions = [int(p) for p in positions]
        if not positions:
            return
        cursor = state["processed_cursor"]
        known = set(state["processed_positions"])
        pending = [p for p in positions if p >= cursor and p not in known]
        while pending:
            position = pending.pop()
            if position in known or position < cursor:
                continue
            known.add(position)
            pending.extend(p for p in self._task_source_positions(position) if p >= cursor and p not in known)
        while cursor in known:
            cursor += 1
        state["processed_cursor"] = cursor
        state["fetch_cursor"] = max(state["fetch_cursor"], max(positions) + 1)
        state["processed_positions"] = sorted(p for p in known if p >= cursor)

    def _save_training_state(self, state: dict) -> Any:
        from straw.protocol import Record, encode

        self._check_gc()
        with self._training_lock:
            if self._training_token is None:
                self._training_token = self.queue.open_consumer(
                    TRAINING_CONSUMER, exclusive_owner="job owns one BatchBuilder"
                )
            with self._writer_lock:
                state_ref = self.codec.publish(state, submission_id=f"training-state:{uuid.uuid4().hex}")
                progress = {"version": 1, "processed_positions": state["processed_positions"], "finished_batches": []}
                progress_ref = self.store.publish(
                    [Record("progress", encode(progress), codec="json.v1")],
                    submission_id=f"progress:{state_ref.digest}",
                    dependencies=(state_ref,),
                )
            self.queue.save_consumer_state(
                TRAINING_CONSUMER,
                token=self._training_token,
                request_id=f"state:{self.branch_id}:{state_ref.digest}",
                state_ref=state_ref,
                fetch_cursor=state["fetch_cursor"],
                processed_cursor=state["processed_cursor"],
                progress_ref=progress_ref,
            )
            return state_ref

    def training_state(self) -> dict | None:
        """The `"training"` consumer's saved state (refs and cursors), or None before the first save."""
        return self.queue.load_consumer_state(TRAINING_CONSUMER)

    def restore_training_state(
        self, state_ref: Any, fetch_cursor: int, processed_cursor: int, retained_ref: Any = None
    ) -> Any:
        """Rewind the training consumer to a checkpointed state (later accepted commits become unprocessed)."""
        with self._training_lock:
            state = self.codec.load(_record_set(state_ref))
            if state["fetch_cursor"] != fetch_cursor or state["processed_cursor"] != processed_cursor:
                raise ValueError("Consumer checkpoint cursors differ from its state")
            if retained_ref is not None:
                retained = self._referenced_positions(self.codec.load(_record_set(retained_ref)))
                later = [
                    commit.position
                    for commit in self._commits_from(state["processed_cursor"])
                    if commit.position not in retained and commit.position not in state["processed_positions"]
                ]
                if later:
                    disposition = self._publish_disposition(later, "restored checkpoint source")
                    self._advance(state, later)
                    state["disposition"] = disposition
                state["restored_source"] = _record_set(retained_ref)
            state_ref = self._save_training_state(state)
        self._start_gc()
        return state_ref

    def _commits_from(self, cursor: int) -> list:
        commits = []
        while True:
            page = self.queue.read_commits(cursor=cursor, limit=100)
            commits.extend(page.commits)
            if not page.commits or page.cursor == cursor:
                return commits
            cursor = page.cursor

    def _referenced_positions(self, value: Any) -> set[int]:
        """Commit positions a retained source value refers to (receipts and recorded source positions)."""
        from slime.data.refs import RawRolloutRef, RolloutGroupRef

        found: set[int] = set()
        stack = [value]
        while stack:
            item = stack.pop()
            if isinstance(item, (RolloutGroupRef, RawRolloutRef)) and item.receipt is not None:
                found.add(item.receipt.position)
                found.update(getattr(item, "source_positions", None) or ())
            elif isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
            elif hasattr(item, "__dict__") and not isinstance(item, DiskPayloadRef):
                state = QueueState.of(item)
                if state.receipt:
                    found.add(state.position)
                found.update(state.source_positions or ())
        return found

    def _publish_disposition(self, positions: list[int], reason: str) -> Any:
        with self._writer_lock:
            return self.codec.publish(
                {"positions": sorted(int(p) for p in positions), "reason": reason},
                submission_id=f"disposition:{uuid.uuid4().hex}",
            )

    def record_dispositions(self, ref: Any) -> Any:
        """Record that accepted outputs were dropped on purpose (filters): they count as processed."""
        ref = _record_set(ref.manifest if isinstance(ref, DiskPayloadRef) else ref)
        value = self.codec.load(ref)
        positions = value.get("positions") if isinstance(value, dict) else None
        if not isinstance(value, dict) or not value.get("reason") or positions is None:
            raise ValueError("Invalid accepted-output disposition: it needs positions and a reason")
        with self._training_lock:
            accepted = {commit.position for commit in self._commits_from(0)}
            if any(int(p) not in accepted for p in positions):
                raise ValueError("Invalid accepted-output disposition: a position is not an accepted commit")
            state = self._training_state()
            self._advance(state, positions)
            state["disposition"] = ref
            return self._save_training_state(state)

    # ----------------------------------------------------------------------------------------- reporting

    def identity(self) -> dict:
        return {
            "root": str(self.store.backend.root),
            "run_id": self.store.run_id,
            "queue_id": self._queue.queue_id,
            "branch_id": self.branch_id,
        }

    def metrics(self) -> dict:
        return self.queue.metrics()
