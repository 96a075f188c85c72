"""A slime-rl observer plugin: every scalar a run logs, as TensorBoard event files (`--use-tensorboard`).

All hooks run in the driver (the `slime-run` process). Each scalar is written at step = rollout id: rollout
metrics (`rollout/*`), the trainers' metrics (`train/*`, a bare name prefixed with `train/` as the built-in
report does), evaluation metrics (`eval/<name>/*`), the driver's phase times (`perf/*`) and committed
checkpoints (`checkpoint/committed`). The run's configuration is a text summary `config` (JSON) at the run's
first step; every `--log-interval` steps a few of the step's answers are the markdown text summary
`rollout/samples` (step, group, prompt, response, reward). Events are written and flushed at every hook call (a
killed run keeps what it logged) and the writer is closed at the last step.

Resume: a rerun of a killed run starts at `args.start_rollout_id` (its last commit + 1) and trains the steps
after that commit again. The writer reopens the same directory with `purge_step=start_rollout_id`: TensorBoard
then discards the killed run's events at steps >= that step, so every step shows the rerun's value once.

Nothing happens (no import of tensorboardX, no file) unless `--use-tensorboard` is given. A failure to write
(full or read-only storage, ...) is logged once as a warning and the run goes on without TensorBoard.

Install with `pip install -e contrib/slime-tensorboard`; slime-run loads it automatically (entry point group
`slime`, name `tensorboard`).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from slime import hookimpl
from slime.observability.tracker_values import run_config, scalars

logger = logging.getLogger(__name__)

#: The default event directory under `--save`.
DEFAULT_SUBDIR = "tensorboard"


@hookimpl
def slime_addoption(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tensorboard (slime-tensorboard)")
    group.add_argument(
        "--use-tensorboard",
        action="store_true",
        default=False,
        help="Write the run's scalars to TensorBoard event files (step = rollout id).",
    )
    group.add_argument(
        "--tensorboard-dir",
        default=None,
        help=f"Directory of the event files (default: <--save>/{DEFAULT_SUBDIR}); a rerun continues the same "
        "directory, discarding the killed run's events from the step it resumes at.",
    )


@hookimpl(trylast=True)
def slime_configure(args: argparse.Namespace) -> None:
    """Settle the event directory from the logical `--save`, before a resumed run moves `args.save` to a new
    branch directory (runs last, after plugins that choose `--save`). No file is touched here."""
    if not getattr(args, "use_tensorboard", False):
        return
    directory = getattr(args, "tensorboard_dir", None)
    if directory is None:
        save = getattr(args, "save", None)
        if not save:
            raise ValueError(
                "--use-tensorboard needs a directory for its event files: give --tensorboard-dir DIR "
                f"(or --save DIR, which puts them under DIR/{DEFAULT_SUBDIR})"
            )
        directory = Path(save).expanduser().resolve() / DEFAULT_SUBDIR
    elif not str(directory).strip():
        raise ValueError("--tensorboard-dir is empty; give a directory, e.g. --tensorboard-dir ./tensorboard")
    args.tensorboard_dir = str(Path(directory).expanduser().resolve())


class TensorboardTracker:
    """The event file of one run (one `args`), opened at the run's first hook.

    Events are written synchronously with tensorboardX's `EventsWriter` (its `SummaryWriter` queues events for a
    background thread, whose queue a kill loses even after `flush()`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.summary import text

        self.args = args
        self.directory = Path(args.tensorboard_dir)
        self.start = int(getattr(args, "start_rollout_id", 0) or 0)
        num_rollout = getattr(args, "num_rollout", None)
        self.last_step = None if num_rollout is None else int(num_rollout) - 1
        self.directory.mkdir(parents=True, exist_ok=True)
        # tensorboardX names the file by the second it starts; the suffix keeps two starts in one second apart and
        # in start order (TensorBoard reads a directory's files sorted by name).
        self.events = EventsWriter(str(self.directory / "events"), filename_suffix=f".{time.time_ns():020d}")
        # The purge: TensorBoard drops every event of earlier files at steps >= start. Written on every start, 0
        # included: a run killed before its first commit resumes at 0 and its earlier events must go too.
        self._write(Event(step=self.start, session_log=SessionLog(status=SessionLog.START)))
        config = json.dumps(run_config(args), indent=2, sort_keys=True)
        self._write(Event(step=self.start, summary=text("config", f"```json\n{config}\n```")))
        self.flush()
        self.closed = False

    def _write(self, event: Any) -> None:
        event.wall_time = time.time()
        self.events.write_event(event)

    def log(self, step: int, values: dict[str, float]) -> None:
        """One scalar summary event, tags as given (tensorboardX's `add_scalar` would rewrite `pass@4` to `pass_4`)."""
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        if values:
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
            self._write(Event(step=step, summary=summary))
            self.flush()  # each hook's events reach the file at once: a killed run keeps what it logged

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """A few of the step's answers as the markdown text summary `rollout/samples`."""
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import text

        from slime.observability.sample_tables import as_markdown

        if samples:
            self._write(Event(step=step, summary=text("rollout/samples", as_markdown(step, samples))))
            self.flush()

    def flush(self) -> None:
        self.events.flush()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.events.close()


