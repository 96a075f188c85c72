"""Joint checkpoints: selection of what to restore, and the commit that makes a training step durable.

A joint checkpoint of step N is the model save (`iter_<N:07d>`, and `critic/iter_<N:07d>` with a critic), the
queue and batch-builder snapshots (`rollout/queue_state_N.json`, `rollout/builder_state_N.json`) and, last,
the marker `rollout/committed_N.json` listing every file with its size (and sha256 for metadata). Restores
never write into the checkpoint they read: each writes a fresh branch (`<save>/branches/<uuid hex>`), and
the logical save dir's `rollout/current.json` names the active branch.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from slime.data.checkpoint_settings import CheckpointSettings
from slime.data.straw_settings import StrawSettings
from slime.storage_errors import with_context
from slime.utils.atomic_files import fsync_path

logger = logging.getLogger(__name__)

MARKER_VERSION = 1
TRACKER = "latest_checkpointed_iteration.txt"
#: The critic's part of a save directory: its `iter_<N>` and tracker, beside the policy's.
CRITIC_DIR = "critic"
_COMMITTED = re.compile(r"committed_(\d+)\.json")


@dataclass(frozen=True)
class RestorePlan:
    """What `resolve_checkpoint` selected for this run; travels to the queue controller and the manager."""

    mode: Literal["new", "resume", "snapshot", "empty"] = "new"
    root: str | None = None
    expected_current: str | None = None
    branch: dict[str, Any] | None = None
    queue_id: str | None = None
    dataset_cursor: str | None = None


@dataclass(frozen=True)
class SourceRestore:
    """What the data source restored: a fresh queue (fork) and/or the retained source reference."""

    new_queue: bool = False
    source_ref: Any = None


# --------------------------------------------------------------------------------------------- commit


def write_report(path: Path, value: Any) -> None:
    """straw's atomic, fsynced JSON report write (straw is imported only by runs that commit checkpoints)."""
    from straw.reporting import write_report as straw_write_report

    straw_write_report(path, value)


def critic_arguments(args: Any) -> Any:
    """The critic group's copy of the run's `args`: it saves under `critic/` of `--save` and loads from `critic/` of
    `--load`, so that a joint commit (built from each group's args) lists and fsyncs its files beside the policy's,
    and a restore loads both parts of the same commit."""
    critic_args = copy.copy(args)
    for name in ("save", "load"):
        value = getattr(args, name, None)
        setattr(critic_args, name, str(Path(value) / CRITIC_DIR) if value else value)
    return critic_args


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _describe(path: Path, *, hashed: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"size": path.stat().st_size}
    if hashed:
        entry["sha256"] = _sha256(path)
    return entry


def _model_files(root: Path, model: CheckpointSettings, rollout_id: int) -> dict[str, dict[str, Any]]:
    """fsync and describe one model's `iter_<id>` payload; it must be a real, non-empty dir inside the save root."""
    model_dir = Path(model.save).resolve() / f"iter_{rollout_id:07d}"
    if not model_dir.is_relative_to(root):
        raise ValueError(f"Model checkpoint must be inside --save: {model_dir} is outside {root}")
    payloads: list[Path] = []
    if model_dir.is_dir() and not model_dir.is_symlink():
        for path in sorted(model_dir.rglob("*")):
            if path.is_symlink():
                raise ValueError(f"Model checkpoint payloads must not be symlinks: {path}")
            if path.is_file():
                payloads.append(path)
    if not payloads:
        raise ValueError(f"Missing model checkpoint payloads: {model_dir} is missing or empty")
    if model.use_stateless_adam and model.no_save_optim:
        scheduler = model_dir / "opt_param_scheduler.pt"
        if not scheduler.is_file():
            raise ValueError(
                f"Missing stateless Adam scheduler {scheduler}: stateless Adam omits optimizer tensors, so the "
                "scheduler state must be saved for the step to be resumable"
            )
    files = {}
    for path in payloads:
        fsync_path(path)
        hashed = path.suffix == ".json" or path.name.endswith(".metadata")
        files[path.relative_to(root).as_posix()] = _describe(path, hashed=hashed)
    directories = {path.parent for path in payloads} | {model_dir, model_dir.parent}
    for directory in sorted(directories, key=lambda p: len(p.parts), reverse=True):
        fsync_path(directory)
    return files


