"""Queue-backed data sources: `QueueReader` (one per generating process) and `QueueDataSource` (the manager's).

A reader leases prompt tasks from the controller, loads their input groups straight from storage and stamps
every Sample with its queue context (`slime.data.queue_state`: lease, generation start, branch, source
positions), so finished groups can be accepted as the task's result. A heartbeat thread
renews held leases every `lease_seconds / 3`. `QueueDataSource` additionally owns the source checkpoint
(`queue_state_<id>.json`) and, when it made it, the controller.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray

from slime.data import queue_state
from slime.data.checkpoint import RestorePlan, SourceRestore
from slime.data.data_source import DataSource
from slime.data.straw_settings import StrawSettings
from slime.data.transport import group_lease, pack_rollout_payload, rollout_store
from slime.rollout.base_types import iter_samples
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

READER_STATE_VERSION = 3
SOURCE_STATE_VERSION = 1
PRIORITY_READY, PRIORITY_PARTIAL = 2, 1
_FINISHED = {Sample.Status.COMPLETED, Sample.Status.TRUNCATED}


def _facade() -> Any:
    import slime.data.queue_data_source as facade

    return facade


@dataclass(frozen=True)
class QueueReaderConfig:
    """What a remote generation process needs to build its own `QueueReader` (picklable)."""

    controller: Any
    dataset_size: int
    branch_id: str | None = None

    def open_reader(self, args: Any, reader_id: str) -> QueueReader:
        """This process's own reader of the queue, identified by `reader_id`."""
        return QueueReader(args, self.controller, reader_id, self.dataset_size, branch_id=self.branch_id)


def _oldest_weight_version(group: list) -> int:
    versions = [int(v) for sample in iter_samples(group) for v in sample.weight_versions if str(v).isdigit()]
    return min(versions) if versions else 0


class QueueReader(DataSource):
    """Per-process client of the queue's prompt tasks (see the module docstring)."""

    def __init__(
        self, args: Any, controller: Any, reader_id: str, dataset_size: int, *, branch_id: str | None = None
    ) -> None:
        settings = StrawSettings.from_args(args)
        self.args = args
        self.controller = controller
        self.reader_id = reader_id
        self.dataset_size = dataset_size
        self.branch_id = branch_id
        self.timeout = settings.take_timeout_s
        self._held: dict[str, Any] = {}
        self._held_lock = threading.Lock()
        self._stop = threading.Event()
        interval = settings.lease_seconds / 3
        self._heartbeat_error: BaseException | None = None
        self._heartbeat = threading.Thread(target=self._renew, args=(interval,), name="queue-heartbeat", daemon=True)
        self._heartbeat.start()

    def _renew(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with self._held_lock:
                leases = list(self._held.values())
            if not leases:
                continue
            try:
                live = {lease.attempt_id for lease in ray.get(self.controller.live_leases.remote(leases))}
            except BaseException as exc:  # noqa: BLE001 - re-raised by the next get_samples
                logger.exception("Queue lease heartbeat failed for reader %s", self.reader_id)
                self._heartbeat_error = exc
                return
            with self._held_lock:
                for lease in leases:
                    if lease.attempt_id not in live:
                        self._held.pop(lease.attempt_id, None)

    def _stamp(self, group: Any, entry: dict) -> Any:
        lease = asdict(entry["lease"])
        for sample in iter_samples(group):
            queue_state.stamp(
                sample,
                lease=lease,
                generation_start=len(sample.tokens),
                branch=self.branch_id,
                source_positions=list(entry["source_positions"]),
            )
            queue_state.remove(sample, "receipt")
        return group

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """Lease `num_samples` prompt groups; waits up to `--rollout-queue-take-timeout` seconds for them."""
        _, codec, _ = rollout_store(self.args)
        groups: list = []
        deadline = time.monotonic() + self.timeout
        with codec.store.read_session() as session:
            while len(groups) < num_samples:
                if self._heartbeat_error is not None:
                    raise RuntimeError("Queue lease heartbeat failed; leases may be lost") from self._heartbeat_error
                entries = ray.get(self.controller.take.remote(self.reader_id, num_samples - len(groups)))
                for entry in entries:
                    group = codec.load(entry["input_ref"], reader=session)
                    with self._held_lock:
                        self._held[entry["lease"].attempt_id] = entry["lease"]
                    groups.append(self._stamp(group, entry))
                if not entries:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"No prompt tasks became available for reader {self.reader_id} within {self.timeout}s "
                            "(is --prompt-data set and the dataset non-empty?)"
                        )
                    time.sleep(0.1)
        return groups

    async def get_samples_async(self, num_samples: int) -> list[list[Sample]]:
        return await asyncio.to_thread(self.get_samples, num_samples)

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Persist handed-back groups as their tasks' new inputs (ready groups first, then partial ones)."""
        updates = []
        for group in samples:
            lease = group_lease(group)
            if lease is None:
                raise ValueError("add_samples takes groups leased from this queue (they carry its lease)")
            ready = all(sample.status in _FINISHED for sample in iter_samples(group))
            ref = pack_rollout_payload(group, self.args, None, submission_id=f"handback:{lease.attempt_id}")
            updates.append(
                {
                    "lease": lease,
                    "input_ref": ref.manifest,
                    "priority": PRIORITY_READY if ready else PRIORITY_PARTIAL,
                    "scheduling_key": _oldest_weight_version(group),
                }
            )
        ray.get(self.controller.return_groups.remote(updates))
        with self._held_lock:
            for update in updates:
                self._held.pop(update["lease"].attempt_id, None)

    def state_dict(self) -> dict:
        return {"version": READER_STATE_VERSION, "reader_id": self.reader_id, "branch_id": self.branch_id}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != READER_STATE_VERSION:
            raise ValueError(f"Unsupported queue reader state version {state.get('version')!r}")
        self.branch_id = state.get("branch_id")

    def save(self, rollout_id: int) -> None:
        """Readers hold no checkpoint state of their own (the queue is the source of truth)."""

    def load(self, rollout_id: int | None = None) -> None:
        """See `save`."""

    def close(self) -> None:
        """Stop renewing and give every still-held lease back to the queue."""
        self._stop.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join()
        with self._held_lock:
            leases, self._held = list(self._held.values()), {}
        if leases:
            ray.get(self.controller.release.remote(leases))


