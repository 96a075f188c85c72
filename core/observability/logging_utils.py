"""Logging setup and metrics tracking as JSON lines (no external services).

Metrics go to `<--metrics-dir>/metrics.jsonl`, or `<--save>/metrics.jsonl` when only `--save` is set;
without either, metrics are logged only. Each line is one JSON object `{"step", "time", **metrics}`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_files: dict[str, Any] = {}
_files_lock = threading.Lock()

#: Libraries whose INFO lines are chatter on a run's console: kept at WARNING unless the run is `--verbose`.
CHATTY_LOGGERS = ("filelock", "huggingface_hub", "ray", "transformers", "urllib3")
#: Set, unless already set, by a run without `--verbose` before Ray starts (its workers inherit them): the
#: libraries' progress bars ("Loading weights", "Writing model shards") stay off in every process of the run.
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}


def configure_logger(level: int = logging.INFO, *, verbose: bool = False) -> None:
    """Give the root logger one stream handler with a timestamped format (idempotent); keep library chatter at
    WARNING and the run's own DEBUG lines (each step's metrics, each option the demo sets) off unless `verbose`."""
    root = logging.getLogger()
    if not any(getattr(handler, "_slime", False) for handler in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s %(name)s] %(message)s"))
        handler._slime = True
        root.addHandler(handler)
    root.setLevel(level)
    quiet = max(level, logging.WARNING)
    # One INFO line per HTTP request would drown the run's own log, verbose or not.
    logging.getLogger("httpx").setLevel(quiet)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else quiet)
    logging.getLogger("slime").setLevel(logging.DEBUG if verbose else logging.NOTSET)


def quiet_progress_bars() -> None:
    """Turn the libraries' progress bars off in this process and the Ray workers it starts (`QUIET_ENV`)."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)


def verbose_requested(argv: Sequence[str] | None) -> bool:
    """Whether the command line asks for `--verbose` (the flag itself is registered with the run's arguments), read
    before parsing so that parsing's own log lines (the demo's options) follow it."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--verbose", action="store_true")
    return pre.parse_known_args(argv)[0].verbose


def metrics_path(args: Any) -> Path | None:
    """Where metrics of this run are written, or None when the run has no metrics or save directory."""
    directory = getattr(args, "metrics_dir", None) or getattr(args, "save", None)
    return Path(directory).expanduser() / "metrics.jsonl" if directory else None


def init_tracking(args: Any, primary: bool = True) -> None:
    """Open the metrics file for appending (the primary process creates its directory)."""
    path = metrics_path(args)
    if path is None:
        return
    if primary:
        path.parent.mkdir(parents=True, exist_ok=True)
    _open(path)


def _open(path: Path) -> Any:
    key = str(path)
    with _files_lock:
        handle = _files.get(key)
        if handle is None or handle.closed:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = _files[key] = open(path, "a", encoding="utf-8")
        return handle


def log_metrics(args: Any, step: int, metrics: dict) -> None:
    """Append one metrics line (flushed and fsynced: metrics survive a killed run); the line is logged at DEBUG
    (shown with `--verbose`: the console's summary is the progress bar's, every `--log-interval` steps)."""
    logger.debug("step %s: %s", step, metrics)
    path = metrics_path(args)
    if path is None:
        return
    handle = _open(path)
    line = json.dumps({"step": step, "time": time.time(), **metrics}, default=float, sort_keys=True)
    with _files_lock:
        handle.write(line + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def finish_tracking(args: Any) -> None:
    """Close this run's metrics file."""
    path = metrics_path(args)
    if path is None:
        return
    with _files_lock:
        handle = _files.pop(str(path), None)
    if handle is not None:
        try:
            handle.close()
        except OSError as exc:  # a line whose write already failed (full or read-only storage) and was reported
            logger.warning("closing %s dropped a metrics line that could not be written: %s", path, exc)


def _mean(values: list) -> float | None:
    numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return sum(numbers) / len(numbers) if numbers else None


def log_rollout_data(rollout_id: int, args: Any, samples: list, metrics: dict | None, time_s: float) -> dict[str, Any]:
    """Log the reward and response-length statistics of one training rollout plus the rollout's own metrics;
    returns the logged record."""
    rewards = [sample.get_reward_value(args) for sample in samples]
    lengths = [sample.response_length for sample in samples]
    record: dict[str, Any] = {"rollout/time": time_s, "rollout/num_samples": len(samples)}
    if (reward := _mean(rewards)) is not None:
        record["rollout/reward"] = reward
    if (length := _mean(lengths)) is not None:
        record["rollout/response_length"] = length
    record.update(metrics or {})
    log_metrics(args, rollout_id, record)
    return record


#: Groups of a step whose first answer `rollout_examples` shows to observers (sample tables).
EXAMPLE_GROUPS = 4


def rollout_examples(samples: list, args: Any, groups: int = EXAMPLE_GROUPS) -> list[dict[str, Any]]:
    """The first answer of each of the first `groups` groups (by group index): prompt, response and reward."""
    first: dict[Any, Any] = {}
    for sample in samples:
        first.setdefault(sample.group_index, sample)
    chosen = sorted(first.items(), key=lambda item: (item[0] is None, item[0] if item[0] is not None else 0))
    return [
        {
            "group": group,
            "prompt": sample.prompt if isinstance(sample.prompt, str) else json.dumps(sample.prompt, default=str),
            "response": sample.response,
            "reward": sample.get_reward_value(args),
        }
        for group, sample in chosen[:groups]
    ]


def log_eval_rollout_data(rollout_id: int, args: Any, data: dict, metrics: dict | None) -> dict[str, Any]:
    """Log every evaluation dataset's metrics (`data[name]` holds its "rewards" and, from the built-in eval
    rollout, its scored "samples": `eval/<name>/reward`, and pass@k when prompts were sampled more than once)
    plus the eval rollout's own metrics; returns the logged record."""
    from slime.data.eval_data import eval_metrics

    record: dict[str, Any] = {}
    for name, values in (data or {}).items():
        if not isinstance(values, dict):
            continue
        rewards, samples = values.get("rewards", []), values.get("samples")
        if samples is not None and len(samples) == len(rewards):
            record.update(eval_metrics(name, samples, rewards))
        elif (reward := _mean(rewards)) is not None:
            record[f"eval/{name}/reward"] = reward
    record.update(metrics or {})
    log_metrics(args, rollout_id, record)
    return record
