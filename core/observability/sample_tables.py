"""Rollout sample tables for experiment trackers: which steps get one, and its columns and markdown form.

The driver hands observers a few of each step's answers (`slime_after_rollout(..., samples)`, rows built by
`logging_utils.rollout_examples`). A tracker logs them as a table every `--log-interval` steps, the console's
summary cadence, so a person reading the tracker sees what the policy answers as the reward moves.
"""

from __future__ import annotations

from typing import Any

#: A table's columns, in order: the step, then the fields of a `rollout_examples` row.
COLUMNS = ("step", "group", "prompt", "response", "reward")


def table_due(args: Any, rollout_id: int) -> bool:
    """True at the steps that log a sample table: 0, then every `--log-interval` steps (default 10)."""
    interval = int(getattr(args, "log_interval", None) or 10)
    return rollout_id % interval == 0


def table_rows(rollout_id: int, samples: list[dict[str, Any]]) -> list[list[Any]]:
    """`samples` as rows of `COLUMNS`."""
    return [[rollout_id, *(row.get(column) for column in COLUMNS[1:])] for row in samples]


def _cell(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n")


def as_markdown(rollout_id: int, samples: list[dict[str, Any]]) -> str:
    """`samples` as a markdown table (a cell's `|` and newlines escaped), for trackers that show text."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in table_rows(rollout_id, samples)]
    return "\n".join(lines)
