"""A slime-rl observer plugin: a run's metrics in one local-first trackio run (`--use-trackio`), across kills and
reruns.

trackio keeps its runs in SQLite databases under `TRACKIO_DIR` (here `--trackio-dir`, default `<save>/trackio`):
no account and no network; `trackio show` opens its dashboard on them. All hooks run in the driver (the
`slime-run` process). Every hook call becomes one trackio row at step = the rollout id, holding its metrics;
every `--log-interval` steps the rollout row also holds `rollout/samples`, a `trackio.Table` of a few of the
step's answers (step, group, prompt, response, reward). The run's configuration (`vars(args)`, JSON-safe, secrets
redacted) is the trackio config. The run is finished at the last step.

Resume: the first start writes the run's name to `--trackio-run-file` (default `<save>/trackio_run.json`; temp
file, fsync, rename) before trackio starts; a rerun of the same command reads it and continues the same run
(`resume="allow"`; `--trackio-run-name` names one explicitly). trackio keeps every row it is given, so at start
the tracker reads the run's rows back from trackio's database and, per kind of hook call (rollout, train, eval,
checkpoint, perf), skips the calls for steps already logged (those keep the killed run's values; with
`--deterministic` they are the same): each step has one value per metric. trackio writes its rows every 0.5 s;
rows a kill lost are not in the database, so a rerun that trains those steps again logs them.

Failures: a trackio that cannot start or log is reported once as a warning and training goes on without it; the
core's metrics.jsonl is written regardless. Bad flags are refused at parse time.

Nothing happens (trackio is not even imported) unless `--use-trackio` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import secrets
import subprocess
import sys
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

DEFAULT_PROJECT = "slime-rl"
DEFAULT_SUBDIR = "trackio"
RUN_FILE = "trackio_run.json"
#: Run names: letters, digits, `.`, `-` and `_` (trackio shows them in its dashboard and URLs).
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: What every row carries besides the metrics: the step the dashboard plots against.
STEP_KEY = "step"


def _use_directory(directory: Path) -> Any:
    """trackio, storing under `directory`: it reads `TRACKIO_DIR` once, when imported, so the first run of a process
    chooses; a later run of the same process with another directory is refused."""
    if "trackio" not in sys.modules:
        os.environ["TRACKIO_DIR"] = str(directory)
    import trackio
    from trackio import utils

    if Path(utils.TRACKIO_DIR).resolve() != directory.resolve():
        raise RuntimeError(
            f"trackio already stores under {utils.TRACKIO_DIR} in this process; --trackio-dir {directory} would "
            "need a new process"
        )
    return trackio


def logged_rows(directory: str | os.PathLike, project: str, run_name: str) -> list[dict[str, Any]]:
    """Every row trackio stored for `run_name` of `project` under `directory`, in order (each with its `step`).

    Read in this process when trackio here already stores under `directory`, else in a child process (trackio
    reads its directory once, at import)."""
    directory = Path(directory)
    if "trackio" not in sys.modules or _current_directory() == directory.resolve():
        trackio = _use_directory(directory)
        with contextlib.redirect_stdout(io.StringIO()):
            return trackio.SQLiteStorage.get_logs(project, run_name)
    code = (
        "import json, sys; from slime_trackio import logged_rows; "
        "print(json.dumps(logged_rows(sys.argv[1], sys.argv[2], sys.argv[3])))"
    )
    env = {**os.environ, "TRACKIO_DIR": str(directory)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(directory), project, run_name],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _current_directory() -> Path:
    from trackio import utils

    return Path(utils.TRACKIO_DIR).resolve()


@hookimpl
def slime_addoption(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("trackio (slime-trackio)")
    group.add_argument(
        "--use-trackio", action="store_true", default=False, help="Log the run to trackio (local, no account)."
    )
    group.add_argument("--trackio-project", default=DEFAULT_PROJECT, help="trackio project of the run.")
    group.add_argument(
        "--trackio-run-name",
        default=None,
        help="Continue (or create) this run (default: the name recorded in --trackio-run-file, else a new one).",
    )
    group.add_argument(
        "--trackio-dir", default=None, help=f"Where trackio stores its databases (default: <--save>/{DEFAULT_SUBDIR})."
    )
    group.add_argument(
        "--trackio-run-file",
        default=None,
        help=f"Where the run's name is kept for reruns (default: <--save>/{RUN_FILE}).",
    )


@hookimpl(trylast=True)
def slime_configure(args: argparse.Namespace) -> None:
    """Check the flags and settle `--trackio-dir` and `--trackio-run-file` from the logical `--save` (a resumed run
    moves `args.save` to a branch directory later). Runs last, after plugins that choose `--save`; touches no file."""
    if not getattr(args, "use_trackio", False):
        return
    project = getattr(args, "trackio_project", DEFAULT_PROJECT)
    if not project or not RUN_NAME.fullmatch(project):
        raise ValueError(f"--trackio-project {project!r}: use 1-128 letters, digits, '.', '-' or '_'")
    name = getattr(args, "trackio_run_name", None)
    if name is not None and not RUN_NAME.fullmatch(name):
        raise ValueError(f"--trackio-run-name {name!r}: use 1-128 letters, digits, '.', '-' or '_'")
    paths_under_save(
        args,
        "--use-trackio",
        {"trackio_dir": ("--trackio-dir", DEFAULT_SUBDIR), "trackio_run_file": ("--trackio-run-file", RUN_FILE)},
    )


class TrackioTracker:
    """The trackio run of one slime run (one `args`), started at the run's first hook."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        directory = Path(args.trackio_dir)
        directory.mkdir(parents=True, exist_ok=True)
        trackio = _use_directory(directory)
        self.trackio = trackio
        num_rollout = getattr(args, "num_rollout", None)
        self.last_step = None if num_rollout is None else int(num_rollout) - 1
        run_file = Path(args.trackio_run_file)
        record = read_run_file(run_file)
        project = args.trackio_project
        name = getattr(args, "trackio_run_name", None) or record.get("run_name") or f"slime-{secrets.token_hex(4)}"
        if record != {"project": project, "run_name": name}:
            write_run_file(run_file, {"project": project, "run_name": name})  # before trackio starts
        with contextlib.redirect_stdout(io.StringIO()) as said:
            self.logged = logged_steps(trackio.SQLiteStorage.get_logs(project, name), STEP_KEY)
            self.run = trackio.init(
                project=project,
                name=name,
                config=run_config(args),
                resume="allow",
                embed=False,
                auto_log_gpu=False,
                auto_log_cpu=False,
            )
        logger.debug("trackio: %s", said.getvalue().strip())
        self.closed = False

    def log(self, kind: str, rollout_id: int, values: dict[str, Any]) -> None:
        """One row for this hook call, unless the run (before a kill) already logged `kind` at this step."""
        if not values or rollout_id <= self.logged.get(kind, -1):
            return
        self.logged[kind] = rollout_id
        self.run.log(values, step=rollout_id)

    def close(self) -> None:
        """Finish the run: trackio writes the rows it still holds. Through `trackio.finish()` while it is trackio's
        current run, which also forgets it (trackio finishes its current run again at exit, printing again)."""
        if not self.closed:
            self.closed = True
            with contextlib.redirect_stdout(io.StringIO()):
                if self.trackio.context_vars.current_run.get() is self.run:
                    self.trackio.finish()
                else:
                    self.run.finish()


