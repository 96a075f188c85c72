"""`python -m benchmarks.e2e`: step time of the CPU demo per transport, its breakdown, the floor, and resume time.

Side by side in one run, on one machine (ARCHITECTURE.md §9):

- The demo (`slime-run`, built-in tiny model and copy task, two CPU engines, torch trainer) runs `--steps`
  rollout steps with each transport, `straw` and `object-store`, from a fresh save directory; repetitions
  alternate the order. Each step's phase times come from the run's own `metrics.jsonl` (`perf/*`, written by
  the rollout manager and the driver): generate (the rollout function: engines generating, rewards, and with
  straw the groups' publication while generating), store (making the step's data available to the trainers:
  straw's accept, batch publication and per-rank references; the object store's `ray.put`s), convert (reward
  normalisation and training columns), train (of which: the trainers reading their shard through the
  transport), weight update, checkpoint (amortised over the steps), and the rest (Ray calls and bookkeeping).
  The first `--warmup` steps of every run are left out.
- The floor: the same model, task, GRPO loss and optimizer in one process without the framework
  (`benchmarks/demo_floor.py`: `model.generate` in the trainer's process, no Ray, no HTTP, no transport).
- The peer: TRL's `GRPOTrainer` on the same tiny model, task and batch shape in this process, when `trl` is
  installed (`benchmarks/trl_peer.py`; `--no-trl` skips it).
- Resume: a straw run is SIGKILLed (its whole process group) in the middle of the step after its first joint
  commit and started again with the same command; the report gives the seconds from the kill to the first
  new generation starting and to the first new step finished, next to a fresh run's start-up.

Numbers are reported, never asserted. The JSON report goes to `--out` (default
`benchmarks/results/e2e.json`) with a markdown table, which is printed too; see docs/benchmarks.md.
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
from pathlib import Path
from typing import Any

from benchmarks.trl_peer import measure_trl, trl_available
from slime.plugins.demo_report import read_metrics
from slime.utils.external_utils.slime_run_process import SlimeRunProcess

TRANSPORTS = ("straw", "object-store")
#: Phases of a step as they appear in the metrics (`perf/<name>_time`), in the order of a step.
PHASES = ("generate", "store", "convert", "train", "update_weights", "save")
RUN_TIMEOUT_S = 900
POLL_S = 0.1


def _log(message: str) -> None:
    print(f"[e2e] {message}", file=sys.stderr, flush=True)


def demo_args(transport: str, steps: int, save: Path, save_interval: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The `slime-run` arguments of one benchmark run: the built-in demo with `transport` (and `extra` options)."""
    return [
        *extra,
        "--rollout-data-transport",
        transport,
        "--num-rollout",
        str(steps),
        "--save-interval",
        str(save_interval),
        "--save",
        str(save),
    ]


def steps_from_metrics(path: Path) -> dict[int, dict[str, Any]]:
    """Every step's metrics merged from its lines (a later line of the same key wins)."""
    steps: dict[int, dict[str, Any]] = {}
    for record in read_metrics(path):
        steps.setdefault(int(record["step"]), {}).update(record)
    return dict(sorted(steps.items()))


