"""`python -m benchmarks.scaling`: how the framework's cost grows as the work grows, per phase, straw against the
object store, in one run on one machine.

The CPU demo (`slime-run`, built-in tiny model and copy task, torch trainer) runs `--steps` rollout steps per
configuration from a fresh save directory, once per transport, along three axes:

- samples per step (`--samples`, default 128, 512, 2048: 16, 64 and 256 prompts of 8 samples) with 2 engines and
  1 trainer;
- engines (`--engines`, default 1, 2, 4) at 512 samples per step;
- trainers (`--trainers`, default 1, 2 data-parallel ranks) at 512 samples per step.

The configuration the axes share is run once. Every step's phase times come from the run's `metrics.jsonl`
(`perf/*`, see `benchmarks/e2e.py`); the first `--warmup` steps are left out, and evaluation is off so that steps
are alike; the last step is left out too (it evaluates the final weights and commits, once per run). Reported per
configuration: seconds per step and milliseconds per sample of each phase, where
"framework" is every phase but the model's own work (generate and the trainer's compute): storing the step's
data, converting it, the trainers' data load, the weight update, checkpoints and the rest. Along the samples axis
each phase's growth is fitted as time ~ samples^k (least squares on logarithms): k = 1 is linear, flat per-sample
cost; k > 1 grows faster than the work and is flagged.

Numbers are reported, never asserted. The JSON report goes to `--out` (default `benchmarks/results/scaling.json`)
with markdown tables, which are printed too; see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.e2e import PHASES, machine_description, run_demo, step_breakdown, write_report

TRANSPORTS = ("straw", "object-store")
SAMPLES_PER_PROMPT = 8
#: Phases that are the framework's, not the model's work (`train` minus its data load is the trainer's compute).
FRAMEWORK_PHASES = ("store", "convert", "train_data_load", "update_weights", "save", "other")
#: A phase whose fitted exponent exceeds this grows faster than the work.
SUPERLINEAR = 1.1


def _log(message: str) -> None:
    print(f"[scaling] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Config:
    """One point of the sweep."""

    samples: int
    engines: int
    trainers: int

    @property
    def label(self) -> str:
        return f"{self.samples}s-{self.engines}e-{self.trainers}t"

    def slime_args(self) -> tuple[str, ...]:
        return (
            "--rollout-batch-size",
            str(self.samples // SAMPLES_PER_PROMPT),
            "--n-samples-per-prompt",
            str(SAMPLES_PER_PROMPT),
            "--rollout-num-engines",
            str(self.engines),
            "--actor-num-gpus-per-node",
            str(self.trainers),
            "--eval-interval",
            "100000",
            "--skip-eval-before-train",
        )


def sweep(samples: list[int], engines: list[int], trainers: list[int], base: Config) -> dict[str, list[Config]]:
    """The configurations of each axis (each axis varies one dimension of `base`)."""
    return {
        "samples": [Config(n, base.engines, base.trainers) for n in samples],
        "engines": [Config(base.samples, n, base.trainers) for n in engines],
        "trainers": [Config(base.samples, base.engines, n) for n in trainers],
    }


def per_sample_ms(breakdown: dict[str, float], samples: int) -> dict[str, float]:
    """Milliseconds per sample of each phase, of the trainer's compute, of the framework's phases and of the step."""
    compute = breakdown["train"] - breakdown["train_data_load"]
    values = {name: breakdown[name] for name in ("generate", *FRAMEWORK_PHASES)}
    values["train_compute"] = compute
    values["framework"] = sum(breakdown[name] for name in FRAMEWORK_PHASES)
    values["step"] = breakdown["step"]
    return {name: seconds * 1000 / samples for name, seconds in values.items()}


def fitted_exponent(points: list[tuple[float, float]]) -> float | None:
    """k of y ~ x^k by least squares on (log x, log y); None with fewer than two usable points."""
    usable = [(math.log(x), math.log(y)) for x, y in points if x > 0 and y > 0]
    if len(usable) < 2:
        return None
    mean_x = sum(x for x, _ in usable) / len(usable)
    mean_y = sum(y for _, y in usable) / len(usable)
    spread = sum((x - mean_x) ** 2 for x, _ in usable)
    if spread == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in usable) / spread


def growth(results: dict[str, dict[str, Any]], configs: list[Config], transport: str) -> dict[str, float | None]:
    """Each phase's fitted exponent of seconds per step against samples per step along `configs`."""
    names = ("generate", "train_compute", *FRAMEWORK_PHASES, "framework", "step")
    exponents = {}
    for name in names:
        points = [
            (config.samples, results[config.label][transport]["per_sample_ms"][name] * config.samples)
            for config in configs
        ]
        exponents[name] = fitted_exponent(points)
    return exponents


