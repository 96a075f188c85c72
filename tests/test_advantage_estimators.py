"""Advantage estimators (`--advantage-estimator NAME`): each against a hand-computed example, the GSPO ratio,
the registry and the batch builder's use of it, and the refusals at parse time."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from slime.plugins import advantage_estimators as est
from slime.plugins.rl_losses import LossSettings, rl_loss
from slime.specs import AdvantageEstimatorSpec
from slime.utils.arguments import parse_args

# Two prompts, two samples each; response lengths 1, 3, 2, 2.
REWARDS = [1.0, 0.0, 1.0, 1.0]
LENGTHS = [1, 3, 2, 2]
ARGS = SimpleNamespace(grpo_std_normalization=True)


def test_grpo_centres_and_scales_per_group_and_a_constant_group_gets_zero() -> None:
    # Group 1: mean 0.5, sample std 1/sqrt(2); group 2 is constant.
    expected = [0.5 / (1 / math.sqrt(2) + 1e-6), -0.5 / (1 / math.sqrt(2) + 1e-6), 0.0, 0.0]
    assert est.grpo(ARGS, REWARDS, 2, LENGTHS) == pytest.approx(expected)
    unscaled = est.grpo(SimpleNamespace(grpo_std_normalization=False), REWARDS, 2, LENGTHS)
    assert unscaled == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_group_normalisation_is_exact_where_float32_would_not_be() -> None:
    # Eight equal rewards of 2/3: float32 would leave 6e-8 after centring, which the std division blows up.
    assert est.normalize_group_rewards([2 / 3] * 8, 8, std_normalization=True) == [0.0] * 8
    mixed = est.normalize_group_rewards([0.0, 1.0, 0.0, 1.0], 4, std_normalization=True)
    assert mixed == pytest.approx([-0.866025, 0.866025, -0.866025, 0.866025], abs=1e-5)  # sample std 1/sqrt(3)
    assert est.normalize_group_rewards([0.3, 0.9], 1, std_normalization=True) == [0.0, 0.0]
    with pytest.raises(ValueError, match="3 samples cannot be grouped by --n-samples-per-prompt 2"):
        est.normalize_group_rewards([0.0, 1.0, 0.5], 2, std_normalization=True)


def test_dr_grpo_does_not_divide_by_the_std() -> None:
    # A group with a tiny spread keeps a tiny advantage (GRPO would scale it to about +-0.7).
    assert est.dr_grpo(ARGS, [0.50, 0.51], 2, [1, 1]) == pytest.approx([-0.005, 0.005])


def test_rloo_subtracts_the_mean_of_the_other_samples() -> None:
    rewards = [1.0, 0.0, 0.0, 0.5]  # one group of four
    expected = [1.0 - (0.0 + 0.0 + 0.5) / 3, 0.0 - 1.5 / 3, 0.0 - 1.5 / 3, 0.5 - 1.0 / 3]
    assert est.rloo(ARGS, rewards, 4, [1] * 4) == pytest.approx(expected)
    with pytest.raises(ValueError, match="rloo needs --n-samples-per-prompt of at least 2"):
        est.rloo(ARGS, [1.0], 1, [1])


def test_reinforce_plus_plus_whitens_the_rewards_over_the_steps_tokens() -> None:
    # Token-weighted: 1 + 3 + 2 + 2 = 8 tokens; mean = (1*1 + 3*0 + 2*1 + 2*1) / 8 = 5/8.
    mean = 5 / 8
    var = (1 * (1 - mean) ** 2 + 3 * mean**2 + 2 * (1 - mean) ** 2 + 2 * (1 - mean) ** 2) / 8
    expected = [(r - mean) / (math.sqrt(var) + 1e-6) for r in REWARDS]
    assert est.reinforce_plus_plus(ARGS, REWARDS, 2, LENGTHS) == pytest.approx(expected)
    assert est.reinforce_plus_plus(ARGS, [0.3] * 4, 2, LENGTHS) == [0.0] * 4  # nothing to learn from


def test_reinforce_plus_plus_baseline_whitens_the_group_centred_rewards() -> None:
    centred = [0.5, -0.5, 0.0, 0.0]
    mean = (1 * 0.5 + 3 * -0.5) / 8
    var = (1 * (0.5 - mean) ** 2 + 3 * (-0.5 - mean) ** 2 + 4 * mean**2) / 8
    expected = [(c - mean) / (math.sqrt(var) + 1e-6) for c in centred]
    assert est.reinforce_plus_plus_baseline(ARGS, REWARDS, 2, LENGTHS) == pytest.approx(expected)


def test_the_sequence_ratio_is_the_geometric_mean_of_the_token_ratios_and_clips_per_sequence() -> None:
    old = torch.zeros(1, 2)
    log_probs = torch.tensor([[math.log(2.0), 0.0]], requires_grad=True)  # token ratios 2 and 1
    advantages, mask = torch.ones(1, 2), torch.ones(1, 2)
    gspo = LossSettings(importance_ratio_level="sequence", eps_clip=10.0)
    loss, metrics = rl_loss(log_probs, old, advantages, mask, gspo)
    assert loss.item() == pytest.approx(-math.sqrt(2.0))  # -A * sqrt(2 * 1) on each token
    assert metrics[4, 0].item() == pytest.approx(math.sqrt(2.0))  # ppo_ratio: the sequence's
    loss.sum().backward()
    # d/d lp_t of -exp(mean(lp)) = -exp(mean(lp)) / 2 for each of the two tokens.
    assert torch.allclose(log_probs.grad, torch.full((1, 2), -math.sqrt(2.0) / 2))
    clipped, clip_metrics = rl_loss(
        log_probs.detach(), old, advantages, mask, LossSettings(importance_ratio_level="sequence", eps_clip=0.2)
    )
    assert clipped.item() == pytest.approx(-1.2) and clip_metrics[3, 0].item() == 1.0  # both tokens clipped
    per_token, _ = rl_loss(log_probs.detach(), old, advantages, mask, LossSettings(eps_clip=10.0))
    assert per_token.item() == pytest.approx(-(2.0 + 1.0) / 2)


def test_every_estimator_is_registered_and_gspo_defaults_to_the_sequence_ratio(tmp_path: Path) -> None:
    base = ["--plugin", "straw", "--save", str(tmp_path / "r")]
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        args = parse_args([*base, "--advantage-estimator", name])
        assert LossSettings.from_args(args).importance_ratio_level == "token", name
    assert LossSettings.from_args(parse_args([*base, "--advantage-estimator", "gspo"])).importance_ratio_level == (
        "sequence"
    )
    overridden = parse_args([*base, "--advantage-estimator", "gspo", "--importance-ratio-level", "token"])
    assert LossSettings.from_args(overridden).importance_ratio_level == "token"


def test_parse_time_refusals_name_the_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = ["--plugin", "straw", "--save", str(tmp_path / "r")]
    with pytest.raises(SystemExit) as exited:
        parse_args([*base, "--advantage-estimator", "ppo2"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "No advantage estimator named 'ppo2'" in error and "dr_grpo, grpo, gspo, ppo, reinforce_plus_plus" in error
    with pytest.raises(SystemExit):
        parse_args([*base, "--advantage-estimator", "ppo"])
    assert "--advantage-estimator ppo needs a value model: add --use-critic" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([*base, "--use-critic"])
    assert "--use-critic trains a value model that --advantage-estimator grpo does not use" in capsys.readouterr().err


def test_an_estimator_that_needs_a_critic_is_refused_without_one(tmp_path: Path, capsys, monkeypatch) -> None:
    import slime.utils.arguments as arguments
    from slime import hookimpl

    class CriticPlugin:
        @hookimpl
        def slime_advantage_estimators(self):
            return [AdvantageEstimatorSpec("value-baseline", est.dr_grpo, needs_critic=True)]

    original = arguments.build_plugin_manager

    def build(selection=None):
        pm = original(selection)
        pm.register(CriticPlugin(), name="critic_plugin")
        return pm

    monkeypatch.setattr(arguments, "build_plugin_manager", build)
    with pytest.raises(SystemExit):
        parse_args(["--plugin", "straw", "--save", str(tmp_path / "r"), "--advantage-estimator", "value-baseline"])
    assert "--advantage-estimator value-baseline needs a value model: add --use-critic" in capsys.readouterr().err


def test_a_spec_with_an_unknown_ratio_level_is_refused() -> None:
    with pytest.raises(ValueError, match="ratio_level must be one of token, sequence"):
        AdvantageEstimatorSpec("x", est.grpo, ratio_level="group")


def test_the_batch_builder_trains_with_the_estimators_advantages() -> None:
    from slime.data.batch_builder import BatchBuilder
    from slime.utils.types import Sample

    def samples() -> list[Sample]:
        out = []
        for index, (reward, length) in enumerate(zip(REWARDS, LENGTHS, strict=True)):
            out.append(
                Sample(
                    index=index,
                    tokens=[1] * (2 + length),
                    response_length=length,
                    reward=reward,
                    status=Sample.Status.COMPLETED,
                )
            )
        return out

    def rewards(**overrides) -> list[float]:
        args = SimpleNamespace(n_samples_per_prompt=2, rewards_normalization=True, grpo_std_normalization=True)
        vars(args).update(overrides)
        return BatchBuilder(args).convert(samples())["rewards"]

    assert rewards(advantage_estimator="rloo") == pytest.approx(est.rloo(ARGS, REWARDS, 2, LENGTHS))
    assert rewards(advantage_estimator="reinforce_plus_plus") == pytest.approx(
        est.reinforce_plus_plus(ARGS, REWARDS, 2, LENGTHS)
    )
    assert rewards(advantage_estimator="grpo", rewards_normalization=False) == REWARDS