def step_breakdown(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per step of each phase, of the whole step and of what no phase covers."""
    if not steps:
        raise ValueError("no measured steps: raise --steps above --warmup")
    count = len(steps)
    means = {name: sum(float(s.get(f"perf/{name}_time", 0.0)) for s in steps) / count for name in PHASES}
    means["train_data_load"] = sum(float(s.get("perf/train_data_load_time", 0.0)) for s in steps) / count
    means["step"] = sum(float(s["perf/step_time"]) for s in steps) / count
    means["other"] = means["step"] - sum(means[name] for name in PHASES)
    means["step_median"] = statistics.median(float(s["perf/step_time"]) for s in steps)
    return means


def run_demo(
    transport: str, steps: int, save_interval: int, workdir: Path, label: str, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One fresh demo run (with `extra` slime-run options); its per-step metrics and timestamps."""
    save = workdir / label
    log = workdir / f"{label}.log"
    argv = demo_args(transport, steps, save, save_interval, extra)
    _log(f"{label}: slime-run {' '.join(argv)}")
    run = SlimeRunProcess(argv, log, cwd=workdir)
    run.finish(RUN_TIMEOUT_S)
    per_step = steps_from_metrics(save / "metrics.jsonl")
    missing = [s for s in range(steps) if "perf/step_time" not in per_step.get(s, {})]
    if missing:
        raise RuntimeError(f"{label}: steps {missing} have no perf/step_time in {save / 'metrics.jsonl'}")
    first = per_step[0]
    return {
        "steps": per_step,
        "started_at": run.started,
        # The first generation began `rollout/time` seconds before its line was written.
        "startup_to_first_generation_s": first["time"] - first["rollout/time"] - run.started,
    }


def _first_commit(save: Path) -> int | None:
    steps = [int(p.stem.removeprefix("committed_")) for p in (save / "rollout").glob("committed_*.json")]
    return min(steps) if steps else None


def _wait_for(condition: Any, run: SlimeRunProcess, what: str) -> Any:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while (value := condition()) is None:
        if run.poll() is not None:
            raise RuntimeError(f"slime-run exited ({run.poll()}) before {what}; log tail:\n{run.log_tail()}")
        if time.monotonic() > deadline:
            run.kill()
            raise TimeoutError(f"no {what} within {RUN_TIMEOUT_S}s; log tail:\n{run.log_tail()}")
        time.sleep(POLL_S)
    return value


def measure_resume(steps: int, workdir: Path) -> dict[str, Any]:
    """Kill a straw run mid-step after its first commit, rerun it, time the way back to generating."""
    save = workdir / "resume"
    args = demo_args("straw", steps, save, save_interval=2)
    log = workdir / "resume.log"
    _log(f"resume: slime-run {' '.join(args)}; SIGKILL in the step after the first joint commit")
    first = SlimeRunProcess(args, log, cwd=workdir)
    commit = _wait_for(lambda: _first_commit(save), first, "a joint commit")
    metrics = save / "metrics.jsonl"

    def mid_step() -> int | None:
        # The next step has generated (its rollout line is written) and is training or saving.
        return 1 if "rollout/time" in steps_from_metrics(metrics).get(commit + 1, {}) else None

    _wait_for(mid_step, first, f"the rollout of step {commit + 1}")
    killed_at = first.kill()
    _log(f"resume: killed at step {commit + 1} (last commit: step {commit}); starting again")
    second = SlimeRunProcess(args, log, cwd=workdir)

    def first_new_step() -> dict[str, Any] | None:
        for record in read_metrics(metrics):
            if record["time"] > killed_at and "rollout/time" in record:
                return record
        return None

    record = _wait_for(first_new_step, second, "a generation after the restart")
    second.finish(RUN_TIMEOUT_S)
    step_end = next(
        r
        for r in read_metrics(metrics)
        if r["time"] > killed_at and r["step"] == record["step"] and "perf/step_time" in r
    )
    return {
        "steps": steps,
        "killed_in_step": commit + 1,
        "resumed_from_commit": commit,
        "first_new_step": record["step"],
        "kill_to_restart_s": second.started - killed_at,
        "kill_to_first_generation_s": record["time"] - record["rollout/time"] - killed_at,
        "kill_to_first_step_done_s": step_end["time"] - killed_at,
    }


def measure_floor(steps: int, warmup: int) -> dict[str, float]:
    from benchmarks.demo_floor import FloorConfig, run_floor

    records = run_floor(FloorConfig.from_demo(steps=steps))[warmup:]
    generate = sum(r.generate_s for r in records) / len(records)
    train = sum(r.train_s for r in records) / len(records)
    return {"generate": generate, "train": train, "step": generate + train}


def build_table(report: dict[str, Any]) -> str:
    peer = report.get("trl")
    rows = ["| measurement | straw | object-store | floor |" + (" TRL GRPOTrainer |" if peer else "")]
    rows.append("|---|---|---|---|" + ("---|" if peer else ""))
    straw, store = (report["transports"][t]["breakdown"] for t in TRANSPORTS)
    floor = report["floor"]
    names = [*PHASES[:4], "train_data_load", *PHASES[4:], "other", "step", "step_median"]
    labels = {"train_data_load": "  of which data load", "step": "step (mean)", "step_median": "step (median)"}
    for name in names:
        cells = [f"{straw[name] * 1000:.0f} ms", f"{store[name] * 1000:.0f} ms"]
        cells.append(f"{floor[name] * 1000:.0f} ms" if name in floor else "")
        if peer:
            cells.append(f"{peer['step'] * 1000:.0f} ms" if name == "step" else "")
        rows.append(f"| {labels.get(name, name)} | {' | '.join(cells)} |")
    ratios = report["ratios"]
    ratio_row = (
        f"| ratio | {ratios['straw_over_object_store']:.2f}x of object-store, "
        f"{ratios['straw_over_floor']:.1f}x of floor | {ratios['object_store_over_floor']:.1f}x of floor | 1x |"
    )
    if peer:
        ratio_row += f" {peer['step'] / floor['step']:.1f}x of floor; straw is {ratios['straw_over_trl']:.1f}x of it |"
    rows.append(ratio_row)
    resume = report.get("resume")
    if resume:
        rows.append(
            f"| resume (straw) | kill to first new generation {resume['kill_to_first_generation_s']:.1f} s, "
            f"to first step done {resume['kill_to_first_step_done_s']:.1f} s | fresh start to first generation "
            f"{report['transports']['straw']['startup_to_first_generation_s']:.1f} s | |"
        )
    return "\n".join(rows)


def write_report(report: dict[str, Any], out: str) -> Path:
    """Write `report` as JSON to `out` (its folder created) and print its markdown table; returns the path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=float))
    print(report["table"])
    return path


def machine_description() -> dict[str, Any]:
    """The machine and library versions a report was measured with."""
    from importlib.metadata import version

    import ray
    import torch

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "straw": version("straw-queue"),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="rollout steps per demo run (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out (default 2)")
    parser.add_argument("--reps", type=int, default=1, help="demo runs per transport, alternating (default 1)")
    parser.add_argument("--save-interval", type=int, default=10, help="joint commit every N steps (default 10)")
    parser.add_argument("--resume-steps", type=int, default=6, help="steps of the kill-and-resume run (default 6)")
    parser.add_argument("--no-resume", action="store_true", help="skip the kill-and-resume measurement")
    parser.add_argument(
        "--no-trl",
        dest="trl",
        action="store_false",
        help="skip the TRL GRPOTrainer row (measured when `trl` is installed; benchmarks/trl_peer.py)",
    )
    parser.add_argument("--quick", action="store_true", help="3 steps, 1 warm-up, 4-step resume: a smoke run")
    parser.add_argument("--out", default="benchmarks/results/e2e.json", help="JSON report")
    parser.add_argument("--dir", default=None, help="where the runs' save directories go (default: a temp dir)")
    options = parser.parse_args(argv)
    if options.quick:
        options.steps, options.warmup, options.resume_steps, options.save_interval = 3, 1, 4, 10
    if options.reps < 1:
        parser.error("--reps must be at least 1")
    if options.steps <= options.warmup:
        parser.error(f"--steps ({options.steps}) must exceed --warmup ({options.warmup})")
    if options.resume_steps < 4:
        parser.error("--resume-steps must be at least 4 (commit at step 1, kill in step 2, finish after)")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="slime-e2e-bench-", dir=options.dir))
    began = time.monotonic()
    try:
        report: dict[str, Any] = {
            "machine": machine_description(),
            "config": {key: getattr(options, key) for key in ("steps", "warmup", "reps", "save_interval")},
            "transports": {},
        }
        measured: dict[str, list[dict[str, Any]]] = {t: [] for t in TRANSPORTS}
        startup: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
        for rep in range(options.reps):
            order = TRANSPORTS if rep % 2 == 0 else TRANSPORTS[::-1]
            for transport in order:
                run = run_demo(transport, options.steps, options.save_interval, workdir, f"{transport}-{rep}")
                measured[transport].extend(s for i, s in run["steps"].items() if i >= options.warmup)
                startup[transport].append(run["startup_to_first_generation_s"])
        for transport in TRANSPORTS:
            report["transports"][transport] = {
                "breakdown": step_breakdown(measured[transport]),
                "startup_to_first_generation_s": statistics.median(startup[transport]),
                "measured_steps": len(measured[transport]),
                "step_times_s": [s["perf/step_time"] for s in measured[transport]],
            }
        _log(f"floor: {options.steps} steps in this process")
        report["floor"] = measure_floor(options.steps, options.warmup)
        straw, store = (report["transports"][t]["breakdown"]["step"] for t in TRANSPORTS)
        floor = report["floor"]["step"]
        report["ratios"] = {
            "straw_over_object_store": straw / store,
            "straw_over_floor": straw / floor,
            "object_store_over_floor": store / floor,
        }
        if options.trl and trl_available():
            _log(f"TRL GRPOTrainer: {options.steps} demo-shaped steps in this process")
            report["trl"] = measure_trl(options.steps, options.warmup)
            report["ratios"]["straw_over_trl"] = straw / report["trl"]["step"]
        elif options.trl:
            _log("TRL is not installed (pip install trl): no peer row")
        if not options.no_resume:
            report["resume"] = measure_resume(options.resume_steps, workdir)
        report["elapsed_s"] = time.monotonic() - began
        report["table"] = build_table(report)
        out = write_report(report, options.out)
        _log(f"report: {out} ({report['elapsed_s']:.0f} s)")
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
