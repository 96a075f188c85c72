"""The training driver: `python train.py [options]` or `slime-run [options]`.

One rollout step: the rollout manager generates and accepts a batch, the trainers train on it, the manager
records the runtime completion, the step is checkpointed (when due), and only then do the engines receive
the new weights. That order makes a committed checkpoint's `weight_version` the version of the weights that
generated the step's data.

The acceptance tests load this file by path and patch its module globals (`ray`, `create_training_models`),
so the driver looks those names up here at call time.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # `python train.py` puts this file's real directory (core/, the `slime` package) first on sys.path, where
    # core/ray would shadow the `ray` library; the framework is imported as `slime` instead.
    _here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != _here]

import contextlib
import logging
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from slime.data.checkpoint import save_checkpoint
from slime.data.data_source import RolloutDataSource
from slime.data.eval_data import read_eval_records
from slime.data.run_lock import hold_save_directory
from slime.determinism import check_reproducible_resume
from slime.errors import RunInterrupted, UsageError
from slime.interfaces import run_transport
from slime.observability.logging_utils import (
    configure_logger,
    finish_tracking,
    init_tracking,
    quiet_progress_bars,
    verbose_requested,
)
from slime.observability.phase_timer import PhaseTimer
from slime.ray.cluster import RaySettings, start_ray
from slime.ray.layout import LayoutError
from slime.ray.placement_group import create_placement_groups, create_rollout_manager, create_training_models
from slime.ray.settings import DriverSettings, InputSettings, check_run_settings
from slime.storage_errors import fault_message, storage_fault
from slime.utils.arguments import parse_args
from slime.utils.hf_checkpoint import validate_hf_checkpoint_dir
from slime.utils.hub_checkpoint import looks_like_hub_id, resolve_hf_checkpoint
from slime.utils.misc import should_run_periodic_action

if TYPE_CHECKING:
    from slime.plugin_manager import PluginSelection

logger = logging.getLogger(__name__)

# Registered data sources that read `--prompt-data` rows with `read_prompt_records` (object store, straw).
PROMPT_FILE_SOURCES = frozenset({"prompts", "queue"})


class _Observers:
    """Lifecycle hooks of the run's plugins (`slime_after_rollout`, ...); none without a plugin selection."""

    def __init__(self, selection: PluginSelection | None) -> None:
        if selection is None:
            self._hook = None
            return
        from slime.plugin_manager import build_plugin_manager

        self._hook = build_plugin_manager(selection).hook

    @property
    def active(self) -> bool:
        return self._hook is not None

    def call(self, name: str, **kwargs: Any) -> None:
        if self._hook is not None:
            getattr(self._hook, name)(**kwargs)


def _train_metrics(results: Any) -> dict[str, Any]:
    """Rank 0's metrics from the ranks' `train` results (backends may return nothing): its numeric entries (a
    critic's results also carry the advantages it hands to the actor)."""
    if isinstance(results, list) and results and isinstance(results[0], dict):
        return {key: value for key, value in results[0].items() if isinstance(value, (int, float))}
    return {}


