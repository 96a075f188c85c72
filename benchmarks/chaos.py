"""`python -m benchmarks.chaos`: what machine failures cost the CPU demo, and whether its exactly-once audit holds.

Side by side in one run, on one machine:

- Uninterrupted: the demo (`slime-run --plugin straw`, `--num-rollout --steps`, a commit every `--save-interval`
  steps) from a fresh save directory, timed from start to exit.
- Chaos: the same command killed `--kills` times like a machine failure (every process of the run SIGKILLed at
  once, seeded: the first between the first trained step and the first commit, then about a third during
  start-up and the others within two steps after the run's next joint commit; see `slime.testing.chaos`),
  rerun with the same command after each kill, and finally run to its end. Timed from the first start to the
  last exit.

The report gives the time lost per kill, `(chaos time - uninterrupted time) / kills` (the restart, plus the work
since the last commit that the kill threw away), the kills per phase, the
pool's largest size during the chaos run against the uninterrupted run's, and the result of `slime-run runs
audit` on the chaos run's save directory. Numbers are reported, never asserted. The JSON report goes to `--out`
(default `benchmarks/results/chaos.json`) with a markdown table, which is printed too; see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.e2e import RUN_TIMEOUT_S, demo_args, machine_description, write_report
from slime.testing.chaos import KillPlan, directory_bytes, run_with_kills
from slime.utils.external_utils.slime_run_process import SlimeRunProcess


def _log(message: str) -> None:
    print(f"[chaos] {message}", file=sys.stderr, flush=True)


def _timed_run(args: list[str], save: Path, log: Path) -> float:
    started = time.monotonic()
    SlimeRunProcess(args, log, cwd=save.parent).finish(RUN_TIMEOUT_S)
    return time.monotonic() - started


def _audit(save: Path) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "slime.cli", "runs", "audit", str(save)], capture_output=True, text=True, timeout=600
    )
    return {"returncode": result.returncode, "output": result.stdout + result.stderr}


def build_table(report: dict[str, Any]) -> str:
    chaos, plain = report["chaos"], report["uninterrupted"]
    rows = [
        "| measurement | value |",
        "|---|---|",
        f"| steps, commit interval | {report['config']['steps']}, every {report['config']['save_interval']} |",
        f"| uninterrupted run | {plain['seconds']:.0f} s |",
        f"| chaos run ({chaos['kills']} kills, then to the end) | {chaos['seconds']:.0f} s |",
        f"| time lost per kill | {chaos['lost_per_kill_s']:.1f} s |",
        f"| kills by phase | {', '.join(f'{phase} {count}' for phase, count in chaos['kills_by_phase'].items())} |",
        f"| largest pool: chaos / uninterrupted | {chaos['max_pool_bytes'] / 2**20:.1f} MiB / "
        f"{plain['pool_bytes'] / 2**20:.1f} MiB |",
        f"| `runs audit` on the chaos run | exit {report['audit']['returncode']} |",
    ]
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=30, help="machine-failure kills (default 30)")
    parser.add_argument(
        "--steps",
        type=int,
        default=80,
        help="--num-rollout of both runs; each after-commit kill needs a commit more (default 80)",
    )
    parser.add_argument("--save-interval", type=int, default=2, help="joint commit every N steps (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill instants (default 0)")
    parser.add_argument("--out", default="benchmarks/results/chaos.json", help="JSON report")
    parser.add_argument("--dir", default=None, help="where the runs' save directories go (default: a temp dir)")
    options = parser.parse_args(argv)
    if options.kills < 1 or options.steps < 1:
        parser.error("--kills and --steps must be at least 1")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="slime-chaos-bench-", dir=options.dir))
    report: dict[str, Any] = {
        "machine": machine_description(),
        "config": {key: getattr(options, key) for key in ("kills", "steps", "save_interval", "seed")},
    }
    plain_save = workdir / "uninterrupted"
    _log(f"uninterrupted: {options.steps} steps")
    plain_seconds = _timed_run(
        demo_args("straw", options.steps, plain_save, options.save_interval), plain_save, workdir / "uninterrupted.log"
    )
    report["uninterrupted"] = {"seconds": plain_seconds, "pool_bytes": directory_bytes(plain_save / "rollout_data")}

    save = workdir / "chaos"
    args = demo_args("straw", options.steps, save, options.save_interval)
    log = workdir / "chaos.log"
    _log(f"chaos: {options.kills} kills")
    started = time.monotonic()
    kills = run_with_kills(args, save, log, KillPlan(kills=options.kills, seed=options.seed))
    SlimeRunProcess(args, log, cwd=workdir).finish(RUN_TIMEOUT_S)
    seconds = time.monotonic() - started
    report["chaos"] = {
        "kills": len(kills),
        "seconds": seconds,
        "lost_per_kill_s": (seconds - plain_seconds) / len(kills),
        "kills_by_phase": dict(Counter(kill.phase for kill in kills)),
        "max_pool_bytes": max([kill.pool_bytes for kill in kills] + [directory_bytes(save / "rollout_data")]),
        "per_kill": [kill.__dict__ for kill in kills],
    }
    _log("auditing the chaos run")
    report["audit"] = _audit(save)
    report["table"] = build_table(report)
    write_report(report, options.out)
    _log(f"done in {time.monotonic() - started + plain_seconds:.0f} s; runs kept under {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
