"""Read-only inspection of a save directory: branches, joint commits, the lineage, a rerun's choice, the pool.

`inspect_run(save)` reads what runs left under `--save` (branch records, `current.json`, the tracker, commit
markers and the files they list) and in the straw pool (each queue's journal, read through straw's read-only
`Journal`, and pack files), and never writes. `lineage(save)` is the chain of branches the current branch's
model descends from, each with the steps it trained; `slime.data.lineage_audit` audits exactly that chain.
What a rerun of the same command would do comes from `resolve_checkpoint` itself, given the command's
recorded flags, so this report and the next run cannot disagree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from slime.data.checkpoint import (
    CRITIC_DIR,
    MARKER_VERSION,
    TRACKER,
    _is_checkpoint_dir,
    committed_steps,
    resolve_checkpoint,
)
from slime.data.durable_files import DurableFileError, check_listed_file, load_json_record

#: The batch builder's consumer of the queue (`slime.data.queue_controller.TRAINING_CONSUMER`; that module
#: imports Ray, which these read-only commands do without).
TRAINING_CONSUMER = "training"
BRANCH_VERSION = 1
ROOT_NAME = "(root)"
_BRANCH_KEYS = ("parent", "queue_id")
_MARKER_KEYS = ("rollout_id", "files", "resumable")
_BRANCH_REMEDY = "restore it, or start a new run with a new --save"


# ------------------------------------------------------------------------------------------- queue journals


@dataclass(frozen=True)
class QueueJournal:
    """A queue's durable history: every journal event as `(transaction index, event)`, oldest first."""

    queue_id: str
    directory: Path
    run_id: str
    events: tuple[tuple[int, dict], ...]
    incomplete_tail_bytes: int

    @property
    def path(self) -> Path:
        return self.directory / "control" / "journal.log"


def queue_directory(pool: Path, queue_id: str) -> Path:
    """Where straw keeps the namespaced queue `queue_id` of the pool at `pool`."""
    from straw.protocol import digest

    return pool / "queues" / digest(queue_id)


def read_queue_journal(pool: Path, queue_id: str, *, named_in: Path) -> QueueJournal:
    """Read queue `queue_id`'s journal without a coordinator (straw's read-only `Journal`).

    `named_in` is the record that named the queue (for the error when the pool does not hold it).
    """
    from straw.backend import FilesystemBackend
    from straw.errors import QueueError
    from straw.journal import Journal
    from straw.protocol import decode

    directory = queue_directory(pool, queue_id)
    identity_path = directory / "run.json"
    if not identity_path.is_file():
        raise DurableFileError(
            identity_path,
            f"the straw pool {pool} holds no queue {queue_id!r}, which {named_in} names (the pool belongs to "
            "another run, or the queue was deleted)",
            "point the branch record at the run's own pool, or start a new run with a new --save",
        )
    backend = FilesystemBackend(directory)
    try:
        identity = decode(backend.open_committed("run.json").read())
        journal = Journal(backend, identity, recover=True, read_only=True)
    except (QueueError, OSError, ValueError) as exc:
        raise DurableFileError(
            directory / "control" / "journal.log", f"the queue journal cannot be read ({exc})"
        ) from None
    try:
        events = tuple(
            (index, event) for index, transaction in enumerate(journal.transactions) for event in transaction
        )
        tail = journal.incomplete_tail_bytes
    finally:
        journal.close()
    if identity.get("queue_id") != queue_id:
        raise DurableFileError(identity_path, f"names queue {identity.get('queue_id')!r}, not {queue_id!r}")
    return QueueJournal(queue_id, directory, identity["run_id"], events, tail)


def commit_cutoff(journal: QueueJournal, consumer: dict) -> int | None:
    """The journal transaction that saved the training consumer state a builder snapshot recorded, or None.

    A commit's builder snapshot names the consumer state the queue saved last before it; events after that
    transaction happened after the commit (the next step, or work a stopped run abandoned).
    """
    wanted = (consumer.get("state_ref") or {}).get("digest")
    for index, event in journal.events:
        if event["type"] != "ConsumerState" or event.get("consumer_id") != TRAINING_CONSUMER:
            continue
        if ((event.get("state") or {}).get("state_ref") or {}).get("digest") == wanted:
            return index
    return None


