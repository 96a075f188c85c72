"""What experiment-tracker plugins log, made loggable: numeric scalars of a hook's metrics, the run's
configuration with values JSON cannot hold turned into strings and secrets redacted, and, read back from a
tracker that keeps every row it is given, which steps each kind of hook call already logged (so a rerun after a
kill skips them).

Shared by the tracker packages under contrib/ (TensorBoard, wandb, trackio), so each logs the same values under
the same names.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

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
