"""A slime-rl observer plugin: a run's metrics in one Weights & Biases run (`--use-wandb`), across kills and reruns.

All hooks run in the driver (the `slime-run` process). Every hook call becomes one wandb row holding its
metrics and `rollout_step` (= the rollout id); every metric is plotted against `rollout_step`
(`define_metric("*", step_metric="rollout_step")`). Rows are committed as they are logged, so a killed run
keeps what it handed to wandb. Every `--log-interval` steps the rollout row also holds `rollout/samples`, a table of
a few of the step's answers (step, group, prompt, response, reward). The run's configuration (`vars(args)`,
JSON-safe, secrets redacted) is the wandb config. The run is finished at the last step.

Resume: the first start writes the wandb run id to `--wandb-run-file` (default `<save>/wandb_run.json`; temp
file, fsync, rename). A rerun of the same command reads it and continues the same wandb run (`resume="allow"`;
`--wandb-run-id` names one explicitly). wandb keeps a run's rows in order and never replaces one, so the file
also records, per kind of hook call (rollout, train, eval, checkpoint, perf), the last rollout step logged and
wandb's next row number: a rerun skips the calls for steps the killed run already logged (those keep the killed
run's values; with `--deterministic` they are the same) and logs the rest, so each step has one value per
metric. The record is written before the row is handed to wandb: a kill in between can lose that one row,
never duplicate it.

Failures: a run that cannot start (no network in online mode, no API key, ...) or log is reported once as a
warning naming the fix (`--wandb-mode offline`, `--wandb-key`) and training goes on without wandb; the core's
metrics.jsonl is written regardless. Bad flags are refused at parse time.

Nothing happens (wandb is not even imported) unless `--use-wandb` is given.
"""

from __future__ import annotations

import argparse
import logging
import re
import secrets
from pathlib import Path
from typing import Any

from slime import hookimpl
from slime.observability.sample_tables import COLUMNS, table_due, table_rows
from slime.observability.tracker_values import (
    logged_steps,
    paths_under_save,
    read_run_file,
    run_config,
    scalars,
    write_run_file,
)

logger = logging.getLogger(__name__)

MODES = ("online", "offline", "disabled")
DEFAULT_SUBDIR = "wandb"
RUN_FILE = "wandb_run.json"
#: wandb run ids: letters, digits, `-` and `_` (they become part of URLs and file names).
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
STEP_METRIC = "rollout_step"
#: Seconds between wandb's writes of its local transaction log (`.wandb` file; wandb's default is 15): what a kill
#: can lose of the rows already handed to wandb.
FLUSH_INTERVAL_S = 0.2


def durable_record(wandb_dir: Path, run_id: str) -> dict[str, Any]:
    """What the offline segments of `run_id` hold on disk: `{"next_step", "logged": {kind: last rollout step}}`
    (an evaluation before the first step counts as `eval_initial`)."""
    from slime_wandb.offline import history

    rows = history(wandb_dir, run_id)
    next_step = max((int(row.get("_step", -1)) + 1 for row in rows), default=0)
    return {"next_step": next_step, "logged": logged_steps(rows, STEP_METRIC)}