# ------------------------------------------------------------------------------------------- records


def read_marker(directory: Path, step: int) -> dict:
    """The commit marker of `step` in a branch directory (format checked, files not)."""
    path = directory / "rollout" / f"committed_{step}.json"
    marker = load_json_record(path, what="commit marker", required_keys=_MARKER_KEYS, version=MARKER_VERSION)
    if marker["rollout_id"] != step:
        raise DurableFileError(path, f"commit marker names step {marker['rollout_id']!r}, not {step}")
    return marker


def read_snapshot(directory: Path, marker: dict, name: str) -> dict:
    """`rollout/<name>_<step>.json` of a commit, checked against the size and sha256 its marker listed."""
    step = marker["rollout_id"]
    relative = f"rollout/{name}_{step}.json"
    listed = marker["files"].get(relative)
    path = directory / relative
    if listed is None:
        raise DurableFileError(
            directory / "rollout" / f"committed_{step}.json", f"commit marker does not list {relative}"
        )
    what = "queue snapshot" if name == "queue_state" else "batch-builder snapshot"
    keys = ("manifest", "root") if name == "queue_state" else ("consumer", "run_id")
    return load_json_record(path, what=what, required_keys=keys, version=1, listed=listed)


def read_branch_record(directory: Path) -> dict | None:
    """`rollout/branch.json` of a branch directory, or None when the directory has none."""
    path = directory / "rollout" / "branch.json"
    if not path.exists():
        return None
    return load_json_record(
        path, what="branch record", required_keys=_BRANCH_KEYS, version=BRANCH_VERSION, remedy=_BRANCH_REMEDY
    )


def read_current(save: Path) -> dict | None:
    """The logical save dir's pointer to its active branch (`rollout/current.json`), or None."""
    path = save / "rollout" / "current.json"
    if not path.exists():
        return None
    return load_json_record(path, what="current-branch pointer", required_keys=("directory",), remedy=_BRANCH_REMEDY)


def require_save_dir(save: Path) -> None:
    """Raise `DurableFileError` unless `save` is a `--save` directory of a checkpoint-managed run."""
    if not save.is_dir():
        raise DurableFileError(save, "no such directory", "pass the --save directory of a slime-run run")
    if not _is_checkpoint_dir(save) and not (save / "branches").is_dir():
        raise DurableFileError(
            save,
            "is not a slime-run save directory (it has no rollout/current.json, rollout/branch.json or "
            "rollout/committed_<step>.json)",
            "pass the --save directory of a run that used the straw transport",
        )


# ------------------------------------------------------------------------------------------- lineage


@dataclass(frozen=True)
class LineageSegment:
    """One branch of the lineage: it trained steps `first_step..last_step` (none when last < first)."""

    directory: Path
    record: dict | None
    first_step: int
    last_step: int
    commits: tuple[int, ...]


def lineage(save: Path) -> list[LineageSegment]:
    """The branches the current branch's model descends from, oldest first, each with the steps it trained.

    Walks `current.json`'s branch up its parents like checkpoint selection does: a parent contributes only the
    steps up to its child's branch point (its later commits are an abandoned future).
    """
    current = read_current(save)
    directory = Path(current["directory"]).resolve() if current else save
    chain: list[tuple[Path, dict | None]] = []
    seen: set[Path] = set()
    while directory not in seen:
        seen.add(directory)
        if not directory.is_dir():
            named = save / "rollout" / "current.json" if not chain else chain[-1][0] / "rollout" / "branch.json"
            raise DurableFileError(named, f"names branch directory {directory}, which does not exist", _BRANCH_REMEDY)
        record = read_branch_record(directory)
        chain.append((directory, record))
        parent = (record or {}).get("parent")
        if not parent:
            break
        directory = Path(parent["directory"]).resolve()
    chain.reverse()
    segments = []
    for position, (directory, record) in enumerate(chain):
        parent = (record or {}).get("parent")
        first = int(parent["step"]) + 1 if parent else 0
        if position + 1 < len(chain):
            last = int(chain[position + 1][1]["parent"]["step"])
        else:
            own = committed_steps(directory)
            last = own[-1] if own else first - 1
        commits = tuple(step for step in committed_steps(directory) if first <= step <= last)
        segments.append(LineageSegment(directory, record, first, last, commits))
    return segments


