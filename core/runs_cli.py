"""`slime-run runs DIR`, `runs audit DIR` and `runs compare A B`: read-only inspection of save directories.

`runs DIR` lists the branches reruns created, the joint commits of each (complete or torn), the current branch,
the lineage the current model descends from, what a rerun of the same command would do, and the straw pool's
size. `runs audit DIR` proves from the durable records that the lineage trained every prompt group it issued
exactly once (or dropped it with a recorded reason) and no sample twice. `runs compare A B` compares two runs
step by step (metrics, trained samples, final weights) and names the first step where they differ. All read
only the save directories and their pools; none starts Ray or writes anything.
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
Inspect slime-run save directories (the --save of a run) without changing them.

  slime-run runs DIR          branches, joint commits per branch (complete or torn), the current branch, the
                              lineage, what rerunning the same command would do, and the straw pool's size
                              and what garbage collection may reclaim
  slime-run runs audit DIR    prove from the durable records (commit markers, queue snapshots, the queue
                              journals, batch plans and converted batches) that every prompt group issued up to
                              the last commit was trained exactly once or dropped with a recorded reason, that
                              no sample was trained twice, and that every step trained the batch its plan recorded
  slime-run runs compare A B  compare two runs (the --save of each) step by step and name the first step
                              where they differ: the metrics both logged in metrics.jsonl (exactly, the last
                              value per step; timing keys such as perf/*, time and rollout/time left out), the
                              samples each committed step trained (ids and a sha256 of tokens, response and
                              reward; straw transport only) and the weights of the last checkpoint, tensor by
                              tensor. Ends with IDENTICAL or DIVERGE at step S and what differs there first

Exit status: 0 clean (compare: identical); 1 problems found (runs: damaged records; audit: a violation, the
first one is printed with the records that show it; compare: the runs diverge); 2 DIR is not a readable save
directory.
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
    commits = [(branch, commit) for branch in report.branches for commit in branch.commits]
    # A CRITIC column only for runs that train one (--use-critic): its files are a commit's second model.
    models = ["model", "critic"] if any("critic" in commit.components for _, commit in commits) else ["model"]
    rows = []
    for branch, commit in commits:
        parts = commit.components
        sizes = [parts.get(kind, [0, 0]) for kind in models]
        rows.append(
            [
                branch.name,
                commit.step,
                "complete" if commit.complete else "TORN",
                "yes" if commit.resumable else "no",
                *(f"{files} files {_bytes(size)}" for files, size in sizes),
                _bytes(parts.get("queue_state", [0, 0])[1]),
                _bytes(parts.get("builder_state", [0, 0])[1]),
                _bytes(commit.total_bytes),
            ]
        )
    if rows:
        headers = ["BRANCH", "STEP", "STATE", "RESUMABLE", *(kind.upper() for kind in models), "QUEUE", "BUILDER"]
        lines += _table([*headers, "TOTAL"], rows)
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


# ------------------------------------------------------------------------------------------- runs compare A B


def _number(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _keys(keys: Sequence[str]) -> str:
    """Metric keys for a line of text, each `perf/*` family collapsed into one entry."""
    from slime.data.run_comparison import TIMING_PREFIXES

    families = [prefix for prefix in TIMING_PREFIXES if any(key.startswith(prefix) for key in keys)]
    rest = [key for key in keys if not key.startswith(TIMING_PREFIXES)]
    return ", ".join([f"{prefix}*" for prefix in families] + rest) or "none"


def _weights_line(weights: Any) -> str:
    from slime.data.run_comparison import SHOWN_TENSORS

    if weights.outcome == "equal":
        line = f"step {weights.step} in both: {weights.tensors} tensors equal"
    elif weights.outcome == "differ" and weights.differing:
        shown = []
        for tensor in weights.differing[:SHOWN_TENSORS]:
            diff = tensor["max_abs_diff"]
            shown.append(f"{tensor['tensor']} ({tensor['problem'] if diff is None else f'max abs diff {diff:.6g}'})")
        more = ", ..." if len(weights.differing) > SHOWN_TENSORS else ""
        line = f"step {weights.step} in both: {len(weights.differing)} of {weights.tensors} tensors differ: "
        line += "; ".join(shown) + more
    else:
        return f"{'DIFFER' if weights.outcome == 'differ' else 'not compared'}: {weights.note}"
    return f"{line} ({weights.note})" if weights.note else line


def format_comparison(report: Any) -> str:
    """The plain-text report of `slime-run runs compare A B`."""
    from slime.data.run_comparison import LOSS_KEY, NOT_RECORDED, REWARD_KEY

    lines = [f"A: {report.a}", f"B: {report.b}"]
    lines.append(
        f"metrics: {len(report.compared_metrics)} keys both runs logged, compared exactly (the last value per step); "
        f"not compared (timing): {_keys(report.excluded_metrics)}"
    )
    for side, keys in (("A", report.only_in_a), ("B", report.only_in_b)):
        if keys:
            lines.append(f"  logged only by {side} (not compared): {_keys(keys)}")
    recorded = [report.samples_a == "recorded", report.samples_b == "recorded"]
    if all(recorded):
        lines.append("sample ids: recorded by both (the straw records of each committed step)")
    elif not any(recorded):
        lines.append(f"sample ids: {NOT_RECORDED}")
    else:
        missing = "B" if recorded[0] else "A"
        lines.append(f"sample ids: {NOT_RECORDED.replace('not recorded', f'not recorded in {missing}')}")
    lines.append(f"weights: {_weights_line(report.weights)}")
    rows = []
    for step in report.steps:
        samples = {"equal": f"equal ({step.sample_counts[0]})", "differ": "DIFFER"}.get(step.samples, "-")
        differing = list(step.differing_metrics)
        shown = ", ".join(differing[:2]) + (f" +{len(differing) - 2}" if len(differing) > 2 else "")
        rows.append(
            [
                step.step,
                _number(step.metrics_a.get(REWARD_KEY)),
                _number(step.metrics_b.get(REWARD_KEY)),
                _number(step.metrics_a.get(LOSS_KEY)),
                _number(step.metrics_b.get(LOSS_KEY)),
                samples,
                shown or "-",
            ]
        )
    headers = ["STEP", "REWARD A", "REWARD B", "LOSS A", "LOSS B", "SAMPLES", "METRICS THAT DIFFER"]
    lines += ["", *(_table(headers, rows) if rows else ["  no steps in either run"])]
    first = report.first_divergence
    if first is not None and first[0] is not None and len(first[1]) > 1:
        lines += ["", f"WHAT DIFFERS AT STEP {first[0]}"]
        lines += [f"  {difference}" for difference in first[1][:12]]
        if len(first[1]) > 12:
            lines.append(f"  ... and {len(first[1]) - 12} more (--json lists every step)")
    if report.notes:
        lines += ["", "NOTES", *[f"  {note}" for note in report.notes]]
    lines += ["", report.verdict()]
    return "\n".join(lines)


def _compare(directory_a: str, directory_b: str, as_json: bool) -> int:
    from slime.data.run_comparison import compare_runs

    report = compare_runs(Path(directory_a), Path(directory_b))
    if as_json:
        first = report.first_divergence
        value = {
            "a": report.a,
            "b": report.b,
            "identical": report.identical,
            "verdict": report.verdict(),
            "first_divergence": None if first is None else {"step": first[0], "differences": first[1]},
            "compared_metrics": report.compared_metrics,
            "excluded_metrics": report.excluded_metrics,
            "metrics_only_in_a": report.only_in_a,
            "metrics_only_in_b": report.only_in_b,
            "samples": {"a": report.samples_a, "b": report.samples_b},
            "steps": [asdict(step) for step in report.steps],
            "weights": asdict(report.weights),
            "notes": report.notes,
        }
        print(json.dumps(_jsonable(value), indent=2))
    else:
        print(format_comparison(report))
    return 0 if report.identical else 1


# ------------------------------------------------------------------------------------------- entry point

USAGE = "slime-run runs [audit] DIR [--json]\n       slime-run runs compare DIR_A DIR_B [--json]"


def _parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"slime-run runs {command}" if command else "slime-run runs",
        usage=USAGE,
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if command == "compare":
        parser.add_argument("directory_a", metavar="DIR_A", help="the --save directory of one run")
        parser.add_argument("directory_b", metavar="DIR_B", help="the --save directory of the run to compare it with")
    else:
        parser.add_argument("directory", metavar="DIR", help="the --save directory of a run")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text (for tools)")
    return parser


def run_runs_cli(argv: Sequence[str]) -> int:
    """`slime-run runs ...` with `argv` the words after `runs`; returns the exit status."""
    argv = list(argv)
    command = argv[0] if argv and argv[0] in ("audit", "compare") else None
    ns = _parser(command).parse_args(argv[1:] if command else argv)
    try:
        if command == "compare":
            return _compare(ns.directory_a, ns.directory_b, ns.json)
        return _audit(ns.directory, ns.json) if command == "audit" else _show(ns.directory, ns.json)
    except DurableFileError as exc:
        print(f"slime-run: error: {exc}", file=sys.stderr)
        return 2
