"""Smoke test of the performance harness: it runs and reports every section (numbers are never bounded)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("publish", "read", "ray", "ref_sizes", "assembly", "zstd", "memory", "profile")


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -m ARGS` from the repository root, output captured."""
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _numbers(value: object) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [value]
    if isinstance(value, dict):
        return [number for item in value.values() for number in _numbers(item)]
    if isinstance(value, list):
        return [number for item in value for number in _numbers(item)]
    return []


@pytest.mark.slow
def test_quick_benchmark_reports_every_section(tmp_path: Path) -> None:
    out = tmp_path / "tmp.json"
    completed = _run(
        "benchmarks.transport", "--quick", "--out", str(out), "--dir", str(tmp_path / "pools"), timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    report = json.loads(out.read_text())
    for section in SECTIONS:
        numbers = _numbers(report[section])
        assert numbers, f"section {section} reported no numbers"
        assert all(number > 0 for number in numbers), f"section {section} has a non-positive number: {report[section]}"
    assert set(report["publish"]) == set(report["read"]) == set(report["ray"]) == {"samples", "tensor_dict"}
    assert {"DiskPayloadRef", "RolloutGroupRef", "TrainBatchRef"} <= set(report["ref_sizes"])
    assert set(report["config"]["assembly_sizes"]) == {"1MB", "16MB"} < set(report["assembly"])
    for label in ("1MB", "16MB"):
        entry = report["assembly"][label]
        # Assembly reads manifests, not payloads: far fewer bytes than the groups hold (the read meter works:
        # the manifests themselves are read, so it is not zero).
        assert 0 < entry["read_bytes_max"] < entry["published_bytes"] / 10, entry
    memory = report["memory"]
    assert memory["payload_tensor_bytes"] >= 64 * 1024**2 and memory["hwm_after_bytes"] >= memory["rss_before_bytes"]
    assert set(report["profile"]) == {"samples", "tensor_dict"}
    assert all(len(entry["split_s"]) == 3 for entry in report["profile"].values())
    assert set(report["zstd"]) == {"text", "tokens"}
    for key in ("cpu_count", "python", "torch", "straw"):
        assert report["machine"][key]
    assert "| section |" in completed.stdout
    assert list((tmp_path / "pools").iterdir()) == [], "the benchmark left temporary pools behind"


@pytest.mark.parametrize("module", ["benchmarks.transport", "benchmarks.run"])
def test_benchmark_rejects_invalid_repetitions(tmp_path: Path, module: str) -> None:
    completed = _run(module, "--reps", "0", "--out", str(tmp_path / "x.json"), timeout=60)
    assert completed.returncode == 2
    assert "--reps must be at least 1" in completed.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.extended  # about 200 s: in `nox -s extended`, not CI's e2e session
def test_quick_e2e_benchmark_reports_the_breakdown_ratios_and_resume(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    completed = _run("benchmarks.e2e", "--quick", "--out", str(out), "--dir", str(tmp_path), timeout=900)
    assert completed.returncode == 0, completed.stderr[-4000:]
    report = json.loads(out.read_text())
    for transport in ("straw", "object-store"):
        breakdown = report["transports"][transport]["breakdown"]
        assert {"generate", "store", "convert", "train", "train_data_load", "update_weights", "save"} < set(breakdown)
        assert breakdown["step"] > 0 and breakdown["generate"] > 0 and breakdown["train"] > 0, breakdown
        assert report["transports"][transport]["measured_steps"] == 2  # 3 steps, the first left out
    assert report["floor"]["step"] > 0
    assert all(value > 0 for value in report["ratios"].values()), report["ratios"]
    resume = report["resume"]
    assert resume["resumed_from_commit"] == 1 and resume["first_new_step"] == 2
    assert 0 < resume["kill_to_first_generation_s"] < resume["kill_to_first_step_done_s"]
    assert "| step (mean) |" in completed.stdout and "kill to first new generation" in completed.stdout
    assert [p for p in tmp_path.iterdir() if p.name.startswith("slime-e2e-bench-")] == [], "runs were left behind"


def test_e2e_benchmark_rejects_steps_that_leave_nothing_to_measure(tmp_path: Path) -> None:
    completed = _run("benchmarks.e2e", "--steps", "2", "--warmup", "2", "--out", str(tmp_path / "x.json"), timeout=60)
    assert completed.returncode == 2 and "--steps (2) must exceed --warmup (2)" in completed.stderr
    assert not (tmp_path / "x.json").exists()


def test_determinism_benchmark_table_gives_each_phase_in_both_modes_and_their_ratio() -> None:
    from benchmarks.determinism import ROWS, build_table

    on = {name: 0.2 for name in ROWS} | {"generate": 0.75, "step": 1.3}
    off = {name: 0.2 for name in ROWS} | {"generate": 0.5, "step": 1.0, "save": 0.0}
    table = build_table({"modes": {"deterministic": {"breakdown": on}, "non-deterministic": {"breakdown": off}}})
    assert "| generate | 750 ms | 500 ms | 1.50x |" in table
    assert "| step (mean) | 1300 ms | 1000 ms | 1.30x |" in table
    assert "| save | 200 ms | 0 ms |  |" in table  # no ratio against a phase that took no time


def test_determinism_benchmark_rejects_steps_that_leave_nothing_to_measure(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    completed = _run("benchmarks.determinism", "--steps", "1", "--warmup", "1", "--out", str(out), timeout=60)
    assert completed.returncode == 2 and "--steps (1) must exceed --warmup (1)" in completed.stderr
    assert not out.exists()


def test_startup_benchmark_table_gives_each_mode_its_median_min_and_runs() -> None:
    from benchmarks.startup import markdown

    report = {"modes": {"local": {"runs_s": [21.0, 19.5, 20.0], "median_s": 20.0, "min_s": 19.5}}}
    assert markdown(report).splitlines()[-1] == "| started by the run | 20.0 s | 19.5 s | 21.0, 19.5, 20.0 |"


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--repeats", "0", "--repeats must be at least 1"),
        ("--modes", "local,remote", "--modes takes local, cluster or both"),
    ],
)
def test_startup_benchmark_rejects_bad_options(tmp_path: Path, option: str, value: str, message: str) -> None:
    out = tmp_path / "x.json"
    completed = _run("benchmarks.startup", option, value, "--out", str(out), timeout=60)
    assert completed.returncode == 2 and message in completed.stderr
    assert not out.exists()


def test_scaling_exponents_are_the_slope_of_logs() -> None:
    from benchmarks.scaling import fitted_exponent

    assert fitted_exponent([(128, 1.0), (512, 4.0), (2048, 16.0)]) == pytest.approx(1.0)  # linear
    assert fitted_exponent([(128, 1.0), (512, 1.0), (2048, 1.0)]) == pytest.approx(0.0)  # flat per step
    assert fitted_exponent([(128, 1.0), (512, 16.0)]) == pytest.approx(2.0)  # quadratic
    assert fitted_exponent([(128, 1.0)]) is None and fitted_exponent([(128, 0.0), (512, 2.0)]) is None


def test_scaling_report_gives_per_sample_costs_and_flags_superlinear_growth() -> None:
    from benchmarks.scaling import PHASES, Config, build_tables, growth, per_sample_ms, sweep

    axes = sweep([128, 512], [1, 2], [1], Config(512, 2, 1))
    assert [c.label for c in axes["samples"]] == ["128s-2e-1t", "512s-2e-1t"]
    assert [c.label for c in axes["engines"]] == ["512s-1e-1t", "512s-2e-1t"]

    def breakdown(samples: int) -> dict[str, float]:
        # Everything linear in the samples but `store`, which grows with their square.
        values = {name: samples / 1000 for name in PHASES}
        values["store"] = (samples / 128) ** 2 / 1000
        values["train_data_load"] = samples / 4000
        values["other"] = samples / 1000
        values["step"] = sum(values[name] for name in PHASES) + values["other"]
        return values

    results = {}
    for config in {c.label: c for axis in axes.values() for c in axis}.values():
        part = breakdown(config.samples)
        results[config.label] = {
            "straw": {"config": vars(config), "breakdown": part, "per_sample_ms": per_sample_ms(part, config.samples)}
        }
    assert results["128s-2e-1t"]["straw"]["per_sample_ms"]["generate"] == pytest.approx(1.0)
    assert results["128s-2e-1t"]["straw"]["per_sample_ms"]["train_compute"] == pytest.approx(0.75)
    exponents = growth(results, axes["samples"], "straw")
    assert exponents["generate"] == pytest.approx(1.0) and exponents["store"] == pytest.approx(2.0)
    report = {
        "axes": {axis: [c.label for c in configs] for axis, configs in axes.items()},
        "transports": ["straw"],
        "results": results,
        "growth": {"straw": exponents},
    }
    table = build_tables(report)
    assert "| 512 | 2 | 1 | straw | " in table and "**2.00** (superlinear)" in table
    assert table.count("(superlinear)") == 1 + (exponents["framework"] > 1.1) + (exponents["step"] > 1.1)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--samples", "100", "must be multiples of 8"),
        ("--engines", "0,2", "--engines takes positive integers"),
        ("--trainers", "one", "--trainers takes comma-separated integers"),
        ("--transports", "straw,carrier-pigeon", "--transports: unknown ['carrier-pigeon']"),
        ("--steps", "2", "--steps (2) must exceed --warmup (1) + 1"),
    ],
)
def test_scaling_benchmark_rejects_bad_options(tmp_path: Path, option: str, value: str, message: str) -> None:
    out = tmp_path / "x.json"
    completed = _run("benchmarks.scaling", option, value, "--out", str(out), timeout=60)
    assert completed.returncode == 2 and message in completed.stderr
    assert not out.exists()


def test_e2e_table_gives_the_trl_row_its_step_and_ratios_when_measured() -> None:
    from benchmarks.e2e import PHASES, build_table

    breakdown = {name: 0.1 for name in (*PHASES, "train_data_load", "other", "step_median")} | {"step": 0.7}
    report = {
        "transports": {"straw": {"breakdown": breakdown}, "object-store": {"breakdown": breakdown | {"step": 0.5}}},
        "floor": {"generate": 0.02, "train": 0.08, "step": 0.1},
        "ratios": {"straw_over_object_store": 1.4, "straw_over_floor": 7.0, "object_store_over_floor": 5.0},
    }
    without = build_table(report)
    assert "TRL" not in without.splitlines()[0]
    report["trl"] = {"step": 0.35}
    report["ratios"]["straw_over_trl"] = 2.0
    table = build_table(report).splitlines()
    assert table[0].endswith("| TRL GRPOTrainer |")
    assert next(row for row in table if row.startswith("| step (mean) |")).endswith("| 100 ms | 350 ms |")
    assert table[-1].endswith("| 3.5x of floor; straw is 2.0x of it |")
