"""`python -m benchmarks.torch_backend`: the torch backend's train time with `--bf16`, `--gradient-checkpointing`
and `--fsdp`, side by side.

Two sections, one run, one machine:

- **demo**: the CPU demo (`slime-run`, straw transport, built-in tiny model and copy task, two CPU engines) runs
  `--steps` rollout steps from a fresh save directory in each configuration, one after the other: on one
  training rank float32, `--bf16`, and `--bf16 --gradient-checkpointing`; on two ranks
  (`--actor-num-gpus-per-node 2`, CPU processes here) DDP and `--fsdp`. The per-step train time is
  `perf/train_time` of the run's own `metrics.jsonl` (the trainers' step: old log-probs, the optimizer steps,
  reading the shard), without the first `--warmup` steps; ratios are against float32 on one rank and against
  DDP on two. With `--reps N` every config runs N times, the order reversed on every other repetition.
- **precision**: one training step (forward, float32 log-softmax loss, backward, AdamW) of a Qwen2 at the
  demo's size and at two larger sizes (4 layers) in this process, three ways: float32; bfloat16 autocast with
  float32 weights (what `--bf16` does); and bfloat16 weights with float32 master copies in the optimizer (the
  alternative, not built into the backend). The three take their steps in turns (one each per round, the order
  rotating), so that the machine's load hits them alike; the median seconds per step over `--precision-steps`
  rounds after `--precision-warmup`, and each way's loss after its last step.

Numbers are reported, never asserted. The JSON report goes to `--out` (default
`benchmarks/results/torch_backend.json`) with a markdown table, which is printed too; see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.e2e import machine_description, run_demo, step_breakdown, write_report

#: label -> (training ranks, slime-run options)
CONFIGS: dict[str, tuple[int, tuple[str, ...]]] = {
    "fp32": (1, ()),
    "bf16": (1, ("--bf16",)),
    "bf16_gc": (1, ("--bf16", "--gradient-checkpointing")),
    "ddp": (2, ("--actor-num-gpus-per-node", "2")),
    "fsdp": (2, ("--fsdp", "--actor-num-gpus-per-node", "2")),
}
#: (label, hidden size, layers, vocabulary, batch, sequence length) of the precision section.
PRECISION_SHAPES = (
    ("demo-tiny", 64, 2, 61, 16, 16),
    ("h512", 512, 4, 8192, 8, 256),
    ("h1024", 1024, 4, 32000, 4, 512),
)
PRECISION_MODES = ("fp32", "autocast_bf16", "bf16_fp32_master")


def _log(message: str) -> None:
    print(f"[torch_backend] {message}", file=sys.stderr, flush=True)


def measure_demo(configs: list[str], steps: int, warmup: int, reps: int, workdir: Path) -> dict[str, Any]:
    """Every config's demo run, `reps` times, the order reversed on every other repetition."""
    measured: dict[str, list[dict[str, Any]]] = {label: [] for label in configs}
    rewards: dict[str, list[list[Any]]] = {label: [] for label in configs}
    loads: dict[str, list[float]] = {label: [] for label in configs}
    for rep in range(reps):
        for label in configs if rep % 2 == 0 else configs[::-1]:
            run = run_demo("straw", steps, steps, workdir, f"{label}-{rep}", CONFIGS[label][1])
            measured[label].extend(step for index, step in run["steps"].items() if index >= warmup)
            rewards[label].append([run["steps"][index].get("rollout/reward") for index in sorted(run["steps"])])
            loads[label].append(os.getloadavg()[0])
            train = step_breakdown([step for index, step in run["steps"].items() if index >= warmup])["train"]
            _log(f"{label}-{rep}: train {train * 1000:.0f} ms per step; load average {loads[label][-1]:.1f}")
    results = {}
    for label in configs:
        ranks, options = CONFIGS[label]
        train = [float(step["perf/train_time"]) for step in measured[label]]
        results[label] = {
            "ranks": ranks,
            "options": list(options),
            "breakdown": step_breakdown(measured[label]),
            "train_median_s": statistics.median(train),
            "train_times_s": train,
            "rewards": rewards[label],
            "load_average_after_runs": loads[label],
        }
    return results


