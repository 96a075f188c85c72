"""`slime-run runs audit DIR`: prove from durable records alone that the final lineage trained each prompt once.

The audit reads the save directory and the straw pool only (no Ray, no live queue) and follows identities, not
counts, through the records of every branch of the lineage (`run_inspection.lineage`):

* commit markers: every listed file still has its size and sha256; the builder snapshot names a consumer state
  the branch's queue journal saved (that journal transaction is the commit's cutoff: later events belong to an
  abandoned future), and the queue snapshot names the prompt source (dataset cursor, pending prompt tasks);
* each trained step `s`: the collection task `collection:<id>:s` the queue accepted, the batch task
  `batch:<collection commit id>` whose input is the batch plan, and the batch's accepted conversion. The plan's
  digest matches its content, it names that collection (digest and receipt) and the task's input positions, it
  selects exactly the collection's samples in order, each once; every group of the collection is a prompt task
  the queue accepted (same commit position and digest) whose samples carry its group index; the conversion
  names the plan and holds exactly the plan's samples;
* the accepted log at every commit: each accepted position is processed by a batch the lineage trained (its
  plan's input positions and its conversion) or dropped by a recorded disposition, and nothing else is
  processed;
* a fork: the child's queue was seeded from its parent's queue snapshot (same manifest, dataset cursor and
  pending prompt tasks);
* prompt groups `prompt:<g>` for every `g` below the last commit's dataset cursor: trained exactly once, dropped
  with a recorded reason (filter verdict or abort: a non-retryable failure, a cancellation, a disposition), or
  pending at the last commit; and no sample index trained twice.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from slime.data.durable_files import DurableFileError, check_listed_file
from slime.data.queue_prompts import PROMPT_PREFIX
from slime.data.queue_state import QueueState
from slime.data.refs import DiskPayloadRef, RolloutGroupRef
from slime.data.run_inspection import (
    TRAINING_CONSUMER,
    LineageSegment,
    QueueJournal,
    commit_cutoff,
    lineage,
    read_marker,
    read_queue_journal,
    read_snapshot,
    require_save_dir,
)

#: The fields of a batch plan its digest covers (`slime.data.batch_builder.BatchBuilder._identity`).
PLAN_IDENTITY_KEYS = ("version", "raw_digest", "sample_indices", "rollout_ids", "configuration", "parallel")
_READ_ERRORS = (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError)
#: What the report counts (every key is present, zero or not).
COUNTS = (
    "branches in lineage",
    "commits verified",
    "steps verified",
    "prompt groups issued",
    "prompt groups trained once",
    "prompt groups dropped",
    "prompt groups pending at the last commit",
    "samples trained",
    "accepted positions accounted",
    "abandoned batch attempts",
)


@dataclass(frozen=True)
class Violation:
    """One broken guarantee: what is wrong, and the records (files, pool locations) that show it."""

    check: str
    message: str
    records: tuple[str, ...] = ()


@dataclass
class AuditReport:
    """Counts of what was proven, and every violation in the order found (the first one is reported)."""

    save: Path
    lineage: list[str] = field(default_factory=list)
    counts: Counter = field(default_factory=lambda: Counter(dict.fromkeys(COUNTS, 0)))
    dropped: Counter = field(default_factory=Counter)
    violations: list[Violation] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.violations


class _Unreadable(Exception):
    """A record the audit needs cannot be read; carries the violation that says so."""

    def __init__(self, violation: Violation) -> None:
        super().__init__(violation.message)
        self.violation = violation


@dataclass
class _Queue:
    """One branch's queue journal, indexed by task and position."""

    journal: QueueJournal
    pool: Path
    specs: dict[str, tuple[int, dict]] = field(default_factory=dict)
    completed: dict[str, tuple[int, dict]] = field(default_factory=dict)
    positions: dict[int, tuple[int, dict]] = field(default_factory=dict)
    failures: dict[str, list[tuple[int, dict]]] = field(default_factory=dict)
    cancelled: dict[str, int] = field(default_factory=dict)
    states: list[tuple[int, dict]] = field(default_factory=list)
    restores: list[tuple[int, dict]] = field(default_factory=list)

    @classmethod
    def index(cls, journal: QueueJournal, pool: Path) -> _Queue:
        queue = cls(journal, pool)
        for tx, event in journal.events:
            kind = event["type"]
            if kind == "Submitted":
                for spec in event.get("tasks", ()):
                    queue.specs.setdefault(spec["task_id"], (tx, spec))
                if '"restore:' in event.get("request_key", ""):
                    queue.restores.append((tx, event))
            elif kind == "Completed":
                receipt = event["receipt"]
                queue.completed[receipt["task_id"]] = (tx, receipt)
                queue.positions[int(receipt["position"])] = (tx, receipt)
            elif kind == "Failed":
                for task_id in event.get("task_ids", ()):
                    queue.failures.setdefault(task_id, []).append((tx, event))
            elif kind == "Cancelled":
                queue.cancelled.setdefault(event["task_id"], tx)
            elif kind == "ConsumerState" and event.get("consumer_id") == TRAINING_CONSUMER:
                queue.states.append((tx, event["state"]))
        return queue

    def where(self, tx: int, task_id: str) -> str:
        return f"{self.journal.path} (transaction {tx}, task {task_id})"