def commit_checkpoint(
    args: Any,
    rollout_id: int,
    *,
    model_args: list[Any],
    restore_plan: RestorePlan | None = None,
    weight_version: int | None = None,
) -> Path:
    """Write `rollout/committed_<id>.json` after every component of the step is durable; returns the marker.

    The marker is the last durable artifact: model payloads and both rollout snapshots are fsynced first.
    With a restore plan, the logical save dir's tracker and then its `current.json` advance to this step.
    """
    straw = StrawSettings.from_args(args)
    root = Path(CheckpointSettings.from_args(args).save).resolve()
    marker = root / "rollout" / f"committed_{rollout_id}.json"
    if marker.exists():
        raise FileExistsError(f"Committed checkpoints are immutable: {marker} already exists")
    files: dict[str, dict[str, Any]] = {}
    resumable = True
    for config in model_args:
        model = CheckpointSettings.from_args(config)
        resumable &= model.saves_resumable
        files.update(_model_files(root, model, rollout_id))
    for name in ("queue_state", "builder_state"):
        path = root / "rollout" / f"{name}_{rollout_id}.json"
        if not path.is_file():
            raise ValueError(f"Missing {name} checkpoint: {path} (the rollout manager's save did not write it)")
        fsync_path(path)
        files[path.relative_to(root).as_posix()] = _describe(path, hashed=True)
    fsync_path(root / "rollout")
    record = {
        "version": MARKER_VERSION,
        "rollout_id": rollout_id,
        "files": files,
        "resumable": resumable,
        "weight_version": weight_version if weight_version is not None else rollout_id + 1,
        "rollout_data_dir": str(Path(straw.pool).resolve()) if straw.pool else None,
        "run_id": straw.run_id,
    }
    try:
        write_report(marker, record)
    except OSError as exc:  # a full or read-only filesystem: name the marker (a failed write names no file)
        storage_error = with_context(exc, marker, "committing the joint checkpoint", probe=False)
        if storage_error is None:
            raise
        raise storage_error from exc
    if restore_plan is not None and restore_plan.root:
        _advance_logical_root(Path(restore_plan.root), root, rollout_id)
    return marker


def _advance_logical_root(logical: Path, branch: Path, rollout_id: int) -> None:
    """Point the logical save dir at this commit: tracker first, then `current.json` (which records the tracker)."""
    current_path = logical / "rollout" / "current.json"
    current = json.loads(current_path.read_text()) if current_path.exists() else None
    if current is None or Path(current["directory"]).resolve() != branch:
        raise RuntimeError(
            f"Current branch changed while saving its checkpoint: {current_path} no longer names {branch}"
        )
    write_report(logical / TRACKER, rollout_id)
    write_report(current_path, {**current, "tracker": str(rollout_id)})


# ----------------------------------------------------------------------------------------- validation


def committed_steps(directory: Path) -> list[int]:
    """Steps with a joint commit marker in one physical save dir, ascending."""
    rollout = directory / "rollout"
    if not rollout.is_dir():
        return []
    steps = (_COMMITTED.fullmatch(path.name) for path in rollout.iterdir())
    return sorted(int(match.group(1)) for match in steps if match)


def _read_tracker(directory: Path) -> int | None:
    path = directory / TRACKER
    if not path.exists():
        return None
    text = path.read_text().strip()
    try:
        return int(text)
    except ValueError as exc:
        raise ValueError(f"Model checkpoint tracker {path} must hold a step number, got {text!r}") from exc


