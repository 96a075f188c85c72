"""Smoke test of the performance harness: it runs and reports every section (numbers are never bounded)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("publish", "read", "ray", "ref_sizes", "assembly", "zstd")


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
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out), "--dir", str(tmp_path / "pools")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    report = json.loads(out.read_text())
    for section in SECTIONS:
        numbers = _numbers(report[section])
        assert numbers, f"section {section} reported no numbers"
        assert all(number > 0 for number in numbers), f"section {section} has a non-positive number: {report[section]}"
    assert set(report["publish"]) == set(report["read"]) == set(report["ray"]) == {"samples", "tensor_dict"}
    assert {"DiskPayloadRef", "RolloutGroupRef", "TrainBatchRef"} <= set(report["ref_sizes"])
    assert {"1KB", "100KB", "1MB"} <= set(report["assembly"])
    assert set(report["zstd"]) == {"text", "tokens"}
    for key in ("cpu_count", "python", "torch", "straw"):
        assert report["machine"][key]
    assert "| section |" in completed.stdout
    assert list((tmp_path / "pools").iterdir()) == [], "the benchmark left temporary pools behind"


def test_benchmark_rejects_invalid_repetitions(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--reps", "0", "--out", str(tmp_path / "x.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 2
    assert "--reps must be at least 1" in completed.stderr
    assert not (tmp_path / "x.json").exists()