def build_tables(report: dict[str, Any]) -> str:
    columns = ("generate", "train_compute", "store", "convert", "train_data_load", "update_weights", "other")
    header = "| samples | engines | trainers | transport | step (s) | " + " | ".join(columns) + " | framework |"
    lines = []
    for axis, labels in report["axes"].items():
        lines += [f"\n**{axis}** (ms per sample unless noted)\n", header, "|" + "---|" * (len(columns) + 6)]
        for label in labels:
            for transport in report["transports"]:
                result = report["results"][label][transport]
                config, ms = result["config"], result["per_sample_ms"]
                cells = [str(config["samples"]), str(config["engines"]), str(config["trainers"]), transport]
                cells.append(f"{result['breakdown']['step']:.2f}")
                cells += [f"{ms[name]:.2f}" for name in columns]
                cells.append(f"**{ms['framework']:.2f}**")
                lines.append("| " + " | ".join(cells) + " |")
    lines += ["\n**growth with samples per step** (k of time ~ samples^k; 1 = linear)\n"]
    names = ("generate", "train_compute", *FRAMEWORK_PHASES, "framework", "step")
    lines += ["| transport | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for transport, exponents in report["growth"].items():
        cells = [
            "n/a" if k is None else (f"**{k:.2f}** (superlinear)" if k > SUPERLINEAR else f"{k:.2f}")
            for k in (exponents[name] for name in names)
        ]
        lines.append(f"| {transport} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--steps", type=int, default=5, help="rollout steps per run; the last one is left out too (default 5)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each run left out (default 1)")
    parser.add_argument(
        "--samples", default="128,512,2048", help="samples per step, multiples of 8 (default 128,512,2048)"
    )
    parser.add_argument("--engines", default="1,2,4", help="engine counts at the base samples (default 1,2,4)")
    parser.add_argument("--trainers", default="1,2", help="data-parallel trainer counts (default 1,2)")
    parser.add_argument("--base-samples", type=int, default=512, help="samples per step of the engine and trainer axes")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated (default both)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 steps, 64 and 128 samples, 1-2 engines")
    parser.add_argument("--out", default="benchmarks/results/scaling.json", help="JSON report")
    parser.add_argument("--dir", default=None, help="where the runs' save directories go (default: a temp dir)")
    options = parser.parse_args(argv)
    if options.quick:
        options.steps, options.warmup = 3, 1
        options.samples, options.engines, options.trainers, options.base_samples = "64,128", "1,2", "1", 64

    def counts(flag: str, text: str) -> list[int]:
        try:
            values = sorted({int(item) for item in text.split(",") if item.strip()})
        except ValueError:
            parser.error(f"{flag} takes comma-separated integers, got {text!r}")
        if not values or values[0] < 1:
            parser.error(f"{flag} takes positive integers, got {text!r}")
        return values

    options.samples = counts("--samples", options.samples)
    options.engines = counts("--engines", options.engines)
    options.trainers = counts("--trainers", options.trainers)
    if any(n % SAMPLES_PER_PROMPT for n in [*options.samples, options.base_samples]):
        parser.error(f"samples per step must be multiples of {SAMPLES_PER_PROMPT} (the demo's samples per prompt)")
    options.transports = [item.strip() for item in options.transports.split(",") if item.strip()]
    unknown = sorted(set(options.transports) - set(TRANSPORTS))
    if unknown or not options.transports:
        parser.error(f"--transports: unknown {unknown}; choose from {', '.join(TRANSPORTS)}")
    if options.steps < options.warmup + 2:
        parser.error(
            f"--steps ({options.steps}) must exceed --warmup ({options.warmup}) + 1 (the last step is left out)"
        )
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    base = Config(options.base_samples, 2 if 2 in options.engines else options.engines[0], options.trainers[0])
    axes = sweep(options.samples, options.engines, options.trainers, base)
    configs = {config.label: config for axis in axes.values() for config in axis}
    workdir = Path(tempfile.mkdtemp(prefix="slime-scaling-bench-", dir=options.dir))
    began = time.monotonic()
    machine = machine_description()  # the load average before the runs
    try:
        results: dict[str, dict[str, Any]] = {}
        for number, (label, config) in enumerate(configs.items(), start=1):
            results[label] = {}
            order = options.transports if number % 2 else options.transports[::-1]
            for transport in order:
                _log(f"{number}/{len(configs)} {label} {transport}")
                run = run_demo(transport, options.steps, 10_000, workdir, f"{label}-{transport}", config.slime_args())
                # The last step also evaluates the final weights and commits: a cost per run, not per step.
                measured = [step for index, step in run["steps"].items() if options.warmup <= index < options.steps - 1]
                breakdown = step_breakdown(measured)
                results[label][transport] = {
                    "config": asdict(config),
                    "breakdown": breakdown,
                    "per_sample_ms": per_sample_ms(breakdown, config.samples),
                }
                shutil.rmtree(workdir / f"{label}-{transport}", ignore_errors=True)
        report: dict[str, Any] = {
            "machine": machine,
            "config": {"steps": options.steps, "warmup": options.warmup, "phases": list(PHASES)},
            "transports": options.transports,
            "axes": {axis: [config.label for config in axis_configs] for axis, axis_configs in axes.items()},
            "results": results,
            "growth": {transport: growth(results, axes["samples"], transport) for transport in options.transports},
        }
        report["elapsed_s"] = time.monotonic() - began
        report["table"] = build_tables(report)
        out = write_report(report, options.out)
        _log(f"report: {out} ({report['elapsed_s']:.0f} s)")
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
