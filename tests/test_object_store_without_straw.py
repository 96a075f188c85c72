"""An object-store run never needs straw-queue: the CPU demo trains end to end where `import straw` fails.

Every process of the run (the driver, Ray's workers: engines, trainers, the rollout manager) starts with a
meta-path finder installed by a `sitecustomize` module on PYTHONPATH. It refuses `straw` and records each
attempt, so the test checks both that the run succeeded and that nothing even tried to import straw.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from slime.utils.external_utils.slime_run_process import SlimeRunProcess

NUM_ROLLOUT = 2

BLOCKER = textwrap.dedent(
    """
    import importlib.abc, os, sys

    class _NoStraw(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".")[0] == "straw":
                with open(os.environ["SLIME_TEST_STRAW_ATTEMPTS"], "a") as log:
                    log.write(f"{os.getpid()} {fullname}\\n")
                raise ImportError(f"straw is blocked in this test ({fullname})", name=fullname)
            return None

    sys.meta_path.insert(0, _NoStraw())
    """
)


@pytest.mark.e2e
@pytest.mark.slow
def test_object_store_demo_runs_where_straw_cannot_be_imported(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    attempts = tmp_path / "straw_imports.log"
    save = tmp_path / "run"
    args = ["--rollout-data-transport", "object-store", "--num-rollout", str(NUM_ROLLOUT), "--save", str(save)]
    env = {"PYTHONPATH": str(site), "SLIME_TEST_STRAW_ATTEMPTS": str(attempts)}
    SlimeRunProcess(args, tmp_path / "run.log", cwd=tmp_path, env=env).finish(300)

    assert not attempts.exists(), f"processes tried to import straw: {attempts.read_text()}"
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    steps = sorted({record["step"] for record in records if any(key.startswith("train/") for key in record)})
    assert steps == list(range(NUM_ROLLOUT)), f"expected {NUM_ROLLOUT} trained steps, metrics show {sorted(steps)}"
    assert not (save / "rollout_data").exists(), "an object-store run wrote a straw pool"