def train(args: Any, pgs: Any, rollout_manager: Any, num_rollout_per_epoch: int | None, restore_plan: Any) -> None:
    """Run rollout steps `args.start_rollout_id .. args.num_rollout - 1`, then dispose the rollout manager.

    `args` travels unchanged to the hooks, the training groups and the checkpoint; the loop reads its
    `DriverSettings`, built once `create_training_models` has settled `args.start_rollout_id`.
    """
    actor_model, critic_model = create_training_models(args, pgs, rollout_manager)
    settings = DriverSettings.from_args(args)
    observers = _Observers(settings.plugin_selection)

    def evaluate(rollout_id: int) -> None:
        metrics = ray.get(rollout_manager.eval.remote(rollout_id))
        observers.call("slime_after_eval", args=args, rollout_id=rollout_id, metrics=dict(metrics or {}))

    num_rollout = settings.num_rollout
    if num_rollout is None and not settings.eval_only:
        raise ValueError("train() needs --num-rollout (with --num-epoch, create_rollout_manager sets it)")
    eval_interval = settings.eval_interval

    actor_model.update_weights()
    ray.get(rollout_manager.training_ready.remote())
    if settings.eval_only:
        # Logged with the step whose weights are evaluated: the loaded checkpoint's (step 0 for a fresh model).
        evaluate(max(settings.start_rollout_id - 1, 0))
        ray.get(rollout_manager.dispose.remote())
        return

    for rollout_id in range(settings.start_rollout_id, num_rollout):
        timer = PhaseTimer()
        step_started = time.perf_counter()
        if eval_interval is not None and rollout_id == 0 and not settings.skip_eval_before_train:
            evaluate(rollout_id)

        rollout_data_ref = ray.get(rollout_manager.generate.remote(rollout_id))
        if observers.active:
            report = ray.get(rollout_manager.rollout_report.remote())
            observers.call("slime_after_rollout", args=args, rollout_id=rollout_id, **report)
        if settings.release_train:
            actor_model.create(rollout_manager)
            if critic_model is not None:
                critic_model.create(rollout_manager)

        actor_trains = not settings.use_critic or rollout_id >= settings.num_critic_only_steps
        value_refs = critic_model.async_train(rollout_id, rollout_data_ref) if settings.use_critic else None
        results = None
        with timer.phase("train"):
            if actor_trains:
                results = ray.get(actor_model.async_train(rollout_id, rollout_data_ref, external_data=value_refs))
            if value_refs is not None:
                critic_results = ray.get(value_refs)
                results = results if actor_trains else critic_results
        ray.get(rollout_manager.training_completed.remote(rollout_id))
        observers.call("slime_after_train_step", args=args, rollout_id=rollout_id, metrics=_train_metrics(results))

        if settings.release_train or should_run_periodic_action(
            rollout_id, settings.save_interval, num_rollout_per_epoch, num_rollout
        ):
            with timer.phase("save"):
                save_checkpoint(
                    args,
                    rollout_id,
                    actor_model,
                    critic_model,
                    rollout_manager,
                    actor_trains=actor_trains,
                    restore_plan=restore_plan,
                )
            observers.call("slime_checkpoint_committed", args=args, rollout_id=rollout_id, path=str(settings.save))

        was_paused = ray.get(rollout_manager.pause_rollout_admission.remote())
        with timer.phase("update_weights"):
            actor_model.update_weights()
        if was_paused and rollout_id + 1 < num_rollout:
            ray.get(rollout_manager.resume_rollout_admission.remote())

        if should_run_periodic_action(rollout_id, eval_interval, num_rollout_per_epoch, num_rollout):
            evaluate(rollout_id)  # the last step's weights too: the run ends with its final model's scores
        timer.seconds["step"] = time.perf_counter() - step_started
        observers.call("slime_step_end", args=args, rollout_id=rollout_id, metrics=timer.metrics())

    ray.get(rollout_manager.dispose.remote())


def fetch_hub_model(args: Any) -> None:
    """A Hugging Face Hub id in `--hf-checkpoint` becomes its local snapshot directory, fetched (or found in the
    cache) now, before any plugin or actor reads the model; ValueError naming the flag when the Hub cannot serve
    it. A local directory is left as it is."""
    model = InputSettings.from_args(args).hf_checkpoint
    if model and looks_like_hub_id(model):
        args.hf_checkpoint = str(resolve_hf_checkpoint(model))
        logger.info("--hf-checkpoint %s: %s", model, args.hf_checkpoint)


