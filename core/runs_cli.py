"""`slime-run runs DIR` and `slime-run runs audit DIR`: read-only inspection of a save directory.

`runs DIR` lists the branches reruns created, the joint commits of each (complete or torn), the current branch,
the lineage the current model descends from, what a rerun of the same command would do, and the straw pool's
size. `runs audit DIR` proves from the durable records that the lineage trained every prompt group it issued
exactly once (or dropped it with a recorded reason) and no sample twice. Both read only the save directory and
its pool; neither starts Ray nor writes anything.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from slime.data.durable_files import DurableFileError

DESCRIPTION = """\
Inspect a slime-run save directory (the --save of a run) without changing it.

  slime-run runs DIR          branches, joint commits per branch (complete or torn), the current branch, the
                              lineage, what rerunning the same command would do, and the straw pool's size
                              and what garbage collection may reclaim
  slime-run runs audit DIR    prove from the durable records (commit markers, queue snapshots, the queue
                              journals, batch plans and converted batches) that every prompt group issued up to
                              the last commit was trained exactly once or dropped with a recorded reason, that
                              no sample was trained twice, and that every step trained the batch its plan recorded

Exit status: 0 clean; 1 problems found (runs: damaged records; audit: a violation, the first one is printed
with the records that show it); 2 DIR is not a readable save directory.
"""

_RULE_WIDTH = 100


def _bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> list[str]:
    cells = [list(headers), *[[str(cell) for cell in row] for row in rows]]
    widths = [max(len(row[column]) for row in cells) for column in range(len(headers))]
    return [
        indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in cells
    ]


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(item) for item in value]
    return value


# ------------------------------------------------------------------------------------------- runs DIR


def format_inspection(report: Any) -> str:
    """The plain-text report of `slime-run runs DIR`."""
    save = report.save
    lines = [f"save directory  {save}"]
    current = next((branch.name for branch in report.branches if branch.current), None)
    tracker = f"tracker: step {report.tracker}" if report.tracker else "no tracker"
    lines.append(f"current branch  {current or '-'}  (rollout/current.json; {tracker})")
    lines += ["", "BRANCHES (oldest first; * = current)"]
    rows = []
    for branch in report.branches:
        parent = branch.parent
        parent_text = "-"
        if parent:
            names = {b.directory: b.name for b in report.branches}
            parent_text = f"{names.get(Path(parent['directory']).resolve(), parent['directory'])} step {parent['step']}"
        steps = branch.lineage_steps
        lineage_text = "-" if steps is None else (f"steps {steps[0]}..{steps[1]}" if steps[1] >= steps[0] else "none")
        rows.append(
            [
                "*" if branch.current else " ",
                branch.name,
                branch.created or "-",
                parent_text,
                "-" if branch.sessions is None else branch.sessions,
                len(branch.commits),
                lineage_text,
            ]
        )
    table = _table(["", "BRANCH", "CREATED", "PARENT", "SESSIONS", "COMMITS", "LINEAGE"], rows)
    lines.append(table[0])
    for branch, row in zip(report.branches, table[1:], strict=True):
        lines += [row, f"         why: {branch.reason}"]
    lines += ["", "JOINT COMMITS"]
    rows = []
    for branch in report.branches:
        for commit in branch.commits:
            parts = commit.components
            model = parts.get("model", [0, 0])
            rows.append(
                [
                    branch.name,
                    commit.step,
                    "complete" if commit.complete else "TORN",
                    "yes" if commit.resumable else "no",
                    f"{model[0]} files {_bytes(model[1])}",
                    _bytes(parts.get("queue_state", [0, 0])[1]),
                    _bytes(parts.get("builder_state", [0, 0])[1]),
                    _bytes(commit.total_bytes),
                ]
            )
    if rows:
        lines += _table(["BRANCH", "STEP", "STATE", "RESUMABLE", "MODEL", "QUEUE", "BUILDER", "TOTAL"], rows)
    else:
        lines.append("  none")
    for branch in report.branches:
        if branch.uncommitted:
            steps = ", ".join(map(str, branch.uncommitted))
            lines.append(
                f"  {branch.name}: step {steps} saved partly without a commit marker (a save that never finished)"
            )
    lines += ["", "LINEAGE (what the current branch's model trained, oldest first)", "  " + " -> ".join(report.lineage)]
    lines += ["", "A RERUN OF THE SAME COMMAND WOULD", f"  {report.rerun.action}: {report.rerun.detail}"]
    for pool in report.pools:
        lines += [
            "",
            f"STRAW POOL {pool.path}: {_bytes(pool.total_bytes)} in {pool.packs} packs, {len(pool.queues)} queues",
        ]
        rows = [
            [
                queue["queue_id"],
                queue["branch"] or "(none)",
                "yes" if queue["in_lineage"] else "no",
                _bytes(queue["held_bytes"]),
            ]
            for queue in pool.queues
        ]
        if rows:
            lines += _table(["QUEUE", "BRANCH", "IN LINEAGE", "PACKS IT REFERENCES"], rows)
        lines.append(
            f"  GC may reclaim: {_bytes(pool.unreferenced_bytes)} in {len(pool.unreferenced)} files that no queue "
            "journal or commit references (straw's offline cleanup deletes them once nothing runs); "
            f"{_bytes(pool.outside_lineage_bytes)} held only by queues of branches outside the lineage"
        )
    lines += ["", "PROBLEMS" if report.problems else "PROBLEMS: none"]
    lines += [f"  {problem}" for problem in report.problems]
    return "\n".join(lines)


def _show(directory: str, as_json: bool) -> int:
    from slime.data.run_inspection import inspect_run

    report = inspect_run(Path(directory))
    if as_json:
        print(json.dumps(_jsonable(asdict(report)), indent=2))
    else:
        print(format_inspection(report))
    return 1 if report.problems else 0


# ------------------------------------------------------------------------------------------- runs audit DIR


def format_audit(report: Any) -> str:
    """The plain-text report of `slime-run runs audit DIR`."""
    counts = report.counts
    lines = [f"audit of {report.save}", "lineage: " + " -> ".join(report.lineage), ""]
    rows = [
        ["branches in lineage", counts["branches in lineage"]],
        ["commits verified", counts["commits verified"]],
        ["steps verified (plan, collection, batch)", counts["steps verified"]],
        ["prompt groups issued", counts["prompt groups issued"]],
        ["  trained exactly once", counts["prompt groups trained once"]],
        ["  dropped with a recorded reason", counts["prompt groups dropped"]],
        ["  pending at the last commit", counts["prompt groups pending at the last commit"]],
        ["samples trained (each once)", counts["samples trained"]],
        ["accepted queue positions accounted", counts["accepted positions accounted"]],
        ["abandoned batch attempts skipped", counts["abandoned batch attempts"]],
    ]
    lines += _table(["", ""], rows)[1:]
    for reason, count in sorted(report.dropped.items()):
        lines.append(f"  dropped because {reason!r}: {count}")
    lines.append("")
    if report.clean and not counts["commits verified"]:
        lines.append("result: nothing committed yet, nothing to audit")
    elif report.clean:
        lines.append(
            "result: CLEAN: every prompt group issued up to the last commit was trained exactly once, dropped with "
            "a recorded reason or is pending; no sample was trained twice; every step trained the batch its plan "
            "recorded"
        )
    else:
        first = report.violations[0]
        lines += [
            f"result: VIOLATION ({len(report.violations)} found); the first:",
            f"  [{first.check}] {first.message}",
        ]
        if first.records:
            lines.append("  records:")
            lines += [f"    {record}" for record in first.records]
    return "\n".join(lines)


def _audit(directory: str, as_json: bool) -> int:
    from slime.data.lineage_audit import audit_run

    report = audit_run(Path(directory))
    if as_json:
        value = {
            "save": str(report.save),
            "lineage": report.lineage,
            "counts": dict(report.counts),
            "dropped": dict(report.dropped),
            "clean": report.clean,
            "violations": [asdict(violation) for violation in report.violations],
        }
        print(json.dumps(_jsonable(value), indent=2))
    else:
        print(format_audit(report))
    return 0 if report.clean else 1


# ------------------------------------------------------------------------------------------- entry point


def _parser(audit: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slime-run runs audit" if audit else "slime-run runs",
        usage="slime-run runs [audit] DIR [--json]",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("directory", metavar="DIR", help="the --save directory of a run")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text (for tools)")
    return parser


def run_runs_cli(argv: Sequence[str]) -> int:
    """`slime-run runs ...` with `argv` the words after `runs`; returns the exit status."""
    argv = list(argv)
    audit = bool(argv) and argv[0] == "audit"
    ns = _parser(audit).parse_args(argv[1:] if audit else argv)
    try:
        return _audit(ns.directory, ns.json) if audit else _show(ns.directory, ns.json)
    except DurableFileError as exc:
        print(f"slime-run: error: {exc}", file=sys.stderr)
        return 2