# ------------------------------------------------------------------------------------------- report


@dataclass
class CommitInfo:
    """One joint commit: its components' file counts and bytes, and whether every listed file is intact."""

    step: int
    marker: Path
    resumable: bool
    components: dict[str, list[int]]
    total_bytes: int
    problem: str | None = None
    pool: str | None = None

    @property
    def complete(self) -> bool:
        return self.problem is None


@dataclass
class BranchInfo:
    """One physical save dir (the root or `branches/<uuid hex>`) and what made it."""

    directory: Path
    name: str
    created: str | None
    parent: dict | None
    reason: str
    queue_id: str | None
    pool: str | None
    commits: list[CommitInfo] = field(default_factory=list)
    uncommitted: list[int] = field(default_factory=list)
    sessions: int | None = None
    current: bool = False
    lineage_steps: list[int] | None = None
    #: The queue an interrupted attempt of this branch trained on before its first commit; the rerun started over
    #: on `queue_id` and left it to garbage collection (`RolloutQueueController._start_over`).
    abandoned_queue: str | None = None


@dataclass
class RerunInfo:
    """What `resolve_checkpoint` selects for a rerun of the same command: `action` and why."""

    action: str
    detail: str
    step: int | None = None
    branch: str | None = None


@dataclass
class PoolInfo:
    """A straw pool: its size, its queues and what garbage collection could reclaim."""

    path: Path
    total_bytes: int = 0
    packs: int = 0
    queues: list[dict] = field(default_factory=list)
    unreferenced_bytes: int = 0
    unreferenced: list[str] = field(default_factory=list)
    outside_lineage_bytes: int = 0


@dataclass
class RunInspection:
    """What `slime-run runs DIR` reports."""

    save: Path
    current: Path | None
    tracker: str | None
    branches: list[BranchInfo]
    lineage: list[str]
    rerun: RerunInfo
    pools: list[PoolInfo]
    problems: list[str]


def _name(save: Path, directory: Path) -> str:
    return ROOT_NAME if directory == save else directory.name


def _commit_info(directory: Path, step: int) -> CommitInfo:
    marker_path = directory / "rollout" / f"committed_{step}.json"
    try:
        marker = read_marker(directory, step)
    except DurableFileError as exc:
        return CommitInfo(step, marker_path, False, {}, 0, str(exc))
    components: dict[str, list[int]] = {}
    problem = None
    for relative, listed in sorted(marker["files"].items()):
        parts = relative.split("/")
        kind = parts[0] if parts[0] != "rollout" else parts[1].rsplit("_", 1)[0]
        kind = "critic" if kind == CRITIC_DIR else ("model" if kind.startswith("iter_") else kind)
        entry = components.setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += int(listed.get("size", 0))
        if problem is None:
            try:
                check_listed_file(directory / relative, listed, what=f"step {step} component {relative}")
            except DurableFileError as exc:
                problem = str(exc)
    total = sum(size for _, size in components.values())
    resumable = bool(marker["resumable"])
    return CommitInfo(step, marker_path, resumable, components, total, problem, marker.get("rollout_data_dir"))


def _uncommitted_steps(directory: Path, commits: list[int]) -> list[int]:
    """Steps with a model or rollout snapshot but no commit marker: saves that never finished."""
    steps = set()
    for path in directory.glob("iter_*"):
        if path.name[5:].isdigit():
            steps.add(int(path.name[5:]))
    for path in (directory / "rollout").glob("*_state_*.json"):
        if path.stem.rsplit("_", 1)[1].isdigit():
            steps.add(int(path.stem.rsplit("_", 1)[1]))
    return sorted(steps - set(commits))


def _abandoned_work(directory: Path, step: int, pool: Path, queue_id: str) -> str:
    """What the branch's queue did after the commit of `step` (work a stopped run left behind), in words."""
    try:
        consumer = read_snapshot(directory, read_marker(directory, step), "builder_state")["consumer"]
        journal = read_queue_journal(pool, queue_id, named_in=directory / "rollout" / "branch.json")
    except DurableFileError:
        return ""
    cutoff = commit_cutoff(journal, consumer)
    if cutoff is None:
        return ""
    leased = sum(len(e.get("leases", ())) for i, e in journal.events if i > cutoff and e["type"] == "Leased")
    accepted = sum(1 for i, e in journal.events if i > cutoff and e["type"] == "Completed")
    if not leased and not accepted:
        return f"; the previous run did nothing after committing step {step} (it finished or was stopped there)"
    return (
        f"; the previous run was stopped during step {step + 1}: {leased} task leases and {accepted} accepted "
        f"results after the commit of step {step} were abandoned"
    )