@dataclass
class _Commit:
    step: int
    marker: Path
    cutoff: int
    processed: set[int]
    source: dict
    source_path: Path
    manifest_digest: str


def _location(pool: Path, ref: Any) -> str:
    """Where a pool record (a RecordSetRef or its dict) lives: its pack file and offset."""
    segment = (asdict(ref) if is_dataclass(ref) else ref)["manifest"]["segment"]
    return f"{pool / segment['path']} (offset {segment['offset']})"


def _load(pool: Path, ref: Any, what: str, *, selection: dict | None = None) -> Any:
    """Decode a pool record (a RecordSetRef or its dict); `_Unreadable` names its pack file when that fails."""
    from straw.errors import QueueError
    from straw.protocol import RecordSetRef

    try:
        manifest = ref if isinstance(ref, RecordSetRef) else RecordSetRef.from_dict(ref)
        return DiskPayloadRef(manifest, str(pool)).load(selection=selection)
    except (QueueError, *_READ_ERRORS) as exc:
        raise _Unreadable(
            Violation(
                "unreadable record", f"{what} cannot be read: {type(exc).__name__}: {exc}", (_location(pool, ref),)
            )
        ) from None


def _samples(value: Any, pool: Path, what: str) -> list:
    """The Samples of a (possibly chunked, referenced) group, in order."""
    from slime.utils.types import Sample

    if isinstance(value, DiskPayloadRef):
        return _samples(_load(pool, value.manifest, what), pool, what)
    if isinstance(value, Sample):
        return [value]
    if isinstance(value, (list, tuple)):
        return [sample for item in value for sample in _samples(item, pool, what)]
    raise _Unreadable(Violation("unexpected record", f"{what} holds a {type(value).__name__}, not Samples"))


