"""`python -m benchmarks.determinism`: what `--deterministic` costs the CPU demo, both modes side by side in one run.

The demo (straw transport, two CPU engines, torch trainer) runs `--steps` rollout steps with `--deterministic`
and again with `--no-deterministic`, from fresh save directories; repetitions alternate which mode goes first, so
a change of load on the machine falls on both. Each step's phase times come from the run's `metrics.jsonl`, as in
`benchmarks/e2e.py`; the first `--warmup` steps of every run are left out. The report gives each mode's
breakdown and the ratio deterministic / non-deterministic per phase and for the whole step.

Numbers are reported, never asserted. The JSON report goes to `--out` (default
`benchmarks/results/determinism.json`) with a markdown table, which is printed too; see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.e2e import PHASES, machine_description, run_demo, step_breakdown, write_report

#: The two modes compared, as slime-run options.
MODES = {"deterministic": ("--deterministic",), "non-deterministic": ("--no-deterministic",)}
#: Rows of the table: the phases of a step, then the whole step.
ROWS = (*PHASES, "other", "step", "step_median")


def _log(message: str) -> None:
    print(f"[determinism] {message}", file=sys.stderr, flush=True)


def build_table(report: dict[str, Any]) -> str:
    """Markdown: each phase's mean time per step in both modes and their ratio."""
    on, off = (report["modes"][mode]["breakdown"] for mode in MODES)
    rows = ["| measurement | --deterministic | --no-deterministic | ratio |", "|---|---|---|---|"]
    labels = {"step": "step (mean)", "step_median": "step (median)"}
    for name in ROWS:
        ratio = f"{on[name] / off[name]:.2f}x" if off[name] > 0.001 else ""
        rows.append(f"| {labels.get(name, name)} | {on[name] * 1000:.0f} ms | {off[name] * 1000:.0f} ms | {ratio} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="rollout steps per demo run (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out (default 2)")
    parser.add_argument("--reps", type=int, default=2, help="demo runs per mode, alternating (default 2)")
    parser.add_argument("--save-interval", type=int, default=10, help="joint commit every N steps (default 10)")
    parser.add_argument("--quick", action="store_true", help="3 steps, 1 warm-up, 1 repetition: a smoke run")
    parser.add_argument("--out", default="benchmarks/results/determinism.json", help="JSON report")
    parser.add_argument("--dir", default=None, help="where the runs' save directories go (default: a temp dir)")
    options = parser.parse_args(argv)
    if options.quick:
        options.steps, options.warmup, options.reps = 3, 1, 1
    if options.reps < 1:
        parser.error("--reps must be at least 1")
    if options.steps <= options.warmup:
        parser.error(f"--steps ({options.steps}) must exceed --warmup ({options.warmup})")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="slime-determinism-bench-", dir=options.dir))
    began = time.monotonic()
    try:
        measured: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        for rep in range(options.reps):
            order = list(MODES) if rep % 2 == 0 else list(MODES)[::-1]
            for mode in order:
                run = run_demo(
                    "straw", options.steps, options.save_interval, workdir, f"{mode}-{rep}", extra=MODES[mode]
                )
                measured[mode].extend(s for i, s in run["steps"].items() if i >= options.warmup)
        report: dict[str, Any] = {
            "machine": machine_description(),
            "config": {key: getattr(options, key) for key in ("steps", "warmup", "reps", "save_interval")},
            "modes": {
                mode: {
                    "breakdown": step_breakdown(steps),
                    "measured_steps": len(steps),
                    "step_times_s": [s["perf/step_time"] for s in steps],
                }
                for mode, steps in measured.items()
            },
        }
        on, off = (report["modes"][mode]["breakdown"]["step"] for mode in MODES)
        report["step_ratio"] = on / off
        report["elapsed_s"] = time.monotonic() - began
        report["table"] = build_table(report)
        out = write_report(report, options.out)
        _log(f"report: {out} ({report['elapsed_s']:.0f} s); step ratio {report['step_ratio']:.2f}x")
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
