"""`python -m benchmarks.engines`: step time of the CPU demo on each rollout engine, side by side.

The demo (`slime-run`, straw transport, built-in tiny model and copy task, torch trainer, no router) runs `--steps`
rollout steps with `--rollout-engine cpu` and with `--rollout-engine sglang` (real SGLang servers on CPU), one run each
from a fresh save directory, in that order, on one machine; the first `--warmup` steps of each run are left out.
Each step's phase times come from the run's own `metrics.jsonl` (see benchmarks/e2e.py for the phases). The
engine start-up is reported separately (fresh start to the first generation).

Needs SGLang installed, so run it in the `sglang` nox session's environment:

    .nox/sglang/bin/python -m benchmarks.engines --steps 8

Numbers are reported, never asserted; the JSON report goes to `--out` with a markdown table (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.e2e import PHASES, machine_description, run_demo, step_breakdown, write_report

ENGINES = ("cpu", "sglang")


def build_table(report: dict[str, Any]) -> str:
    rows = ["| measurement | " + " | ".join(f"`{engine}` engine" for engine in ENGINES) + " |", "|---|---|---|"]
    names = [*PHASES, "other", "step", "step_median"]
    labels = {"step": "step (mean)", "step_median": "step (median)", "generate": "generate (rollout)"}
    for name in names:
        cells = [f"{report['engines'][engine]['breakdown'][name] * 1000:.0f} ms" for engine in ENGINES]
        rows.append(f"| {labels.get(name, name)} | {' | '.join(cells)} |")
    startup = [f"{report['engines'][engine]['startup_to_first_generation_s']:.1f} s" for engine in ENGINES]
    rows.append(f"| start to first generation | {' | '.join(startup)} |")
    ratio = report["ratios"]["sglang_over_cpu_step"]
    rows.append(f"| step ratio | 1x | {ratio:.2f}x of cpu |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="rollout steps per run (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out (default 2)")
    parser.add_argument("--engines", type=int, default=2, help="--rollout-num-engines of both runs (default 2)")
    parser.add_argument("--out", default="benchmarks/results/engines.json", help="JSON report")
    parser.add_argument("--dir", default=None, help="where the runs' save directories go (default: a temp dir)")
    options = parser.parse_args(argv)
    if options.steps <= options.warmup:
        parser.error(f"--steps ({options.steps}) must exceed --warmup ({options.warmup})")
    workdir = Path(tempfile.mkdtemp(prefix="slime-engine-bench-", dir=options.dir))
    began = time.monotonic()
    report: dict[str, Any] = {"machine": machine_description(), "config": vars(options), "engines": {}}
    for engine in ENGINES:
        extra = ("--rollout-engine", engine, "--rollout-num-engines", str(options.engines), "--rollout-router", "none")
        run = run_demo("straw", options.steps, options.steps, workdir, engine, extra)
        measured = [step for index, step in run["steps"].items() if index >= options.warmup]
        report["engines"][engine] = {
            "breakdown": step_breakdown(measured),
            "startup_to_first_generation_s": run["startup_to_first_generation_s"],
            "rewards": [run["steps"][index].get("rollout/reward") for index in sorted(run["steps"])],
        }
    cpu, sglang = (report["engines"][engine]["breakdown"]["step"] for engine in ENGINES)
    report["ratios"] = {"sglang_over_cpu_step": sglang / cpu}
    report["wall_s"] = time.monotonic() - began
    report["table"] = build_table(report)
    out = write_report(report, options.out)
    print(f"[engines] report: {out} ({report['wall_s']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