class _Auditor:
    def __init__(self, save: Path, keep_samples: bool = False) -> None:
        self.report = AuditReport(save)
        #: With `keep_samples`, the Samples of each trained step's collection, in order (`trained_sample_records`).
        self.samples: dict[int, list] | None = {} if keep_samples else None
        self.trained_groups: dict[str, list[str]] = {}
        self.trained_samples: dict[int, str] = {}
        self.dropped_groups: dict[str, str] = {}
        self.disposition_cache: dict[str, dict[int, str]] = {}
        self.accounted: dict[str, int] = {}
        self.abandoned_positions: dict[tuple[str, int], str] = {}
        self.abandoned_groups: dict[str, str] = {}
        self.final: _Commit | None = None

    def violate(self, check: str, message: str, *records: str) -> None:
        self.report.violations.append(Violation(check, message, tuple(str(record) for record in records)))

    # ------------------------------------------------------------------------------------- commits

    def commit(self, queue: _Queue, directory: Path, step: int) -> _Commit | None:
        marker_path = directory / "rollout" / f"committed_{step}.json"
        try:
            marker = read_marker(directory, step)
            for relative, listed in sorted(marker["files"].items()):
                check_listed_file(directory / relative, listed, what=f"step {step} component {relative}")
            builder = read_snapshot(directory, marker, "builder_state")
            source_state = read_snapshot(directory, marker, "queue_state")
        except DurableFileError as exc:
            self.violate("damaged commit", f"the joint commit of step {step} is damaged: {exc.problem}", exc.path)
            return None
        builder_path = directory / "rollout" / f"builder_state_{step}.json"
        source_path = directory / "rollout" / f"queue_state_{step}.json"
        if source_state.get("queue_id") != queue.journal.queue_id:
            self.violate(
                "foreign snapshot",
                f"the queue snapshot of step {step} belongs to queue {source_state.get('queue_id')!r}, not the "
                f"branch's {queue.journal.queue_id!r}",
                source_path,
            )
            return None
        cutoff = commit_cutoff(queue.journal, builder["consumer"])
        if cutoff is None:
            self.violate(
                "foreign snapshot",
                f"the batch-builder snapshot of step {step} names a training consumer state that the branch's queue "
                "never saved",
                builder_path,
                queue.journal.path,
            )
            return None
        try:
            state = _load(queue.pool, builder["consumer"]["state_ref"], f"training consumer state of step {step}")
            source = _load(Path(source_state["root"]), source_state["manifest"], f"prompt source of step {step}")
        except _Unreadable as exc:
            self.report.violations.append(exc.violation)
            return None
        cursor = int(state["processed_cursor"])
        processed = set(range(cursor)) | {int(p) for p in state["processed_positions"]}
        digest = source_state["manifest"]["digest"]
        self.report.counts["commits verified"] += 1
        return _Commit(step, marker_path, cutoff, processed, source, source_path, digest)

    # ------------------------------------------------------------------------------------- steps

    def step(self, queue: _Queue, name: str, step: int, commit: _Commit) -> set[int]:
        """Verify the batch the lineage trained at `step`; returns the positions it processed."""
        suffix = f":{step}"
        collections = [
            (tx, receipt)
            for task_id, (tx, receipt) in queue.completed.items()
            if task_id.startswith("collection:") and task_id.endswith(suffix) and tx <= commit.cutoff
        ]
        batches = []
        for _, collection in collections:
            found = queue.completed.get(f"batch:{collection['commit_id']}")
            if found is not None and found[0] <= commit.cutoff:
                batches.append((found[0], collection, found[1]))
        if not batches:
            self.violate(
                "untrained step",
                f"step {step} has no trained batch in branch {name}'s queue before the commit of step {commit.step}",
                commit.marker,
                queue.journal.path,
            )
            return set()
        batches.sort(key=lambda item: item[0])
        for _, _, abandoned in batches[:-1]:
            self._abandoned(queue, step, abandoned)
        _, collection, batch = batches[-1]
        try:
            return self._verify_batch(queue, name, step, collection, batch)
        except _Unreadable as exc:
            self.report.violations.append(exc.violation)
            return set()

    def _abandoned(self, queue: _Queue, step: int, batch: dict) -> None:
        """Remember what an earlier batch of `step` (trained by a process stopped before its commit) consumed."""
        task_id = batch["task_id"]
        tx, spec = queue.specs[task_id]
        label = (
            f"an abandoned attempt of step {step} ({queue.where(tx, task_id)}), whose process stopped before "
            "committing it: the lineage's model never trained it"
        )
        positions = [int(p) for p in (spec.get("metadata") or {}).get("source_positions", ())]
        for position in [*positions, int(batch["position"])]:
            self.abandoned_positions[(queue.journal.queue_id, position)] = label
            task = queue.positions.get(position, (None, {}))[1].get("task_id", "")
            if task.startswith(PROMPT_PREFIX):
                self.abandoned_groups[task] = label
        self.report.counts["abandoned batch attempts"] += 1

    def _verify_batch(self, queue: _Queue, name: str, step: int, collection: dict, batch: dict) -> set[int]:
        from straw.protocol import digest

        pool = queue.pool
        batch_task = batch["task_id"]
        spec_tx, spec = queue.specs[batch_task]
        plan_where = f"{_location(pool, spec['input_ref'])}, planned in {queue.where(spec_tx, batch_task)}"
        plan = _load(pool, spec["input_ref"], f"batch plan of step {step}")
        if not isinstance(plan, dict) or any(key not in plan for key in (*PLAN_IDENTITY_KEYS, "digest", "raw")):
            self.violate("batch plan", f"the batch plan of step {step} is not a batch plan", plan_where)
            return set()
        indices = list(plan["sample_indices"])
        if digest({key: plan[key] for key in PLAN_IDENTITY_KEYS}) != plan["digest"]:
            self.violate(
                "batch plan",
                f"the batch plan of step {step} was edited: its digest does not match its content",
                plan_where,
            )
        repeated = [index for index, count in Counter(indices).items() if count > 1]
        if repeated:
            self.violate(
                "sample trained twice",
                f"the batch plan of step {step} selects sample {repeated[0]} {Counter(indices)[repeated[0]]} times",
                plan_where,
            )
        raw_receipt = getattr(plan["raw"], "receipt", None)
        if (
            plan["raw_digest"] != collection["digest"]
            or getattr(raw_receipt, "commit_id", None) != collection["commit_id"]
        ):
            self.violate(
                "batch plan",
                f"the batch plan of step {step} names another rollout than the collection {collection['task_id']} "
                "its batch task was made for",
                plan_where,
            )
        declared = sorted(int(p) for p in (spec.get("metadata") or {}).get("source_positions", ()))
        if sorted(int(p) for p in plan.get("input_positions", ())) != declared:
            self.violate(
                "batch plan",
                f"the batch plan of step {step} lists input positions {plan.get('input_positions')} but its batch "
                f"task declared {declared}",
                plan_where,
            )
        groups = self._collection_groups(queue, step, collection)
        collected = [index for _, _, samples in groups for index in samples]
        if collected != indices:
            missing = sorted(set(collected) - set(indices))[:5]
            extra = sorted(set(indices) - set(collected))[:5]
            self.violate(
                "batch plan",
                f"the batch plan of step {step} selects other samples than its collection holds (not selected: "
                f"{missing or 'none'}; not collected: {extra or 'none'}; or another order)",
                plan_where,
                _location(pool, collection["result_ref"]),
            )
        conversion = _load(
            pool,
            batch["result_ref"],
            f"converted batch of step {step}",
            selection={"sample_indices": None, "rollout_ids": None, "_plan": None},
        )
        conversion_where = _location(pool, batch["result_ref"])
        planned = getattr(conversion.get("_plan"), "manifest", None)
        if planned is None or planned.digest != spec["input_ref"]["digest"]:
            self.violate("converted batch", f"the converted batch of step {step} names another plan", conversion_where)
        trained = [int(index) for index in conversion["sample_indices"]]
        if trained != indices:
            self.violate(
                "converted batch",
                f"the converted batch of step {step} holds other samples than its plan recorded",
                conversion_where,
                plan_where,
            )
        rollout_ids = list(conversion["rollout_ids"])
        expected_ids = [step if planned_id is None else planned_id for planned_id in plan["rollout_ids"]]
        if rollout_ids != expected_ids:
            self.violate(
                "converted batch",
                f"the converted batch of step {step} trains samples of other rollout steps",
                conversion_where,
            )
        label = f"step {step} (branch {name}, {conversion_where})"
        for index in trained:
            if index in self.trained_samples:
                self.violate(
                    "sample trained twice",
                    f"sample {index} was trained at {self.trained_samples[index]} and again at {label}",
                    conversion_where,
                )
            else:
                self.trained_samples[index] = label
        for task_id, _, _ in groups:
            self.trained_groups.setdefault(task_id, []).append(label)
        self.report.counts["steps verified"] += 1
        self.report.counts["samples trained"] = len(self.trained_samples)
        positions = {int(p) for p in plan.get("input_positions", ())} | {int(batch["position"])}
        positions |= {int(collection["position"])} | {position for _, position, _ in groups}
        return positions

    def _collection_groups(self, queue: _Queue, step: int, collection: dict) -> list[tuple[str, int, list[int]]]:
        """`(task id, accepted position, sample indices)` of each group of a step's collection."""
        pool = queue.pool
        where = _location(pool, collection["result_ref"])
        value = _load(pool, collection["result_ref"], f"collection of step {step}")
        while not isinstance(value, list) and hasattr(value, "manifest"):
            value = _load(pool, value.manifest, f"collection of step {step}")
        groups = []
        for element in value if isinstance(value, list) else []:
            receipt = getattr(element, "receipt", None) if isinstance(element, RolloutGroupRef) else None
            samples = _samples(element, pool, f"a group of the collection of step {step}")
            task_id = (
                receipt.task_id if receipt is not None else (QueueState.of(samples[0]).task_id if samples else None)
            )
            accepted = queue.completed.get(task_id or "")
            if accepted is None or not task_id.startswith(PROMPT_PREFIX):
                self.violate(
                    "unaccepted group",
                    f"the collection of step {step} holds group {task_id!r}, which its queue never accepted",
                    where,
                    queue.journal.path,
                )
                continue
            tx, accepted_receipt = accepted
            if receipt is not None and (
                receipt.position != accepted_receipt["position"] or receipt.digest != accepted_receipt["digest"]
            ):
                self.violate(
                    "unaccepted group",
                    f"the collection of step {step} holds a version of {task_id} that its queue did not accept",
                    where,
                    queue.where(tx, task_id),
                )
            group_index = int(task_id[len(PROMPT_PREFIX) :])
            strays = [sample.index for sample in samples if sample.group_index != group_index]
            if strays:
                self.violate(
                    "foreign sample",
                    f"group {task_id} of step {step} holds sample {strays[0]} of another prompt group",
                    where,
                )
            groups.append((task_id, int(accepted_receipt["position"]), [int(sample.index) for sample in samples]))
            if self.samples is not None:
                self.samples.setdefault(step, []).extend(samples)
        return groups

    # ------------------------------------------------------------------------------------- segments

    def segment(self, segment: LineageSegment, name: str, parent: _Commit | None) -> _Commit | None:
        """Audit one branch of the lineage; returns its last commit (where the next branch forked)."""
        record = segment.record
        if record is None:
            self.violate("branch record", f"branch {name} has no branch record", segment.directory / "rollout")
            return None
        pool = Path(record.get("pool") or segment.directory / "rollout_data")
        try:
            queue = _Queue.index(
                read_queue_journal(pool, record["queue_id"], named_in=segment.directory / "rollout" / "branch.json"),
                pool,
            )
        except DurableFileError as exc:
            self.violate("queue journal", exc.problem, exc.path)
            return None
        if parent is not None:
            self._check_fork(queue, name, parent, segment)
        commits = [commit for step in segment.commits if (commit := self.commit(queue, segment.directory, step))]
        if segment.last_step >= segment.first_step and segment.last_step not in segment.commits:
            self.violate(
                "missing commit",
                f"the lineage continues from step {segment.last_step} of branch {name}, which has no commit marker",
                segment.directory / "rollout" / f"committed_{segment.last_step}.json",
            )
        trained: set[int] = set()
        by_step = {commit.step: commit for commit in commits}
        for step in range(segment.first_step, segment.last_step + 1):
            commit = next((by_step[s] for s in sorted(by_step) if s >= step), None)
            if commit is None:
                continue
            trained |= self.step(queue, name, step, commit)
            if step == commit.step:
                self._account(queue, name, commit, trained)
        if commits:
            self._drops(queue, commits[-1].cutoff)
        return commits[-1] if commits and commits[-1].step == segment.last_step else None

    def _check_fork(self, queue: _Queue, name: str, parent: _Commit, segment: LineageSegment) -> None:
        restore = next((event for _, event in queue.restores), None)
        expected = sorted(item["task_id"] for item in parent.source.get("pending", ()))
        record = segment.directory / "rollout" / "branch.json"
        if restore is None or parent.manifest_digest not in restore.get("request_key", ""):
            self.violate(
                "fork",
                f"branch {name}'s queue was not seeded from its parent's queue snapshot of step {parent.step}",
                parent.source_path,
                queue.journal.path,
                record,
            )
            return
        if restore.get("producer_state") != parent.source.get("dataset") or (
            sorted(task["task_id"] for task in restore.get("tasks", ())) != expected
        ):
            self.violate(
                "fork",
                f"branch {name}'s queue restored another dataset cursor or other pending prompts than its parent's "
                f"snapshot of step {parent.step}",
                parent.source_path,
                queue.journal.path,
            )

    def _account(self, queue: _Queue, name: str, commit: _Commit, trained: set[int]) -> None:
        """At a commit, every accepted position is trained or disposed, and nothing else is processed."""
        accepted = {position for position, (tx, _) in queue.positions.items() if tx <= commit.cutoff}
        disposed = self._dispositions(queue, commit.cutoff)
        for position in sorted(accepted | commit.processed):
            task = queue.positions.get(position, (None, {}))[1].get("task_id", "?")
            if position in trained and position not in commit.processed:
                problem = "was trained by the lineage but is not marked processed"
            elif position in commit.processed and position not in trained | set(disposed):
                problem = "is marked processed, but no batch of the lineage trained it and no disposition dropped it"
                abandoned = self.abandoned_positions.get((queue.journal.queue_id, position))
                if abandoned:
                    problem = f"is marked processed, but was trained only by {abandoned}"
            elif position in accepted and position not in commit.processed:
                problem = "was accepted but neither trained nor dropped: a restore from this commit loses it"
            else:
                continue
            self.violate(
                "accepted log",
                f"at the commit of step {commit.step} (branch {name}), queue position {position} ({task}) {problem}",
                commit.marker,
                queue.journal.path,
            )
            return
        self.accounted[queue.journal.queue_id] = len(accepted)
        self.report.counts["accepted positions accounted"] = sum(self.accounted.values())

    def _dispositions(self, queue: _Queue, cutoff: int) -> dict[int, str]:
        """Positions dropped on purpose (`{position: reason}`) by the consumer states saved up to `cutoff`."""
        found: dict[int, str] = {}
        for tx, state in queue.states:
            if tx <= cutoff:
                found.update(self._disposition(queue, state["state_ref"]))
        return found

    def _disposition(self, queue: _Queue, state_ref: dict) -> dict[int, str]:
        """The disposition one saved training consumer state carries (cached: states repeat across commits)."""
        key = state_ref["digest"]
        if key not in self.disposition_cache:
            found: dict[int, str] = {}
            try:
                value = _load(queue.pool, state_ref, "a training consumer state")
                disposition = value.get("disposition") if isinstance(value, dict) else None
                if disposition is not None:
                    dropped = _load(queue.pool, getattr(disposition, "manifest", disposition), "a disposition")
                    found = {int(p): str(dropped["reason"]) for p in dropped["positions"]}
            except _Unreadable as exc:
                self.report.violations.append(exc.violation)
            self.disposition_cache[key] = found
        return self.disposition_cache[key]

    def _drops(self, queue: _Queue, cutoff: int) -> None:
        """Record prompt groups the branch dropped with a reason before its last commit."""
        for task_id, failures in queue.failures.items():
            spec = queue.specs.get(task_id, (0, {}))[1]
            final = [event for tx, event in failures if tx <= cutoff]
            attempts = int(spec.get("max_attempts", 1))
            if final and (not final[-1].get("retryable", True) or len(final) >= attempts):
                failure = final[-1].get("failure") or {}
                self.dropped_groups[task_id] = f"{failure.get('category', 'failed')}: {failure.get('message', '')}"
        for task_id, tx in queue.cancelled.items():
            if tx <= cutoff:
                self.dropped_groups[task_id] = "cancelled"
        for position, reason in self._dispositions(queue, cutoff).items():
            task_id = queue.positions.get(position, (None, {}))[1].get("task_id")
            if task_id:
                self.dropped_groups[task_id] = reason

    # ------------------------------------------------------------------------------------- groups

    def groups(self) -> None:
        """Every prompt group below the last commit's dataset cursor: trained once, dropped, or still pending."""
        final = self.final
        if final is None:
            return
        cursor = ((final.source.get("dataset") or {}).get("cursor") or {}).get("sample_group_index")
        if cursor is None:
            self.violate("prompt source", "the last commit's prompt source has no dataset cursor", final.source_path)
            return
        pending = {item["task_id"] for item in final.source.get("pending", ())}
        counts = self.report.counts
        counts["prompt groups issued"] = int(cursor)
        for group in range(int(cursor)):
            task_id = f"{PROMPT_PREFIX}{group}"
            trained = self.trained_groups.get(task_id, [])
            if len(trained) > 1:
                self.violate(
                    "group trained twice", f"prompt group {group} was trained at {trained[0]} and {trained[1]}"
                )
            elif trained and task_id in pending:
                self.violate(
                    "group trained twice",
                    f"prompt group {group} was trained at {trained[0]} and is still pending at the last commit",
                    final.source_path,
                )
            elif trained:
                counts["prompt groups trained once"] += 1
            elif task_id in self.dropped_groups:
                counts["prompt groups dropped"] += 1
                self.report.dropped[self.dropped_groups[task_id]] += 1
            elif task_id in pending:
                counts["prompt groups pending at the last commit"] += 1
            else:
                abandoned = self.abandoned_groups.get(task_id)
                why = f"; it was trained only by {abandoned}" if abandoned else ""
                self.violate(
                    "lost group",
                    f"prompt group {group} was issued (dataset cursor {cursor} at step {final.step}) but was neither "
                    f"trained, dropped with a reason, nor pending at the last commit{why}",
                    final.source_path,
                )
        beyond = sorted(int(task[len(PROMPT_PREFIX) :]) for task in self.trained_groups)
        if beyond and beyond[-1] >= int(cursor):
            self.violate(
                "prompt source", f"prompt group {beyond[-1]} was trained but lies beyond the dataset cursor {cursor}"
            )


