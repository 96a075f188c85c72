"""Prompt tasks of the rollout queue: the dataset producer, reader leases, hand-backs and source snapshots.

A mixin of `RolloutQueueController` (it uses the controller's `queue`, `store`, `codec` and locks). Prompt groups
are `prompt:<group>` tasks whose input is the published group; the dataset producer's cursor is committed in
the same `submit_tasks` call as the groups it produced, so a crash never loses or repeats prompts.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import Any

from slime.data.prompt_settings import PromptSettings

PROMPT_PREFIX = "prompt:"
DATASET_PRODUCER = "dataset"
MIN_REFILL, MAX_REFILL = 8, 64
_RELEASE_BATCH = 128


class PromptTasks:
    """Prompt-task methods of the controller (see the module docstring)."""

    def _dataset(self) -> Any:
        """The prompt producer (a `RolloutDataSource` over --prompt-data), positioned at the committed cursor."""
        if self.producer is None:
            if not PromptSettings.from_args(self.args).prompt_data:
                return None
            from slime.data.data_source import RolloutDataSource

            self.producer = RolloutDataSource(self.args)
            if self._initial_cursor and self.queue.producer_state(DATASET_PRODUCER) is None:
                import torch

                self.producer.load_state_dict(torch.load(self._initial_cursor, weights_only=True))
        committed = self.queue.producer_state(DATASET_PRODUCER)
        if committed is not None:
            self.producer.load_state_dict(committed["cursor"])
        return self.producer

    def dataset_size(self) -> int:
        dataset = self._dataset()
        return 0 if dataset is None else len(dataset)

    def _refill(self, count: int) -> None:
        from straw.protocol import TaskSpec

        with self._producer_lock:
            dataset = self._dataset()
            if dataset is None:
                return
            start = dataset.state_dict()
            groups = dataset.get_samples(max(MIN_REFILL, min(MAX_REFILL, count)))
            ids = [f"{PROMPT_PREFIX}{group[0].group_index}" for group in groups]
            with self._writer_lock:
                refs = self.codec.publish_many(groups, submission_ids=[f"input:{task_id}" for task_id in ids])
            specs = [
                TaskSpec(task_id, ref, estimated_records=len(group), estimated_tokens=ref.tokens)
                for task_id, ref, group in zip(ids, refs, groups, strict=True)
            ]
            self.queue.submit_tasks(
                f"{DATASET_PRODUCER}:{start['epoch_id']}:{start['sample_offset']}:{start['sample_group_index']}",
                specs,
                producer_id=DATASET_PRODUCER,
                producer_state={"version": 1, "cursor": dataset.state_dict()},
            )

    def take(self, reader_id: str, count: int) -> list[dict]:
        """Lease up to `count` prompt tasks for `reader_id`, producing new groups from the dataset when empty.

        Each entry: `{"lease": Lease, "input_ref": RecordSetRef, "source_positions": [...]}`.
        """
        if reader_id in self._retired_readers:
            raise ValueError(f"Reader {reader_id} was retired; start a new reader id")
        self._activate_fork()
        acquired = self.queue.acquire(reader_id, count, task_prefix=PROMPT_PREFIX)
        assignments = list(acquired.assignments)
        if len(assignments) < count:
            self._refill(count - len(assignments))
            more = self.queue.acquire(reader_id, count - len(assignments), task_prefix=PROMPT_PREFIX)
            assignments.extend(more.assignments)
        return [
            {
                "lease": assignment.lease,
                "input_ref": assignment.task.input_ref,
                "source_positions": list(assignment.task.metadata.get("source_positions") or []),
            }
            for assignment in assignments
        ]

    def live_leases(self, leases: list) -> list:
        """Renew the leases whose tasks are not yet accepted; returns those still held."""
        live = [lease for lease in leases if self.result(lease) is None]
        if live:
            self.queue.heartbeat(live)
        return live

    def release(self, leases: list) -> None:
        """Give unfinished leased tasks back to the queue (no retry is spent)."""
        leases = [lease for lease in leases if self.result(lease) is None]
        for start in range(0, len(leases), _RELEASE_BATCH):
            batch = leases[start : start + _RELEASE_BATCH]
            self.queue.release_tasks(batch, request_id=f"release:{uuid.uuid4().hex}")

    def return_groups(self, updates: list[dict]) -> None:
        """Yield leased tasks back with a new input (a partial or ready group), priority and scheduling key."""
        if updates:
            self.queue.yield_tasks(
                [{**update, "input_ref": asdict(update["input_ref"])} for update in updates],
                request_id=f"return:{uuid.uuid4().hex}",
            )

    def retire_reader(self, reader_id: str) -> None:
        """Fence a reader the host confirmed stopped: its unfinished leases return to the queue."""
        self._retired_readers.add(reader_id)
        self.queue.retire_worker(reader_id)

    def pending_count(self) -> int:
        return len(self.queue.pending_tasks(task_prefix=PROMPT_PREFIX))

    def pending_snapshot(self, owner: str) -> dict:
        """Publish the pending prompt tasks and producer cursor, retained under `owner`; returns the manifest."""
        pending = [
            {"task_id": spec.task_id, "input_ref": spec.input_ref, "metadata": spec.metadata}
            for spec in self.queue.pending_tasks(task_prefix=PROMPT_PREFIX)
        ]
        value = {"version": 1, "pending": pending, "dataset": self.queue.producer_state(DATASET_PRODUCER)}
        with self._writer_lock:
            ref = self.codec.publish(value, submission_id=f"source:{uuid.uuid4().hex}")
            self.store.retain(owner, [ref])
        return asdict(ref)

    def restore_pending(self, source_ref: Any) -> bool:
        """Seed a fresh (forked) queue with a checkpoint's pending prompts; False when this queue already has them."""
        from straw.protocol import RecordSetRef, TaskSpec

        if self._fork_ready:
            return False
        ref = source_ref if isinstance(source_ref, RecordSetRef) else RecordSetRef.from_dict(source_ref)
        value = self.codec.load(ref)
        if value.get("version") != 1:
            raise ValueError(f"Unsupported queue source snapshot version {value.get('version')!r}")
        specs = [TaskSpec(item["task_id"], item["input_ref"], metadata=item["metadata"]) for item in value["pending"]]
        dataset = value.get("dataset")
        self.queue.submit_tasks(
            f"restore:{ref.digest}",
            specs,
            producer_id=DATASET_PRODUCER if dataset else None,
            producer_state=dataset,
        )
        self._activate_fork()
        return True