@hookimpl
def slime_addoption(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("wandb (slime-wandb)")
    group.add_argument("--use-wandb", action="store_true", default=False, help="Log the run to Weights & Biases.")
    group.add_argument("--wandb-project", default=None, help="wandb project (default: wandb's own default).")
    group.add_argument("--wandb-group", default=None, help="wandb group of the run.")
    group.add_argument(
        "--wandb-key", default=None, help="wandb API key (default: WANDB_API_KEY or a wandb login); never logged."
    )
    group.add_argument(
        "--wandb-mode",
        default="online",
        metavar="{online,offline,disabled}",
        help="online (default), offline (files under --wandb-dir, `wandb sync` them later; needs no network) "
        "or disabled.",
    )
    group.add_argument(
        "--wandb-run-id",
        default=None,
        help="Continue (or create) this wandb run id (default: the id recorded in --wandb-run-file, else a new one).",
    )
    group.add_argument("--wandb-dir", default=None, help=f"wandb's files (default: <--save>/{DEFAULT_SUBDIR}).")
    group.add_argument(
        "--wandb-run-file",
        default=None,
        help=f"Where the run id and the steps already logged are kept for reruns (default: <--save>/{RUN_FILE}).",
    )
    group.add_argument(
        "--wandb-init-timeout",
        type=float,
        default=30.0,
        help="Seconds to wait for wandb to start the run before going on without it (default 30).",
    )


@hookimpl(trylast=True)
def slime_configure(args: argparse.Namespace) -> None:
    """Check the flags and settle `--wandb-dir` and `--wandb-run-file` from the logical `--save` (a resumed run moves
    `args.save` to a branch directory later). Runs last, after plugins that choose `--save`; touches no file."""
    if not getattr(args, "use_wandb", False):
        return
    mode = getattr(args, "wandb_mode", "online")
    if mode not in MODES:
        raise ValueError(f"--wandb-mode {mode!r} is not one of {', '.join(MODES)}; e.g. --wandb-mode offline")
    run_id = getattr(args, "wandb_run_id", None)
    if run_id is not None and not RUN_ID.fullmatch(run_id):
        raise ValueError(f"--wandb-run-id {run_id!r}: use 1-128 letters, digits, '-' or '_'")
    timeout = getattr(args, "wandb_init_timeout", 30.0)
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"--wandb-init-timeout must be a positive number of seconds, got {timeout!r}")
    paths_under_save(
        args,
        "--use-wandb",
        {"wandb_dir": ("--wandb-dir", DEFAULT_SUBDIR), "wandb_run_file": ("--wandb-run-file", RUN_FILE)},
    )