#: The tracker of each run's arguments, by `id(args)` (the driver passes the same object to every hook).
_trackers: dict[int, TrackioTracker] = {}
#: Runs whose tracker failed: warned about once, then left alone.
_failed: set[int] = set()
#: Steps whose rollout was seen in this process: an eval at a step before its rollout is the initial evaluation.
_rollouts_seen: dict[int, set[int]] = {}


def _tracker(args: argparse.Namespace) -> TrackioTracker | None:
    if not getattr(args, "use_trackio", False) or id(args) in _failed:
        return None
    tracker = _trackers.get(id(args))
    if tracker is None or tracker.args is not args or tracker.closed:
        tracker = _trackers[id(args)] = TrackioTracker(args)
    return tracker


def _guarded(args: argparse.Namespace, action: Any) -> None:
    """Run `action(tracker)`; an error disables trackio for this run with one warning: never crash a run."""
    try:
        tracker = _tracker(args)
        if tracker is not None:
            action(tracker)
    except Exception as exc:  # noqa: BLE001 - a tracker must never end a training run
        _failed.add(id(args))
        stale = _trackers.pop(id(args), None)
        logger.warning(
            "trackio failed: %s: %s; the run continues without trackio (metrics.jsonl is still written). "
            "Fix: check --trackio-dir %s (space, permissions).",
            type(exc).__name__,
            exc,
            getattr(args, "trackio_dir", None),
        )
        if stale is not None:
            try:
                stale.close()
            except Exception:  # noqa: BLE001 - already reported
                pass


def close(args: argparse.Namespace | None = None) -> None:
    """Finish the trackio run of `args` (every run when None) and forget it."""
    for key in [id(args)] if args is not None else list(_trackers):
        tracker = _trackers.pop(key, None)
        if tracker is not None:
            tracker.close()
        _failed.discard(key)
        _rollouts_seen.pop(key, None)


@hookimpl
def slime_after_rollout(
    args: argparse.Namespace, rollout_id: int, metrics: dict[str, Any], samples: list[dict[str, Any]]
) -> None:
    if getattr(args, "use_trackio", False):
        _rollouts_seen.setdefault(id(args), set()).add(rollout_id)

    def log(tracker: TrackioTracker) -> None:
        values: dict[str, Any] = scalars(metrics)
        if samples and table_due(args, rollout_id):
            values["rollout/samples"] = tracker.trackio.Table(
                columns=list(COLUMNS), data=table_rows(rollout_id, samples)
            )
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
    def end(tracker: TrackioTracker) -> None:
        tracker.log("perf", rollout_id, scalars(metrics, prefix="perf"))
        if tracker.last_step is not None and rollout_id >= tracker.last_step:
            close(args)

    _guarded(args, end)