class _PrecisionCase:
    """One model of the precision section, trained one step at a time in `mode`."""

    def __init__(self, mode: str, shape: tuple) -> None:
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        _, hidden, layers, vocab, batch, length = shape
        config = Qwen2Config(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=max(hidden // 64, 2),
            num_key_value_heads=max(hidden // 128, 1),
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.model = Qwen2ForCausalLM(config).train()
            self.tokens = torch.randint(0, vocab, (batch, length))
        self.mode = mode
        self.master: list[torch.Tensor] = []
        if mode == "bf16_fp32_master":
            self.master = [p.detach().clone().requires_grad_(True) for p in self.model.parameters()]
            self.model.to(torch.bfloat16)
        self.optimizer = torch.optim.AdamW(self.master or self.model.parameters(), lr=1e-4)
        self.times: list[float] = []
        self.loss = float("nan")

    def step(self) -> None:
        import torch

        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.mode == "autocast_bf16"):
            logits = self.model(self.tokens, use_cache=False).logits
        log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        loss = -log_probs.gather(-1, self.tokens[:, 1:].unsqueeze(-1)).mean()
        loss.backward()
        if self.master:
            for copy, parameter in zip(self.master, self.model.parameters(), strict=True):
                copy.grad = parameter.grad.float()
        self.optimizer.step()
        if self.master:
            with torch.no_grad():
                for copy, parameter in zip(self.master, self.model.parameters(), strict=True):
                    parameter.copy_(copy)
        self.times.append(time.perf_counter() - started)
        self.loss = loss.item()


def measure_precision(steps: int, warmup: int, shapes: tuple = PRECISION_SHAPES) -> dict[str, Any]:
    """Per shape, the three modes' step times, interleaved (one step of each mode per round, the order rotating)
    so that a change in the machine's load hits all three alike; the median of the rounds after `warmup`."""
    import torch

    results: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    for shape in shapes:
        label = shape[0]
        _log(f"precision: {label} ({', '.join(PRECISION_MODES)}), {warmup} + {steps} interleaved rounds")
        cases = {mode: _PrecisionCase(mode, shape) for mode in PRECISION_MODES}
        for round_index in range(warmup + steps):
            shift = round_index % len(PRECISION_MODES)
            for mode in PRECISION_MODES[shift:] + PRECISION_MODES[:shift]:
                cases[mode].step()
        entry: dict[str, Any] = {
            mode: {
                "step_s": statistics.median(case.times[warmup:]),
                "step_times_s": case.times[warmup:],
                "last_loss": case.loss,
            }
            for mode, case in cases.items()
        }
        entry["shape"] = dict(zip(("hidden", "layers", "vocab", "batch", "length"), shape[1:], strict=True))
        base = entry["fp32"]["step_s"]
        entry["ratios_over_fp32"] = {mode: entry[mode]["step_s"] / base for mode in PRECISION_MODES}
        results[label] = entry
        del cases
    return results


def build_table(report: dict[str, Any]) -> str:
    rows = [
        "| demo run | ranks | options | train (mean) | train (median) | step (mean) | train ratio (1 rank: of fp32, "
        "2 ranks: of ddp) |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = report["ratios"]
    for label, run in report["demo"].items():
        ratio = ratios.get(f"{label}_train", 1.0)
        options = " ".join(run["options"]) or "(float32)"
        rows.append(
            f"| {label} | {run['ranks']} | `{options}` | {run['breakdown']['train'] * 1000:.0f} ms | "
            f"{run['train_median_s'] * 1000:.0f} ms | {run['breakdown']['step'] * 1000:.0f} ms | {ratio:.2f}x |"
        )
    precision = report.get("precision")
    if precision:
        rows += ["", "| one train step | " + " | ".join(PRECISION_MODES) + " |", "|---|---|---|---|"]
        for label in (shape[0] for shape in PRECISION_SHAPES):
            if label not in precision:
                continue
            entry = precision[label]
            cells = [
                f"{entry[mode]['step_s'] * 1000:.0f} ms ({entry['ratios_over_fp32'][mode]:.2f}x)"
                for mode in PRECISION_MODES
            ]
            rows.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="rollout steps per demo run (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each demo run left out (default 2)")
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"demo runs, comma-separated (default {','.join(CONFIGS)})"
    )
    parser.add_argument("--reps", type=int, default=1, help="demo runs per config, alternating the order (default 1)")
    parser.add_argument("--precision-steps", type=int, default=5, help="measured rounds per precision shape (5)")
    parser.add_argument("--precision-warmup", type=int, default=2, help="unmeasured first rounds per shape (2)")
    parser.add_argument("--no-precision", action="store_true", help="skip the precision section")
    parser.add_argument("--quick", action="store_true", help="3 steps, 1 warm-up, the tiny precision shape only")
    parser.add_argument("--out", default="benchmarks/results/torch_backend.json", help="JSON report")
    parser.add_argument("--dir", default=None, help="where the runs' save directories go (default: a temp dir)")
    options = parser.parse_args(argv)
    if options.quick:
        options.steps, options.warmup, options.precision_steps, options.precision_warmup = 3, 1, 2, 1
    options.configs = [label.strip() for label in options.configs.split(",") if label.strip()]
    unknown = [label for label in options.configs if label not in CONFIGS]
    if unknown or not options.configs:
        parser.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    if options.reps < 1:
        parser.error("--reps must be at least 1")
    if options.steps <= options.warmup:
        parser.error(f"--steps ({options.steps}) must exceed --warmup ({options.warmup})")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="slime-torch-bench-", dir=options.dir))
    try:
        return _run(options, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(options: argparse.Namespace, workdir: Path) -> int:
    began = time.monotonic()
    report: dict[str, Any] = {
        "machine": machine_description(),
        "config": {
            key: getattr(options, key)
            for key in ("steps", "warmup", "reps", "configs", "precision_steps", "precision_warmup")
        },
        "demo": {},
    }
    report["demo"] = measure_demo(options.configs, options.steps, options.warmup, options.reps, workdir)
    demo = report["demo"]
    ratios: dict[str, float] = {}
    for label, run in demo.items():
        base = "fp32" if run["ranks"] == 1 else "ddp"
        if base in demo and label != base:
            ratios[f"{label}_train"] = run["breakdown"]["train"] / demo[base]["breakdown"]["train"]
    if "fp32" in demo and "ddp" in demo:
        ratios["ddp_over_fp32_train"] = demo["ddp"]["breakdown"]["train"] / demo["fp32"]["breakdown"]["train"]
    report["ratios"] = ratios
    if not options.no_precision:
        shapes = PRECISION_SHAPES[:1] if options.quick else PRECISION_SHAPES
        report["precision"] = measure_precision(options.precision_steps, options.precision_warmup, shapes)
    report["wall_s"] = time.monotonic() - began
    report["table"] = build_table(report)
    out = write_report(report, options.out)
    _log(f"report: {out} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