class WandbTracker:
    """The wandb run of one slime run (one `args`), started at the run's first hook."""

    def __init__(self, args: argparse.Namespace) -> None:
        import wandb

        self.args = args
        self.run_file = Path(args.wandb_run_file)
        num_rollout = getattr(args, "num_rollout", None)
        self.last_step = None if num_rollout is None else int(num_rollout) - 1
        record = read_run_file(self.run_file)
        run_id = getattr(args, "wandb_run_id", None) or record.get("run_id") or secrets.token_hex(4)
        if record.get("run_id") != run_id:  # a new run, or another one named with --wandb-run-id
            record = {"run_id": run_id, "next_step": 0, "logged": {}}
        elif args.wandb_mode == "offline":
            # wandb writes its file every FLUSH_INTERVAL_S: rows a kill lost are not on disk, though recorded.
            # What the files hold is what counts; steps the rerun trains again are logged again where lost.
            durable = durable_record(Path(args.wandb_dir), run_id)
            record = {**durable, "run_id": run_id, "next_step": max(durable["next_step"], record["next_step"])}
        self.record = record
        write_run_file(self.run_file, record)  # before wandb starts: a kill during start-up keeps the id
        directory = Path(args.wandb_dir)
        directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            init_timeout=float(args.wandb_init_timeout),
            console="off",  # leave the run's console (progress bar) alone
            silent=True,
            disable_git=True,
            save_code=False,
            x_transaction_log_flush_interval=FLUSH_INTERVAL_S,
            **({"api_key": args.wandb_key} if getattr(args, "wandb_key", None) else {}),
        )
        self.run = wandb.init(
            project=getattr(args, "wandb_project", None),
            group=getattr(args, "wandb_group", None),
            id=run_id,
            resume="allow",
            dir=str(directory),
            mode=args.wandb_mode,
            config=run_config(args),
            allow_val_change=True,
            reinit="create_new",
            settings=settings,
        )
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)
        self.closed = False

    def log(self, kind: str, rollout_id: int, values: dict[str, Any]) -> None:
        """One committed row for this hook call, unless the run (before a kill) already logged `kind` at this step."""
        logged = self.record.setdefault("logged", {})
        if not values or rollout_id <= logged.get(kind, -1):
            return
        step = max(int(self.record.get("next_step", 0)), int(self.run.step or 0))
        logged[kind] = rollout_id
        self.record["next_step"] = step + 1
        write_run_file(self.run_file, self.record)
        self.run.log({**values, STEP_METRIC: rollout_id}, step=step, commit=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.run.finish()


#: The tracker of each run's arguments, by `id(args)` (the driver passes the same object to every hook).
_trackers: dict[int, WandbTracker] = {}
#: Runs whose tracker failed: warned about once, then left alone.
_failed: set[int] = set()
#: Steps whose rollout was seen in this process: an eval at a step before its rollout is the initial evaluation.
_rollouts_seen: dict[int, set[int]] = {}


def _tracker(args: argparse.Namespace) -> WandbTracker | None:
    if not getattr(args, "use_wandb", False) or getattr(args, "wandb_mode", None) == "disabled":
        return None
    if id(args) in _failed:
        return None
    tracker = _trackers.get(id(args))
    if tracker is None or tracker.args is not args or tracker.closed:
        tracker = _trackers[id(args)] = WandbTracker(args)
    return tracker


def _guarded(args: argparse.Namespace, action: Any) -> None:
    """Run `action(tracker)`; an error disables wandb for this run with one warning: never crash a run."""
    try:
        tracker = _tracker(args)
        if tracker is not None:
            action(tracker)
    except Exception as exc:  # noqa: BLE001 - a tracker must never end a training run
        _failed.add(id(args))
        stale = _trackers.pop(id(args), None)
        mode = getattr(args, "wandb_mode", "online")
        fix = (
            "check the network and the API key (--wandb-key or WANDB_API_KEY), or log without a network with "
            "--wandb-mode offline and `wandb sync` the files later"
            if mode == "online"
            else f"check --wandb-dir {getattr(args, 'wandb_dir', None)} (space, permissions)"
        )
        logger.warning(
            "wandb (mode %s) failed: %s: %s; the run continues without wandb (metrics.jsonl is still written). "
            "Fix: %s.",
            mode,
            type(exc).__name__,
            exc,
            fix,
        )
        if stale is not None:
            try:
                stale.close()
            except Exception:  # noqa: BLE001 - already reported
                pass


def close(args: argparse.Namespace | None = None) -> None:
    """Finish the wandb run of `args` (every run when None) and forget it.

    When no run is left, wandb is torn down too: `run.finish()` returns before wandb's service has written the
    last rows to the run's `.wandb` file (measured: 2-3 of 30 short offline runs read back empty right after
    finish); `wandb.teardown()` waits for them, so whoever reads the files next (a rerun, `wandb sync`) sees
    every row."""
    finished = False
    for key in [id(args)] if args is not None else list(_trackers):
        tracker = _trackers.pop(key, None)
        if tracker is not None:
            tracker.close()
            finished = True
        _failed.discard(key)
        _rollouts_seen.pop(key, None)
    if finished and not _trackers:
        import wandb

        wandb.teardown()


@hookimpl
def slime_after_rollout(
    args: argparse.Namespace, rollout_id: int, metrics: dict[str, Any], samples: list[dict[str, Any]]
) -> None:
    if getattr(args, "use_wandb", False):
        _rollouts_seen.setdefault(id(args), set()).add(rollout_id)

    def log(tracker: WandbTracker) -> None:
        values: dict[str, Any] = scalars(metrics)
        if samples and table_due(args, rollout_id):
            import wandb

            values["rollout/samples"] = wandb.Table(columns=list(COLUMNS), data=table_rows(rollout_id, samples))
        tracker.log("rollout", rollout_id, values)

    _guarded(args, log)


@hookimpl
def slime_after_train_step(args: argparse.Namespace, rollout_id: int, metrics: dict[str, Any]) -> None:
    _guarded(args, lambda t: t.log("train", rollout_id, scalars(metrics, prefix="train")))


@hookimpl
def slime_after_eval(args: argparse.Namespace, rollout_id: int, metrics: dict[str, Any]) -> None:
    # The evaluation before the first step (step 0, no rollout yet) is its own kind: the one after step 0 follows.
    kind = "eval" if rollout_id in _rollouts_seen.get(id(args), set()) else "eval_initial"
    _guarded(args, lambda t: t.log(kind, rollout_id, scalars(metrics, prefix="eval")))


@hookimpl
def slime_checkpoint_committed(args: argparse.Namespace, rollout_id: int, path: str) -> None:
    _guarded(args, lambda t: t.log("checkpoint", rollout_id, {"checkpoint/committed": float(rollout_id)}))


@hookimpl
def slime_step_end(args: argparse.Namespace, rollout_id: int, metrics: dict[str, Any]) -> None:
    def end(tracker: WandbTracker) -> None:
        tracker.log("perf", rollout_id, scalars(metrics, prefix="perf"))
        if tracker.last_step is not None and rollout_id >= tracker.last_step:
            close(args)

    _guarded(args, end)
