"""The built-in advantage estimators (registry kind "advantage_estimators", `--advantage-estimator NAME`).

An estimator turns one rollout step's rewards into the advantage each sample trains with: `target(args, rewards,
group_size, response_lengths) -> advantages`, where `rewards` are in batch order, grouped by prompt in
consecutive runs of `group_size` (`--n-samples-per-prompt`), and every response token of sample `i` gets
`advantages[i]`. The batch builder calls it once per step; docs/losses.md gives the equations.

All work in float64: in float32 the mean of eight equal rewards of 2/3 is off by 6e-8, which a division by a
std of 1e-6 would blow up to an advantage of 0.06 on every sample of a group that carries no signal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from slime import hookimpl
from slime.specs import AdvantageEstimatorSpec

#: Added to a standard deviation before dividing by it.
STD_EPSILON = 1e-6


def _grouped(rewards: Sequence[float], group: int) -> torch.Tensor:
    if group < 1 or len(rewards) % group:
        raise ValueError(f"{len(rewards)} samples cannot be grouped by --n-samples-per-prompt {group}")
    return torch.tensor(list(rewards), dtype=torch.float64).view(-1, group)


def _constant_groups(rewards: torch.Tensor) -> torch.Tensor:
    """`[groups]` True where every reward of the group is equal: such a group carries no signal."""
    return rewards.amax(dim=-1) == rewards.amin(dim=-1)


def normalize_group_rewards(raw: Sequence[float], group: int, *, std_normalization: bool) -> list[float]:
    """Each reward minus its prompt group's mean, divided by the group's sample std (+1e-6) when
    `std_normalization`. A group whose rewards are all equal gets exactly 0."""
    rewards = _grouped(raw, group)
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    if std_normalization and group > 1:
        centered = centered / (rewards.std(dim=-1, keepdim=True) + STD_EPSILON)
    centered[_constant_groups(rewards)] = 0.0
    return centered.flatten().tolist()


def _whiten(values: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """`values` (one per sample) minus their mean, over their std, both over the batch's response tokens (a sample
    counts once per token, as if each token carried its sample's value). All equal: zeros."""
    weights = torch.tensor([float(n) for n in lengths], dtype=torch.float64)
    if weights.sum() <= 0:
        weights = torch.ones_like(values)
    mean = (weights * values).sum() / weights.sum()
    centered = values - mean
    std = ((weights * centered.square()).sum() / weights.sum()).sqrt()
    if std == 0:
        return torch.zeros_like(values)
    return centered / (std + STD_EPSILON)


def grpo(args: Any, rewards: Sequence[float], group: int, response_lengths: Sequence[int]) -> list[float]:
    """Group-relative: `(r - mean_group) / (std_group + 1e-6)`; without the std division under
    `--no-grpo-std-normalization`."""
    return normalize_group_rewards(rewards, group, std_normalization=getattr(args, "grpo_std_normalization", False))


def dr_grpo(args: Any, rewards: Sequence[float], group: int, response_lengths: Sequence[int]) -> list[float]:
    """Dr. GRPO: `r - mean_group`, no std division (a group with a small spread is not amplified). Pair it with
    `--loss-agg-mode seq-mean-token-sum-norm` for the paper's unbiased loss."""
    return normalize_group_rewards(rewards, group, std_normalization=False)


def rloo(args: Any, rewards: Sequence[float], group: int, response_lengths: Sequence[int]) -> list[float]:
    """REINFORCE leave-one-out: `r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_group)`."""
    if group < 2:
        raise ValueError("--advantage-estimator rloo needs --n-samples-per-prompt of at least 2 (a leave-one-out mean)")
    centered = normalize_group_rewards(rewards, group, std_normalization=False)
    return [value * group / (group - 1) for value in centered]


def reinforce_plus_plus(
    args: Any, rewards: Sequence[float], group: int, response_lengths: Sequence[int]
) -> list[float]:
    """REINFORCE++: the reward (each token's return with a discount of 1 and no per-token reward), whitened over
    the step's tokens: no per-prompt baseline."""
    values = torch.tensor([float(r) for r in rewards], dtype=torch.float64)
    return _whiten(values, response_lengths).tolist()


def reinforce_plus_plus_baseline(
    args: Any, rewards: Sequence[float], group: int, response_lengths: Sequence[int]
) -> list[float]:
    """REINFORCE++ with the group mean as baseline: `r - mean_group`, then whitened over the step's tokens."""
    centered = torch.tensor(normalize_group_rewards(rewards, group, std_normalization=False), dtype=torch.float64)
    return _whiten(centered, response_lengths).tolist()


def ppo(args: Any, rewards: Sequence[float], group: int, response_lengths: Sequence[int]) -> list[float]:
    """PPO: the rewards unchanged. The critic turns them into per-token advantages with its values (GAE,
    `slime.plugins.torch_critic`), and the actor trains on those."""
    return [float(reward) for reward in rewards]


@hookimpl
def slime_advantage_estimators() -> Iterable[AdvantageEstimatorSpec]:
    return [
        AdvantageEstimatorSpec("grpo", grpo, "group-relative: reward minus the prompt group's mean, over its std"),
        AdvantageEstimatorSpec(
            "gspo",
            grpo,
            "GRPO's advantages with one importance ratio per sequence (the geometric mean of its tokens')",
            ratio_level="sequence",
        ),
        AdvantageEstimatorSpec("dr_grpo", dr_grpo, "reward minus the prompt group's mean, no std division"),
        AdvantageEstimatorSpec("rloo", rloo, "reward minus the mean of the group's other samples (leave-one-out)"),
        AdvantageEstimatorSpec(
            "reinforce_plus_plus", reinforce_plus_plus, "the reward whitened over the step's tokens, no baseline"
        ),
        AdvantageEstimatorSpec(
            "reinforce_plus_plus_baseline",
            reinforce_plus_plus_baseline,
            "reward minus the prompt group's mean, whitened over the step's tokens",
        ),
        AdvantageEstimatorSpec(
            "ppo", ppo, "GAE over a learned value model's estimates (--use-critic), whitened", needs_critic=True
        ),
    ]