def check_run_inputs(args: Any) -> None:
    """Fail on a bad `--hf-checkpoint` directory, `--prompt-data` or `--eval-prompt-data` file before any Ray
    actor starts.

    Runs after `slime_run_start` (which may build them). The prompt file is checked only for the built-in
    data sources, the ones that read it as JSONL/Parquet rows.
    """
    inputs = InputSettings.from_args(args)
    if inputs.hf_checkpoint:
        validate_hf_checkpoint_dir(inputs.hf_checkpoint)
    if inputs.prompt_data and inputs.data_source in PROMPT_FILE_SOURCES:
        # The data source's own reading, rows converted to Samples included (bad tools, bad metadata fail here).
        RolloutDataSource(args)
    read_eval_records(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, start the run on Ray, train, and tear the run down."""
    verbose = verbose_requested(argv)
    configure_logger(verbose=verbose)
    if not verbose:
        quiet_progress_bars()
    args = parse_args(argv)
    try:
        with contextlib.ExitStack() as held:
            if args.save:
                # Before the checkpoint is selected: two runs must never both pick the same commit to continue from.
                held.enter_context(hold_save_directory(args.save))
            return _run(args)
    except OSError as exc:
        # Storage that refuses writes before the run started (a rerun before the disk was freed) or while it let go
        # of the save directory: the same one line as in `_run`.
        pool = getattr(args, "rollout_data_dir", None)
        if (fault := storage_fault(exc, (args.save, pool))) is None:
            raise
        raise RunInterrupted(fault_message(fault, save=args.save, pool=pool)) from exc


def _run(args: Any) -> int:
    """Select what to restore, start the run on Ray, train, and tear the run down."""
    try:
        # Before the save directory is resolved to a branch: the record lives at its root.
        check_reproducible_resume(args.save, args)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    args, restore_plan = run_transport(args).resolve_restore()
    parent = (restore_plan.branch or {}).get("parent")
    if parent:
        logger.info("continuing from the joint commit of step %s in %s", parent["step"], parent["directory"])
    # Settle storage paths once here, so checkpoints record them and every actor sees the same ones.
    run_transport(args).prepare_storage()
    try:
        fetch_hub_model(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    _Observers(args.plugin_selection).call("slime_run_start", args=args)
    try:
        check_run_inputs(args)
    except (OSError, ValueError) as exc:  # the run's own input files, before anything starts
        raise UsageError(str(exc)) from exc
    check_run_settings(args)
    start_ray(RaySettings.from_environment(args))
    init_tracking(args)
    rollout_manager = None
    try:
        pgs = create_placement_groups(args)
        rollout_manager, num_rollout_per_epoch = create_rollout_manager(args, pgs["rollout"], restore_plan=restore_plan)
        train(args, pgs, rollout_manager, num_rollout_per_epoch, restore_plan)
    except RayActorError as exc:
        # A process of the run died (killed, out of memory, its node lost): not a bug to show in full, but the
        # end of this run; its last joint commit is intact and the same command resumes from it.
        if rollout_manager is not None:
            ray.kill(rollout_manager, no_restart=True)
        reported = _error_of_creation(exc)
        if reported is not None:  # an actor refused to start with the user's to fix (a node without the pool)
            raise reported from exc
        logger.warning("a Ray actor of the run died: %s", exc)
        raise RunInterrupted(_actor_death_message(exc, restore_plan.root or args.save)) from exc
    except (OSError, RayTaskError) as exc:
        # Storage under the save dir or the straw pool that refuses writes (full, over quota, read-only) is the
        # user's to fix, not a bug: one line naming the path and the operation; the last joint commit is intact (its
        # marker is written last) and the same command resumes from it. Any other error: logged and re-raised.
        stopped = exc.cause if isinstance(exc, RayTaskError) else exc
        if isinstance(stopped, RunInterrupted):  # raised by an actor (a node lost): its message says how to go on
            if rollout_manager is not None:
                ray.kill(rollout_manager, no_restart=True)
            raise RunInterrupted(str(stopped)) from exc
        logger.exception("training failed; stopping the rollout manager")
        if rollout_manager is not None:
            ray.kill(rollout_manager, no_restart=True)
        root, pool = restore_plan.root or args.save, getattr(args, "rollout_data_dir", None)
        fault = storage_fault(exc, (root, pool))
        if fault is None:
            raise
        raise RunInterrupted(fault_message(fault, save=root, pool=pool)) from exc
    except UsageError:  # the user's to fix (a layout the cluster cannot hold): the message says it all
        if rollout_manager is not None:
            ray.kill(rollout_manager, no_restart=True)
        raise
    except BaseException:
        logger.exception("training failed; stopping the rollout manager")
        if rollout_manager is not None:
            ray.kill(rollout_manager, no_restart=True)
        raise
    finally:
        finish_tracking(args)
    ray.kill(rollout_manager, no_restart=True)
    return 0


def _error_of_creation(exc: RayActorError) -> UsageError | RunInterrupted | None:
    """The `UsageError` or `RunInterrupted` an actor's constructor raised, rebuilt from the dead actor's error
    text (Ray keeps only the text of a creation task's exception), or None when it died of something else."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(getattr(exc, "error_msg", "") or exc))
    found = None
    for cls in (UsageError, RunInterrupted, LayoutError):
        position = text.rfind(f"{cls.__module__}.{cls.__qualname__}: ")
        if position >= 0 and (found is None or position > found[1]):
            found = (cls, position, len(f"{cls.__module__}.{cls.__qualname__}: "))
    if found is None:
        return None
    cls, position, prefix = found
    message = text[position + prefix :].strip()
    return RunInterrupted(message) if cls is RunInterrupted else UsageError(message)


def _actor_death_message(exc: BaseException, save: str | None) -> str:
    """What the user reads when an actor of the run died: which one, and how to go on."""
    named = re.search(r"class_name: (\w+)", str(exc))
    actor = f"the {named.group(1)} actor" if named else "an actor of the run"
    if not save:
        return f"{actor} died, so the run stopped (it saves no checkpoints: rerun it to start over)"
    return (
        f"{actor} died, so the run stopped; what it committed is intact: rerun the same command to resume from its "
        f"last joint commit (`slime-run runs {save}` shows which step that is)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