def _read_checkpoint(root: Path, step: int) -> dict[str, Any]:
    """Load and verify the joint commit of `step`: version, resumability and every listed file's size/sha."""
    marker = root / "rollout" / f"committed_{step}.json"
    value = json.loads(marker.read_text())
    if value.get("version") != MARKER_VERSION or value.get("rollout_id") != step or not value.get("resumable"):
        raise ValueError(f"Checkpoint is incompatible or omitted optimizer/RNG state: {marker}")
    for name, expected in value["files"].items():
        path = (root / name).resolve()
        size = path.stat().st_size  # A deleted component raises FileNotFoundError naming it.
        if not path.is_relative_to(root) or size != expected["size"]:
            raise ValueError(f"Checkpoint component missing or changed: {name} in {root}")
        if "sha256" in expected and _sha256(path) != expected["sha256"]:
            raise ValueError(f"Checkpoint component changed: {name} in {root}")
    return value


def _read_empty_checkpoint(root: Path, step: int) -> None:
    """Validate a model-only restore (no joint commit): no orphan queue snapshot, and a non-empty model dir."""
    for name in ("queue_state", "builder_state"):
        if (root / "rollout" / f"{name}_{step}.json").exists():
            raise ValueError(
                f"Queue snapshot exists without a complete joint commit; refusing empty-queue fallback "
                f"({root}/rollout/{name}_{step}.json has no committed_{step}.json)"
            )
    model = root / f"iter_{step:07d}"
    if not model.is_dir() or not any(model.iterdir()):
        raise FileNotFoundError(f"Requested model checkpoint does not exist: {model}")


# ------------------------------------------------------------------------------------------ selection


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _select_checkpoint(directory: Path, step: int | None, *, allow_empty: bool = False) -> tuple[Path, int, Any]:
    """Walk from `directory`'s active branch up its ancestry to the checkpoint of `step` (default: newest).

    Never follows a parent past its branch point (its later commits are an abandoned future). Returns
    `(root, step, marker value)`, with value None for a model-only restore below a parent without a snapshot.
    """
    requested = step
    pointer = _read_json(directory / "rollout" / "current.json")
    current = Path(pointer["directory"]).resolve() if pointer else directory
    seen: set[Path] = set()
    while current not in seen:
        seen.add(current)
        commits = committed_steps(current)
        if step is None and commits:
            step = commits[-1]
        if step is not None and step in commits:
            return current, step, _read_checkpoint(current, step)
        if step is not None and allow_empty and (current / f"iter_{step:07d}").exists():
            _read_empty_checkpoint(current, step)
            return current, step, None
        branch = _read_json(current / "rollout" / "branch.json")
        parent = branch.get("parent") if branch else None
        if not parent or (step is not None and step > parent["step"]):
            break
        step = parent["step"] if step is None else step
        allow_empty |= not parent["queue_snapshot"]
        current = Path(parent["directory"]).resolve()
    raise ValueError(f"No committed model/source checkpoint for step {requested} in {directory}'s branch history")


def _tracker_step(root: Path, pointer: dict[str, Any] | None, active: Path) -> int | None:
    """The step a user selected by editing a tracker, or None to take the newest commit.

    The logical tracker counts as an edit when it differs from the value `current.json` recorded; a physical
    tracker counts when it is older than the newest commit (newer means an interrupted model save).
    """
    tracked = _read_tracker(root)
    commits = committed_steps(active)
    latest = commits[-1] if commits else -1
    recorded = pointer.get("tracker") if pointer else None
    if tracked is not None and root != active and recorded is not None and str(recorded).strip() != str(tracked):
        return tracked
    if tracked is not None and root == active and tracked < latest:
        return tracked
    if root != active:
        own = _read_tracker(active)
        if own is not None and own < latest:
            return own
    return None