class QueueDataSource(QueueReader):
    """The manager's queue source: a reader that also owns the source checkpoint (and maybe the controller)."""

    def __init__(
        self,
        args: Any,
        *,
        controller: Any = None,
        restore_plan: RestorePlan | None = None,
        reader_generation: str = "",
    ) -> None:
        self._owns_controller = controller is None
        if controller is None:
            controller = _facade().create_queue_controller(args, restore_plan=restore_plan)
        self.restore_plan = restore_plan or RestorePlan()
        dataset_size = ray.get(controller.dataset_size.remote())
        reader_id = f"manager:{reader_generation}" if reader_generation else "manager:reader"
        super().__init__(args, controller, reader_id, dataset_size, branch_id=self.restore_plan.queue_id)

    @property
    def reader_config(self) -> QueueReaderConfig:
        return QueueReaderConfig(self.controller, self.dataset_size, self.branch_id)

    def _state_path(self, directory: str, rollout_id: int) -> Path:
        return Path(directory) / "rollout" / f"queue_state_{rollout_id}.json"

    def save(self, rollout_id: int) -> None:
        """Write `queue_state_<id>.json` naming a retained snapshot of the pending prompts and cursor."""
        save = getattr(self.args, "save", None)
        if not save:
            return
        from straw.protocol import digest

        path = self._state_path(save, rollout_id).resolve()
        owner = f"checkpoint:{path}:{digest([self.reader_id, rollout_id])}"
        manifest = ray.get(self.controller.pending_snapshot.remote(owner))
        identity = ray.get(self.controller.identity.remote())
        _facade().write_report(
            path,
            {
                "version": SOURCE_STATE_VERSION,
                "root": identity["root"],
                "manifest": manifest,
                "storage_owner": owner,
                "queue_id": identity["queue_id"],
            },
        )

    def load(self, rollout_id: int | None = None) -> SourceRestore | None:
        """Restore from `queue_state_<id>.json`: a fork seeds its fresh queue with the snapshot's prompts."""
        load = getattr(self.args, "load", None)
        if not load or rollout_id is None:
            return None
        path = self._state_path(load, rollout_id)
        if not path.exists():
            return None
        saved = json.loads(path.read_text())
        if saved.get("version") != SOURCE_STATE_VERSION:
            raise ValueError(f"Unsupported queue source checkpoint {path} (version {saved.get('version')!r})")
        from straw.protocol import RecordSetRef

        source_ref = RecordSetRef.from_dict(saved["manifest"])
        new_queue = ray.get(self.controller.restore_pending.remote(source_ref))
        return SourceRestore(new_queue=new_queue, source_ref=source_ref)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._owns_controller:
                ray.get(self.controller.close.remote())