#: The tracker of each run's arguments, by `id(args)` (the driver passes the same object to every hook).
_trackers: dict[int, TensorboardTracker] = {}
#: Runs whose tracker failed: warned about once, then left alone.
_failed: set[int] = set()


def _tracker(args: argparse.Namespace) -> TensorboardTracker | None:
    if not getattr(args, "use_tensorboard", False) or id(args) in _failed:
        return None
    tracker = _trackers.get(id(args))
    if tracker is None or tracker.args is not args or tracker.closed:
        tracker = _trackers[id(args)] = TensorboardTracker(args)
    return tracker


def _guarded(args: argparse.Namespace, action: Any) -> None:
    """Run `action(tracker)`; an error disables TensorBoard for this run with one warning: never crash a run."""
    try:
        tracker = _tracker(args)
        if tracker is not None:
            action(tracker)
    except Exception as exc:  # noqa: BLE001 - a tracker must never end a training run
        _failed.add(id(args))
        stale = _trackers.pop(id(args), None)
        logger.warning(
            "TensorBoard logging to %s failed (%s: %s); the run continues without it (metrics.jsonl is still "
            "written). Fix the directory (free space, permissions) or give another --tensorboard-dir.",
            getattr(args, "tensorboard_dir", None),
            type(exc).__name__,
            exc,
        )
        if stale is not None:
            try:
                stale.close()
            except Exception:  # noqa: BLE001 - already reported
                pass


def close(args: argparse.Namespace | None = None) -> None:
    """Close the writer of `args` (every writer when None) and forget it."""
    for key in [id(args)] if args is not None else list(_trackers):
        tracker = _trackers.pop(key, None)
        if tracker is not None:
            tracker.close()
        _failed.discard(key)


@hookimpl
def slime_after_rollout(
    args: argparse.Namespace, rollout_id: int, metrics: dict[str, Any], samples: list[dict[str, Any]]
) -> None:
    from slime.observability.sample_tables import table_due

    def log(tracker: TensorboardTracker) -> None:
        tracker.log(rollout_id, scalars(metrics))
        if table_due(args, rollout_id):
            tracker.log_samples(rollout_id, samples)

    _guarded(args, log)


@hookimpl
def slime_after_train_step(args: argparse.Namespace, rollout_id: int, metrics: dict[str, Any]) -> None:
    _guarded(args, lambda t: t.log(rollout_id, scalars(metrics, prefix="train")))


@hookimpl
def slime_after_eval(args: argparse.Namespace, rollout_id: int, metrics: dict[str, Any]) -> None:
    _guarded(args, lambda t: t.log(rollout_id, scalars(metrics, prefix="eval")))


@hookimpl
def slime_checkpoint_committed(args: argparse.Namespace, rollout_id: int, path: str) -> None:
    _guarded(args, lambda t: t.log(rollout_id, {"checkpoint/committed": float(rollout_id)}))


@hookimpl
def slime_step_end(args: argparse.Namespace, rollout_id: int, metrics: dict[str, Any]) -> None:
    def end(tracker: TensorboardTracker) -> None:
        tracker.log(rollout_id, scalars(metrics, prefix="perf"))
        if tracker.last_step is not None and rollout_id >= tracker.last_step:
            close(args)

    _guarded(args, end)
