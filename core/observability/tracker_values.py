"""What experiment-tracker plugins log, made loggable: numeric scalars of a hook's metrics, the run's
configuration with values JSON cannot hold turned into strings and secrets redacted, and, read back from a
tracker that keeps every row it is given, which steps each kind of hook call already logged (so a rerun after a
kill skips them). Also the files a tracker keeps beside the run: where they go (`paths_under_save`) and the small
JSON record that lets a rerun find its tracker run (`read_run_file`, `write_run_file`).

Shared by the tracker packages under contrib/ (TensorBoard, wandb, trackio), so each logs the same values under
the same names.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from slime.utils.atomic_files import write_atomically

#: Option names whose values never go into a logged configuration.
SECRET_MARKERS = ("key", "token", "secret", "password")


def scalars(metrics: dict[str, Any], prefix: str | None = None) -> dict[str, float]:
    """The numeric entries of `metrics` (booleans and non-numbers left out); with `prefix`, a key without a `/`
    becomes `prefix/key`."""
    found = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        found[f"{prefix}/{key}" if prefix and "/" not in key else key] = float(value)
    return found


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """`vars(args)` made JSON-safe: values JSON cannot hold become strings (NaN and infinities too), and options
    named like a secret (`*key*`, `*token*`, `*secret*`, `*password*`) are replaced with `"<redacted>"`."""

    def safe(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else str(value)
        if isinstance(value, (list, tuple)):
            return [safe(item) for item in value]
        if isinstance(value, dict):
            return {str(k): safe(v) for k, v in value.items()}
        return str(value)

    return {
        name: "<redacted>" if value and any(m in name.lower() for m in SECRET_MARKERS) else safe(value)
        for name, value in sorted(vars(args).items())
    }


def row_kind(row: dict[str, Any]) -> str:
    """Which hook call logged a tracker row, from its keys: checkpoint, train, eval, rollout or perf."""
    if "checkpoint/committed" in row:
        return "checkpoint"
    for prefix, kind in (("train/", "train"), ("eval/", "eval"), ("rollout/", "rollout")):
        if any(key.startswith(prefix) for key in row):
            return kind
    return "perf"


def logged_steps(rows: list[dict[str, Any]], step_key: str) -> dict[str, int]:
    """`{kind: last step logged}` of a tracker run's rows, each row's step under `step_key` (rows without one are
    left out); the evaluation before the first step (the first eval row at step 0) counts as `eval_initial`."""
    logged: dict[str, int] = {}
    for row in rows:
        if step_key not in row:
            continue
        kind, step = row_kind(row), int(row[step_key])
        if kind == "eval" and step == 0 and "eval_initial" not in logged:
            kind = "eval_initial"
        logged[kind] = max(logged.get(kind, -1), step)
    return logged


def paths_under_save(args: argparse.Namespace, enabling_flag: str, paths: dict[str, tuple[str, str]]) -> None:
    """Settle a tracker's path options, `{attribute: (flag, default name under --save)}`, to absolute paths: the
    value given, else `<--save>/<default name>`. Uses the logical `--save` (call from `slime_configure`: a resumed
    run moves `args.save` to a branch directory later). ValueError naming the flags when neither is given."""
    save = getattr(args, "save", None)
    root = Path(save).expanduser().resolve() if save else None
    for attribute, (flag, default) in paths.items():
        value = getattr(args, attribute, None)
        if value is None:
            if root is None:
                raise ValueError(
                    f"{enabling_flag} needs {flag} (or --save DIR, which puts it at DIR/{default}): a rerun finds the "
                    "run to continue there"
                )
            value = root / default
        setattr(args, attribute, str(Path(value).expanduser().resolve()))


def read_run_file(path: Path) -> dict[str, Any]:
    """A tracker's run record (empty when there is none yet)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def write_run_file(path: Path, record: dict[str, Any]) -> None:
    """Replace a tracker's run record atomically and durably (`write_atomically`: temporary file, fsync, rename)."""
    write_atomically(path, lambda handle: json.dump(record, handle, sort_keys=True), binary=False)