def _resume_wal(
    args: Any,
    save_root: Path,
    root: Path,
    active: Path,
    expected: str | None,
    branch: dict,
    *,
    settings: CheckpointSettings,
    pool: str | None,
) -> Any:
    """Resume a run interrupted before its first checkpoint: same save dir, configuration and pool."""
    if root != save_root:
        raise ValueError(
            f"Before the first checkpoint, restart using the original --save directory {root} (got {save_root})"
        )
    if branch.get("initial_configuration") != settings.initial.record():
        raise ValueError(
            "Initial model/input configuration differs from the interrupted run; restore the original flags "
            f"recorded in {active}/rollout/branch.json or use a new --save"
        )
    if pool and Path(pool).resolve() != Path(branch["pool"]).resolve():
        raise ValueError(f"Interrupted run requires its original straw pool {branch['pool']} (got {pool})")
    args.load = branch.get("initial_load")
    args.save = str(active)
    args.rollout_data_dir = branch["pool"]
    plan_branch = {key: value for key, value in branch.items() if key != "pool"}
    return RestorePlan("resume", str(save_root), expected, plan_branch, branch.get("queue_id"))


def _is_checkpoint_dir(root: Path) -> bool:
    rollout = root / "rollout"
    return (rollout / "current.json").exists() or (rollout / "branch.json").exists() or bool(committed_steps(root))


def _occupied(save_root: Path, expected_current: str | None) -> bool:
    if expected_current is not None or (save_root / "rollout" / "branch.json").exists():
        return True
    return save_root.is_dir() and any(entry.name.startswith("iter_") for entry in save_root.iterdir())


def resolve_checkpoint(args: Any) -> tuple[Any, RestorePlan]:
    """Select what this run restores and where it writes; mutates and returns `args` with the plan.

    Pure selection: reads files only. The queue controller publishes the branch the plan describes. Sets
    `args.save` (the branch this run writes), and with a checkpoint selected `args.load`, `args.ckpt_step`,
    `args.start_rollout_id`, `args.update_weight_start_version` and `args.rollout_data_dir`.
    """
    settings = CheckpointSettings.from_args(args)
    if not settings.restores_joint_commits:
        return args, RestorePlan()
    straw = StrawSettings.from_args(args)
    save_root = Path(settings.save).resolve()
    current_path = save_root / "rollout" / "current.json"
    expected_current = current_path.read_text() if current_path.exists() else None
    initial_load = settings.load
    load = initial_load if initial_load is not None else (save_root if expected_current is not None else None)
    step = settings.ckpt_step
    selected: tuple[Path, int, Any] | None = None
    if load is not None:
        root = Path(load).resolve()
        direct = _COMMITTED.fullmatch(root.name) if root.parent.name == "rollout" else None
        if direct and not root.is_file():
            raise FileNotFoundError(f"Checkpoint marker named by --load does not exist: {root}")
        if direct:
            marker_step = int(direct.group(1))
            if step is not None and step != marker_step:
                raise ValueError(f"--ckpt-step differs from the explicit checkpoint marker {root} ({step})")
            step, root = marker_step, root.parent.parent
        explicit = step is not None
        if direct or _is_checkpoint_dir(root):
            pointer = _read_json(root / "rollout" / "current.json")
            active = Path(pointer["directory"]).resolve() if pointer else root
            if not explicit:
                step = _tracker_step(root, pointer, active)
            branch = _read_json(active / "rollout" / "branch.json")
            if step is None and branch and branch.get("parent") is None and not committed_steps(active):
                resumed = _resume_wal(
                    args, save_root, root, active, expected_current, branch, settings=settings, pool=straw.pool
                )
                return args, resumed
            if direct:
                selected = (root, step, _read_checkpoint(root, step))
            else:
                selected = _select_checkpoint(root, step, allow_empty=step is not None)
        elif (root / TRACKER).exists():
            step = step if step is not None else _read_tracker(root)
            _read_empty_checkpoint(root, step)
            selected = (root, step, None)
        elif explicit:
            raise FileNotFoundError(f"No model checkpoint tracker for requested step {step}: {root}")
    if selected is not None and not (selected[0] / TRACKER).exists():
        raise FileNotFoundError(f"Model checkpoint tracker is missing: {selected[0] / TRACKER}")
    if _occupied(save_root, expected_current) or (selected is not None and selected[0] == save_root):
        destination = save_root / "branches" / uuid.uuid4().hex
    else:
        destination = save_root
    branch = {
        "version": 1,
        "parent": None,
        "initial_load": initial_load,
        "initial_configuration": settings.initial.record(),
        "queue_id": f"run:{uuid.uuid4().hex}",
    }
    mode, dataset_cursor = "new", None
    if selected is not None:
        mode, dataset_cursor = _apply_selection(args, settings, straw, selected, branch)
    args.save = str(destination)
    return args, RestorePlan(mode, str(save_root), expected_current, branch, branch["queue_id"], dataset_cursor)