def _branch_reason(save: Path, record: dict | None) -> str:
    if record is None:
        return "no branch record"
    parent, load = record.get("parent"), record.get("initial_load")
    if not parent:
        return "new run" + (f" (--load {load})" if load else "")
    parent_dir, step = Path(parent["directory"]).resolve(), int(parent["step"])
    if not parent["queue_snapshot"]:
        return f"model-only restore of step {step} from {parent_dir} (no joint commit there: new empty queue)"
    inside = parent_dir == save or parent_dir.parent == save / "branches"
    if not inside:
        return f"fork from --load {parent_dir} step {step}"
    where = _name(save, parent_dir)
    newest = committed_steps(parent_dir)
    older = f" (an older commit than its newest, step {newest[-1]}: --ckpt-step or an edited tracker)"
    why = older if newest and newest[-1] > step else ""
    if load:
        return f"--load {load}: restored step {step} of {where}{why}"
    pool = record.get("pool")
    evidence = ""
    if pool and not why:
        evidence = _abandoned_work(parent_dir, step, Path(pool), _parent_queue(parent_dir))
    return f"rerun of the same command: resumed step {step} of {where}{why}{evidence}"


def _parent_queue(directory: Path) -> str:
    try:
        return (read_branch_record(directory) or {}).get("queue_id", "")
    except DurableFileError:
        return ""


def _branch_info(save: Path, directory: Path, problems: list[str]) -> BranchInfo:
    try:
        record = read_branch_record(directory)
    except DurableFileError as exc:
        problems.append(str(exc))
        record = None
    if record is None and (directory != save or committed_steps(directory)):
        problems.append(f"{directory / 'rollout' / 'branch.json'}: branch record is missing; {_BRANCH_REMEDY}")
    record_path = directory / "rollout" / "branch.json"
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record_path.stat().st_mtime)) if record else None
    steps = committed_steps(directory)
    info = BranchInfo(
        directory,
        _name(save, directory),
        created,
        (record or {}).get("parent"),
        _branch_reason(save, record),
        (record or {}).get("queue_id"),
        (record or {}).get("pool"),
        [_commit_info(directory, step) for step in steps],
        _uncommitted_steps(directory, steps),
        abandoned_queue=(record or {}).get("restarted_from_queue"),
    )
    if info.abandoned_queue:
        info.reason += (
            f"; restarted on a fresh queue: the interrupted attempt trained before its first commit, on queue "
            f"{info.abandoned_queue} (left to garbage collection)"
        )
    problems.extend(commit.problem for commit in info.commits if commit.problem)
    if info.pool and info.queue_id:
        try:
            journal = read_queue_journal(Path(info.pool), info.queue_id, named_in=record_path)
            info.sessions = sum(1 for _, event in journal.events if event["type"] == "Epoch")
            if info.sessions > 1:
                info.reason += (
                    f"; its queue was reopened {info.sessions - 1} time(s) by a rerun that resumed its write-ahead log "
                    "(the run had stopped before its first commit)"
                )
        except DurableFileError as exc:
            problems.append(str(exc))
        for commit in info.commits:
            if commit.pool and Path(commit.pool).resolve() != Path(info.pool).resolve():
                problems.append(
                    f"{commit.marker}: commit marker names pool {commit.pool}, but {record_path} names {info.pool}; "
                    "the branch record or the marker belongs to another run"
                )
    return info


def _all_branches(save: Path) -> list[Path]:
    branches = [path for path in (save / "branches").glob("*") if path.is_dir()]

    def created(path: Path) -> float:
        record = path / "rollout" / "branch.json"
        return record.stat().st_mtime if record.exists() else float("inf")

    return [save, *sorted(branches, key=created)]


