"""Built-in checkpoint policies: the joint commit of the straw transport, and plain model/manager saves.

`joint` saves actor, critic and rollout manager, then commits the step (`rollout/committed_<N>.json`)
so it can be restored exactly; a run that does not train the actor, or a debug run, has no queue to
commit and saves plainly. `plain` is the object-store behaviour: models and manager, no marker.
After a joint commit the retention rule (`--keep-last-checkpoints`, `--keep-every-checkpoint`) prunes
older commits of this branch, never one a branch, an archive or the current pointer still needs.
Each policy reads one `CheckpointSettings` built from the arguments it is called with; `slime_configure`
refuses bad checkpoint flags when the run's arguments are parsed.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ray

from slime import hookimpl
from slime.data.checkpoint import CRITIC_DIR, TRACKER, RestorePlan, commit_checkpoint, committed_steps
from slime.data.checkpoint_settings import CheckpointSettings
from slime.specs import CheckpointPolicySpec

logger = logging.getLogger(__name__)


def _save_components(
    settings: CheckpointSettings,
    rollout_id: int,
    actor: Any,
    critic: Any,
    manager: Any,
    *,
    actor_trains: bool,
    force_sync: bool = False,
) -> None:
    """Actor, then critic, then rollout manager; any failure propagates and stops the later saves.

    The saves block (`force_sync`) when the step must be durable now: a joint commit, released trainers
    (`--release-train`), the last step.
    """
    force_sync = force_sync or settings.release_train or settings.is_last_step(rollout_id)
    if actor_trains:
        actor.save_model(rollout_id, force_sync=force_sync)
    if settings.use_critic:
        critic.save_model(rollout_id, force_sync=force_sync)
    ray.get(manager.save.remote(rollout_id))


def plain_save(
    args: Any,
    rollout_id: int,
    actor: Any,
    critic: Any,
    manager: Any,
    *,
    actor_trains: bool,
    restore_plan: RestorePlan | None = None,
) -> None:
    """Save models and the rollout manager without a joint marker (an existing marker is left untouched)."""
    _save_components(CheckpointSettings.from_args(args), rollout_id, actor, critic, manager, actor_trains=actor_trains)


def joint_save(
    args: Any,
    rollout_id: int,
    actor: Any,
    critic: Any,
    manager: Any,
    *,
    actor_trains: bool,
    restore_plan: RestorePlan | None = None,
) -> None:
    """Save every component synchronously, then write the joint commit marker last and apply retention.

    Debug runs own no live queue and save plainly. A step that trains only the critic commits nothing (the
    policy did not change), but its saves are still synchronous: the next joint commit builds on them.
    """
    settings = CheckpointSettings.from_args(args)
    if settings.debug:
        _save_components(settings, rollout_id, actor, critic, manager, actor_trains=actor_trains)
        return
    if not actor_trains:
        _save_components(settings, rollout_id, actor, critic, manager, actor_trains=False, force_sync=True)
        return
    marker = Path(settings.save) / "rollout" / f"committed_{rollout_id}.json"
    if marker.exists():
        raise FileExistsError(f"Refusing to overwrite a committed straw checkpoint: {marker}")
    _save_components(settings, rollout_id, actor, critic, manager, actor_trains=True, force_sync=True)
    model_args = [actor.args] + ([critic.args] if settings.use_critic else [])
    weight_version = ray.get(manager.get_weight_version.remote())
    commit_checkpoint(args, rollout_id, model_args=model_args, restore_plan=restore_plan, weight_version=weight_version)
    _prune(settings, restore_plan)


# ------------------------------------------------------------------------------------------ retention


def retained_steps(
    steps: Iterable[int], *, keep_last: int | None = None, keep_every: int | None = None, protected: Iterable[int] = ()
) -> set[int]:
    """Which committed steps to keep: the last `keep_last`, every step divisible by `keep_every`, and `protected`.

    `keep_last=None` keeps everything (the default); the newest step is always kept.
    """
    ordered = sorted(set(steps))
    if keep_last is None:
        return set(ordered)
    if keep_last < 1 or (keep_every is not None and keep_every < 1):
        raise ValueError(
            f"--keep-last-checkpoints and --keep-every-checkpoint must be >= 1 (got {keep_last}, {keep_every})"
        )
    kept = set(ordered[-keep_last:])
    if keep_every:
        kept |= {step for step in ordered if step % keep_every == 0}
    return kept | (set(protected) & set(ordered))


def _needed_steps(directory: Path, logical_root: Path) -> set[int]:
    """Steps of `directory` that something else names: a branch's parent, the trackers, an archive reference."""
    needed = set()
    for tracker in {directory / TRACKER, logical_root / TRACKER}:
        if tracker.exists():
            text = tracker.read_text().strip()
            if text.lstrip("-").isdigit():
                needed.add(int(text))
    candidates = [logical_root / "rollout" / "branch.json", *logical_root.glob("branches/*/rollout/branch.json")]
    candidates += list(directory.glob("branches/*/rollout/branch.json"))
    for path in filter(Path.exists, candidates):
        parent = json.loads(path.read_text()).get("parent")
        if parent and Path(parent["directory"]).resolve() == directory:
            needed.add(parent["step"])
    references = directory / "rollout" / "retained_steps.json"
    if references.exists():  # Steps an archive or a user pinned explicitly: a JSON list of step numbers.
        needed.update(int(step) for step in json.loads(references.read_text()))
    return needed


def prune_checkpoints(args: Any, *, restore_plan: RestorePlan | None = None) -> list[int]:
    """Delete joint commits of `args.save` outside the retention rule; returns the deleted steps.

    The marker goes first, so an interrupted prune leaves an uncommitted (never selected) step behind, not a
    marker over missing files.
    """
    return _prune(CheckpointSettings.from_args(args), restore_plan)


def _prune(settings: CheckpointSettings, restore_plan: RestorePlan | None) -> list[int]:
    if settings.keep_last is None:
        return []
    directory = Path(settings.save).resolve()
    logical = Path(restore_plan.root).resolve() if restore_plan is not None and restore_plan.root else directory
    steps = committed_steps(directory)
    kept = retained_steps(
        steps, keep_last=settings.keep_last, keep_every=settings.keep_every, protected=_needed_steps(directory, logical)
    )
    deleted = [step for step in steps if step not in kept]
    for step in deleted:
        rollout = directory / "rollout"
        (rollout / f"committed_{step}.json").unlink()
        for name in ("queue_state", "builder_state"):
            (rollout / f"{name}_{step}.json").unlink(missing_ok=True)
        for model in (directory / f"iter_{step:07d}", directory / CRITIC_DIR / f"iter_{step:07d}"):
            if model.is_dir():
                shutil.rmtree(model)
        logger.info("Pruned checkpoint step %d of %s (retention rule)", step, directory)
    return deleted


@hookimpl(trylast=True)
def slime_configure(args: Any) -> None:
    """Refuse bad checkpoint flags (`--keep-last-checkpoints 0`, ...) when the run's arguments are parsed; runs
    last, after plugins that fill in checkpoint options."""
    CheckpointSettings.from_args(args)


@hookimpl
def slime_checkpoint_policies() -> Iterable[CheckpointPolicySpec]:
    return [
        CheckpointPolicySpec(
            "joint", joint_save, "Joint commit of model, critic, queue and batch-builder state (exact resume)"
        ),
        CheckpointPolicySpec("plain", plain_save, "Model and rollout-manager saves without a joint commit marker"),
    ]