def _apply_selection(
    args: Any,
    settings: CheckpointSettings,
    straw: StrawSettings,
    selected: tuple[Path, int, Any],
    branch: dict[str, Any],
) -> tuple[str, str | None]:
    """Check restore flags against the selected checkpoint and point `args` at it; returns (mode, dataset cursor)."""
    root, step, value = selected
    if not settings.loads_full_state:
        raise ValueError(
            "Checkpoint restoration requires model, optimizer and RNG state (drop --no-load-optim/--no-load-rng, "
            "or start a new run with a new --save)"
        )
    start = settings.start_rollout_id
    if start is not None and start != step + 1:
        raise ValueError(
            f"The run starts at step {start} but the checkpoint's next step is {step + 1} ({root}); "
            "pick the checkpoint with --ckpt-step"
        )
    dataset_cursor = None
    if value is not None:
        if value.get("run_id") != straw.run_id:
            raise ValueError(f"Checkpoint belongs to another straw run: {value.get('run_id')!r}, not {straw.run_id!r}")
        if straw.pool and Path(straw.pool).resolve() != Path(value["rollout_data_dir"]).resolve():
            raise ValueError(
                f"Checkpoint restoration requires the original shared straw pool {value['rollout_data_dir']}"
            )
        args.rollout_data_dir = value["rollout_data_dir"]
        mode = "snapshot"
        args.update_weight_start_version = value["weight_version"]
    else:
        mode = "empty"
        cursor = root / "rollout" / f"global_dataset_state_dict_{step}.pt"
        if cursor.exists():
            dataset_cursor = str(cursor)
            detail = f"restore dataset cursor from {cursor}"
        else:
            detail = "dataset restarts at offset 0 (not exact data replay)"
        logger.warning(
            "Checkpoint %s step %d has a model but no joint queue commit: starting a new empty queue; %s",
            root,
            step,
            detail,
        )
        args.update_weight_start_version = step + 1
    args.ckpt_step = step
    args.start_rollout_id = step + 1
    args.load = str(root)
    branch["parent"] = {"directory": str(root), "step": step, "queue_snapshot": value is not None}
    return mode, dataset_cursor


# ------------------------------------------------------------------------------------------------ save


def save_checkpoint(
    args: Any,
    rollout_id: int,
    actor_model: Any,
    critic_model: Any,
    rollout_manager: Any,
    *,
    actor_trains: bool,
    restore_plan: RestorePlan | None = None,
) -> None:
    """Save one training step with the run's checkpoint policy (`--checkpoint-policy`, else the transport's)."""
    from slime.plugin_manager import registry_for

    registry = registry_for(args)
    settings = CheckpointSettings.from_args(args)
    name = settings.policy or registry.get("transports", settings.transport).checkpoint_policy
    policy = registry.get("checkpoint_policies", name).target
    policy(
        args,
        rollout_id,
        actor_model,
        critic_model,
        rollout_manager,
        actor_trains=actor_trains,
        restore_plan=restore_plan,
    )
