"""`slime.testing` as a third party uses it: a test module outside this repository, no conftest, only the pytest
plugin that installing slime-rl registers (entry point `pytest11: slime`) and its `--slime-transport` selection."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

THIRD_PARTY_TESTS = """
from slime.testing import TransportConformance


class TestMine(TransportConformance):
    transport_name = "object-store"


def test_unrelated():
    pass
"""


def _pytest(directory: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    inherited = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "SLIME_TEST_TRANSPORT")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=directory,
        env={**inherited, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_a_third_party_suite_runs_through_the_registered_plugin(tmp_path: Path) -> None:
    (tmp_path / "test_mine.py").write_text(THIRD_PARTY_TESTS)
    selected = _pytest(tmp_path, "--slime-transport=object-store", "-k", "factory or unrelated")
    assert selected.returncode == 0, selected.stdout[-3000:] + selected.stderr[-3000:]
    assert "slime transport conformance: object-store" in selected.stdout
    assert "1 passed" in selected.stdout and "deselected" in selected.stdout, selected.stdout[-3000:]

    other = _pytest(tmp_path, "-k", "unrelated", env={"SLIME_TEST_TRANSPORT": "straw"})
    assert other.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, other.stdout[-3000:]