def predict_rerun(save: Path, first: dict | None, active: dict | None, committed: list[int]) -> RerunInfo:
    """What `resolve_checkpoint` selects when the command that made `save` runs again, with its recorded flags.

    `first` and `active` are the branch records of the lineage's oldest and newest branch (the first command's
    --load, and the pool and initial configuration a rerun keeps); `committed` the lineage's committed steps.
    """
    first, active = first or {}, active or {}
    args = SimpleNamespace(
        save=str(save),
        load=first.get("initial_load"),
        rollout_data_dir=active.get("pool"),
        **(active.get("initial_configuration") or {}),
    )
    try:
        args, plan = resolve_checkpoint(args)
    except (ValueError, OSError, KeyError) as exc:
        return RerunInfo("refuse", f"a rerun would stop before training: {exc}")
    if plan.mode == "resume":
        where = _name(save, Path(args.save).resolve())
        return RerunInfo(
            "resume",
            f"resume branch {where}, interrupted before its first commit: same branch, same queue (its write-ahead "
            "log), training restarts at step 0",
            None,
            where,
        )
    if plan.mode == "snapshot":
        where = _name(save, Path(args.load).resolve())
        step = int(args.ckpt_step)
        why = "the newest joint commit of the current lineage"
        if committed and step < committed[-1]:
            why = f"the step the tracker {save / TRACKER} names (newer commits are ignored)"
        return RerunInfo(
            "fork",
            f"resume step {step} of branch {where} ({why}): a new branch under {save / 'branches'} forks the "
            f"queue from that joint commit and training continues at step {step + 1}",
            step,
            where,
        )
    if plan.mode == "empty":
        step = int(args.ckpt_step)
        return RerunInfo(
            "fork",
            f"restore the model of step {step} from {args.load} without a queue snapshot: a new empty queue, "
            f"training continues at step {step + 1}",
            step,
            _name(save, Path(args.load).resolve()),
        )
    return RerunInfo("fresh", "start fresh: no joint commit or interrupted run to resume in this save directory")


def inspect_run(save: Path) -> RunInspection:
    """Everything `slime-run runs DIR` reports about the save directory `save` (see the module docstring)."""
    save = Path(save).resolve()
    require_save_dir(save)
    problems: list[str] = []
    branches = [_branch_info(save, directory, problems) for directory in _all_branches(save)]
    try:
        current = read_current(save)
    except DurableFileError as exc:
        problems.append(str(exc))
        current = None
    current_dir = Path(current["directory"]).resolve() if current else None
    tracker_path = save / TRACKER
    tracker = tracker_path.read_text().strip() if tracker_path.exists() else None
    try:
        segments = lineage(save)
    except DurableFileError as exc:
        problems.append(str(exc))
        segments = []
    by_dir = {branch.directory: branch for branch in branches}
    chain = []
    for segment in segments:
        branch = by_dir.get(segment.directory)
        if branch is not None:
            branch.lineage_steps = [segment.first_step, segment.last_step]
        steps = (
            f"steps {segment.first_step}..{segment.last_step}"
            if segment.last_step >= segment.first_step
            else "no steps"
        )
        chain.append(f"{_name(save, segment.directory)} {steps}")
    if current_dir in by_dir:
        by_dir[current_dir].current = True
    if segments:
        first, active = segments[0].record, segments[-1].record
    else:  # the lineage is broken: a rerun starts from the save dir's own records, as checkpoint selection does
        try:
            first = active = read_branch_record(save)
        except DurableFileError:
            first = active = None
    committed = [step for segment in segments for step in segment.commits]
    rerun = predict_rerun(save, first, active, committed)
    lineage_queues = {(segment.record or {}).get("queue_id") for segment in segments}
    pools = [pool_usage(Path(pool), branches, lineage_queues, problems) for pool in _pools(save, branches)]
    return RunInspection(save, current_dir, tracker, branches, chain, rerun, pools, problems)


def _pools(save: Path, branches: list[BranchInfo]) -> list[str]:
    pools = dict.fromkeys(str(Path(branch.pool).resolve()) for branch in branches if branch.pool)
    return list(pools) or [str(save / "rollout_data")]


# ------------------------------------------------------------------------------------------- pool usage


