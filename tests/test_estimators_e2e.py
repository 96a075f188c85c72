"""Every built-in advantage estimator trains the CPU demo to its reward target (a 10-step mean reward of 0.9).

The demo (`--plugin straw`: the tiny model learning to copy, two CPU engines, `--deterministic`) runs with
`--advantage-estimator NAME` and the estimator's settings from docs/losses.md until it reaches the target or
`NUM_ROLLOUT` steps; `grpo`, the default, is covered by the demo's own end-to-end tests. The estimators' equations
are checked by hand in tests/test_advantage_estimators.py; this checks that each one also learns.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slime.testing import run_records
from slime.utils.external_utils.slime_run_process import SlimeRunProcess

NUM_ROLLOUT = 120
RUN_TIMEOUT_S = 600

#: Each estimator's demo settings (docs/losses.md). Without the std division (dr_grpo, rloo) advantages are several
#: times smaller than GRPO's and the demo's entropy bonus of 0.05 outweighs them (the reward stalls near 0.55);
#: 0.01 learns (benchmarks/demo_floor.py --advantage-estimator NAME --entropy-coef C).
ESTIMATORS = {
    "dr_grpo": ["--entropy-coef", "0.01", "--loss-agg-mode", "seq-mean-token-sum-norm"],
    "rloo": ["--entropy-coef", "0.01"],
    "reinforce_plus_plus": [],
    "reinforce_plus_plus_baseline": [],
    "gspo": [],
}


#: Run in CI: none. Each estimator's demo run takes about 110-190 s here, and CI's time on this machine (about 80 min
#: with these runs, against a 90 min limit) goes to the durability tests; the estimators' equations, the loss
#: aggregation modes and the sequence-level ratio are checked by hand in tests/test_advantage_estimators.py and
#: tests/test_loss_aggregation.py, and every run below is in `nox -s extended`.
IN_CI: tuple[str, ...] = ()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize(
    "estimator", [name if name in IN_CI else pytest.param(name, marks=pytest.mark.extended) for name in ESTIMATORS]
)
def test_the_estimator_trains_the_demo_to_its_reward_target(estimator: str, tmp_path: Path) -> None:
    save = tmp_path / "run"
    args = ["--plugin", "straw", "--advantage-estimator", estimator, *ESTIMATORS[estimator]]
    args += ["--num-rollout", str(NUM_ROLLOUT), "--save-interval", "1000", "--save", str(save)]
    run = SlimeRunProcess(args, tmp_path / "run.log", cwd=tmp_path)
    mean, first = run_records.run_until_reward_target(run, save, RUN_TIMEOUT_S)
    assert mean >= run_records.DEMO_TARGET, (estimator, mean, first)
