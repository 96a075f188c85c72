"""`python -m benchmarks.startup`: seconds from `slime-run` to the demo's first generation, with a local Ray and on a
warm cluster.

Each repetition runs the built-in demo (straw, two CPU engines, the torch trainer) for one step from a fresh save
directory that already holds the demo's tiny model and prompts (as a rerun's does; building them is a first run's
one-time cost), with `--skip-eval-before-train`, so that the first generation is the first step's. The start-up is
from the `slime-run` process's start to that generation's start (the step's line in `metrics.jsonl`, less its
`rollout/time`). Two modes alternate within every repetition:

- `local`: the run starts its own Ray instance (what `slime-run` does by default);
- `cluster`: the run joins a Ray head started beforehand with `ray start` (`--ray-address`), so Ray's own start
  is not in the run's time.

The machine's load average is recorded at the start. Numbers are reported, never asserted. The JSON report goes to
`--out` (default `benchmarks/results/startup.json`) with a markdown table, which is printed too; see
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from benchmarks.e2e import steps_from_metrics
from slime.testing.ray_head import ray_head
from slime.utils.external_utils.slime_run_process import SlimeRunProcess

MODES = ("local", "cluster")
RUN_TIMEOUT_S = 600


def _log(message: str) -> None:
    print(f"[startup] {message}", file=sys.stderr, flush=True)


def prepare_demo_inputs(workdir: Path) -> Path:
    """Run the demo once for one step to build its model and prompts; returns that save directory."""
    seed = workdir / "seed"
    SlimeRunProcess(
        ["--plugin", "straw", "--num-rollout", "1", "--save", str(seed)], workdir / "seed.log", cwd=workdir
    ).finish(RUN_TIMEOUT_S)
    return seed


def timed_start(seed: Path, save: Path, log: Path, extra: list[str]) -> float:
    """One fresh one-step demo run in `save` (seeded with the model and prompts of `seed`); seconds from the
    process's start to its first generation."""
    save.mkdir(parents=True)
    for name in ("model", "prompts.jsonl", "eval_copy-unseen.jsonl", "eval_copy-all.jsonl"):
        source = seed / name
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, save / name)
    argv = ["--plugin", "straw", "--num-rollout", "1", "--skip-eval-before-train", "--save", str(save), *extra]
    run = SlimeRunProcess(argv, log, cwd=save.parent)
    run.finish(RUN_TIMEOUT_S)
    first = steps_from_metrics(save / "metrics.jsonl")[0]
    return float(first["time"]) - float(first["rollout/time"]) - run.started


def measure(repeats: int, modes: tuple[str, ...], workdir: Path) -> dict[str, Any]:
    seed = prepare_demo_inputs(workdir)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    with ray_head(num_cpus=os.cpu_count() or 2) if "cluster" in modes else nullcontext((None, None)) as (address, _):
        for repeat in range(repeats):
            order = modes if repeat % 2 == 0 else tuple(reversed(modes))
            for mode in order:
                extra = ["--ray-address", address] if mode == "cluster" else []
                label = f"{mode}-{repeat}"
                seconds = timed_start(seed, workdir / label, workdir / f"{label}.log", extra)
                times[mode].append(seconds)
                _log(f"{label}: first generation after {seconds:.1f} s")
    return {
        mode: {"runs_s": values, "median_s": statistics.median(values), "min_s": min(values)}
        for mode, values in times.items()
    }


def markdown(report: dict[str, Any]) -> str:
    rows = ["| Ray | start to first generation (median) | min | runs |", "|---|---|---|---|"]
    names = {"local": "started by the run", "cluster": "warm cluster joined (--ray-address)"}
    for mode in report["modes"]:
        result = report["modes"][mode]
        runs = ", ".join(f"{value:.1f}" for value in result["runs_s"])
        rows.append(f"| {names[mode]} | {result['median_s']:.1f} s | {result['min_s']:.1f} s | {runs} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode (default 3)")
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="which of local,cluster to measure, separated by commas (default both)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/startup.json"))
    args = parser.parse_args(argv)
    modes = tuple(mode.strip() for mode in args.modes.split(",") if mode.strip())
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes takes local, cluster or both, got {args.modes!r}")
    load = os.getloadavg()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="slime-startup-") as workdir:
        results = measure(args.repeats, modes, Path(workdir))
    report = {
        "modes": results,
        "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average_at_start": load},
        "started_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "wall_s": time.time() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"\nload average at start {load[0]:.2f}; report: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