def _record_sets(value: Any) -> list[dict]:
    """Every `RecordSetRef` (as a dict) inside a JSON value (straw's offline inspector finds roots the same way)."""
    found, pending = [], [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            if {"manifest", "digest", "records", "payload_bytes", "tokens"} == set(item):
                found.append(item)
            else:
                pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return found


def _referenced_packs(pool: Path, roots: list[dict], cache: dict[str, set[str]]) -> set[str]:
    """Pool-relative pack paths holding the roots, their records and (transitively) their dependencies."""
    from straw.errors import QueueError
    from straw.protocol import RecordSetRef

    from slime.data.refs import DiskPayloadRef

    packs: set[str] = set()
    pending = list(roots)
    seen: set[str] = set()
    while pending:
        root = pending.pop()
        if root["digest"] in seen:
            continue
        seen.add(root["digest"])
        if root["digest"] in cache:
            packs |= cache[root["digest"]]
            continue
        own = {root["manifest"]["segment"]["path"]}
        ref = RecordSetRef.from_dict(root)
        try:
            manifest = DiskPayloadRef(ref, str(pool)).reader_store().manifest(ref)
        except (QueueError, OSError, ValueError):
            manifest = {"records": [], "dependencies": []}
        own.update(record["segment"]["path"] for record in manifest["records"])
        cache[root["digest"]] = own
        packs |= own
        pending.extend(manifest["dependencies"])
    return packs


def pool_usage(pool: Path, branches: list[BranchInfo], lineage_queues: set, problems: list[str]) -> PoolInfo:
    """Size the pool and attribute its packs to the queues (and commits) that reference them.

    Conservative, like straw's offline inspector: everything a queue journal or a commit snapshot references
    counts as held. Packs nothing references (orphans of killed writers, partial writes) are what straw's
    offline cleanup may delete once nothing runs; packs held only by queues of branches outside the current
    lineage become reclaimable when those branches are deleted.
    """
    info = PoolInfo(pool)
    if not pool.is_dir():
        problems.append(f"{pool}: the straw pool named by the branch records is missing; restore it")
        return info
    sizes = {path.relative_to(pool).as_posix(): path.stat().st_size for path in pool.rglob("*") if path.is_file()}
    info.total_bytes = sum(sizes.values())
    packs = {path for path in sizes if path.startswith("raw/") and path.endswith((".pack", ".sealed"))}
    partial = {path for path in sizes if path.startswith("raw/") and path.endswith(".partial")}
    info.packs = len(packs)
    owner = {branch.queue_id: branch for branch in branches if branch.queue_id}
    owner.update({branch.abandoned_queue: branch for branch in branches if branch.abandoned_queue})
    holders: dict[str, set[str]] = {path: set() for path in packs}
    cache: dict[str, set[str]] = {}
    for identity in sorted((pool / "queues").glob("*/run.json")):
        queue_id = load_json_record(identity, what="queue identity", required_keys=("queue_id", "run_id"))["queue_id"]
        try:
            journal = read_queue_journal(pool, queue_id, named_in=identity)
        except DurableFileError as exc:
            problems.append(str(exc))
            continue
        roots = _record_sets([event for _, event in journal.events])
        branch = owner.get(queue_id)
        for commit in branch.commits if branch else []:
            for name in ("queue_state", "builder_state"):
                path = branch.directory / "rollout" / f"{name}_{commit.step}.json"
                if path.is_file() and commit.complete:
                    roots.extend(_record_sets(load_json_record(path, what="commit snapshot")))
        held = _referenced_packs(pool, roots, cache) & packs
        for path in held:
            holders[path].add(queue_id)
        info.queues.append(
            {
                "queue_id": queue_id,
                "branch": branch.name if branch else None,
                "in_lineage": queue_id in lineage_queues,
                "held_bytes": sum(sizes[path] for path in held),
            }
        )
    for queue in info.queues:
        if queue["branch"] is None:
            problems.append(
                f"{queue_directory(pool, queue['queue_id'])}: queue {queue['queue_id']!r} belongs to no branch of "
                "this save directory (another run shares the pool, or its branch was deleted)"
            )
    unreferenced = sorted(path for path, queues in holders.items() if not queues) + sorted(partial)
    info.unreferenced = unreferenced
    info.unreferenced_bytes = sum(sizes[path] for path in unreferenced)
    info.outside_lineage_bytes = sum(
        sizes[path] for path, queues in holders.items() if queues and not queues & lineage_queues
    )
    return info