def audit_run(save: Path) -> AuditReport:
    """Audit the final lineage of the save directory `save` (see the module docstring)."""
    return _audit(save).report


def trained_sample_records(save: Path) -> tuple[dict[int, list], AuditReport]:
    """`({step: the Samples it trained, in order}, the audit)` of the final lineage of `save`.

    The Samples come from the records the audit follows (each step's collection, which a clean audit proves is
    exactly what the step's plan selected and its converted batch trained); a step the audit could not follow
    is missing, and the report's violations say why. For `slime-run runs compare`.
    """
    auditor = _audit(save, keep_samples=True)
    return dict(sorted((auditor.samples or {}).items())), auditor.report


def _audit(save: Path, keep_samples: bool = False) -> _Auditor:
    save = Path(save).resolve()
    require_save_dir(save)
    auditor = _Auditor(save, keep_samples)
    try:
        segments = lineage(save)
    except DurableFileError as exc:
        auditor.violate("lineage", f"the lineage cannot be read: {exc.problem}", exc.path)
        return auditor
    parent = None
    for segment in segments:
        name = "(root)" if segment.directory == save else segment.directory.name
        steps = segment.last_step - segment.first_step + 1
        auditor.report.lineage.append(
            f"{name}: steps {segment.first_step}..{segment.last_step}" if steps > 0 else f"{name}: no steps"
        )
        if steps <= 0 and parent is not None:
            continue
        last = auditor.segment(segment, name, parent)
        parent = last or parent
        auditor.final = parent
    auditor.report.counts["branches in lineage"] = len(segments)
    auditor.groups()
    return auditor
