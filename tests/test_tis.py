"""Truncated importance sampling (`--use-tis`): the weights, the loss, the torch backend's metrics, bad input."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_torch_backend import hf_dir, make_args, make_batch, start  # noqa: F401  (hf_dir: a fixture)

from slime.plugins.rl_losses import LossSettings, importance_weights, masked_mean, rl_loss
from slime.plugins.train_batch import TrainBatch
from slime.utils.arguments import parse_args


def _settings(**overrides) -> LossSettings:
    return LossSettings(**overrides)


def test_truncate_clamps_the_weight_to_its_bounds() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.5, 0.1, 0.25, 0.9]]))  # ratios 1, 5, 2, 0.5556
    weights, clipped = importance_weights(old, rollout, _settings(use_tis=True, tis_clip=2.0, tis_clip_low=0.6))
    assert torch.allclose(weights, torch.tensor([[1.0, 2.0, 2.0, 0.6]]))
    assert clipped.tolist() == [[0.0, 1.0, 0.0, 1.0]]  # a ratio equal to the bound is inside it


def test_mask_drops_the_tokens_outside_the_bounds_and_keeps_the_rest_unchanged() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.4, 0.1, 0.9]]))  # ratios 1.25, 5, 0.5556
    weights, clipped = importance_weights(
        old, rollout, _settings(use_tis=True, tis_mode="mask", tis_clip=2.0, tis_clip_low=0.6)
    )
    assert torch.allclose(weights, torch.tensor([[1.25, 0.0, 0.0]]))
    assert clipped.tolist() == [[0.0, 1.0, 1.0]]


def test_the_policy_loss_is_weighted_by_hand_computed_values_and_the_weight_carries_no_gradient() -> None:
    # One sample of two tokens, advantage 1, policy equal to the old policy (ratio 1, nothing PPO-clipped):
    # the per-token policy loss is -1, the TIS weights exp(0 - log 0.25) = 4 -> 3 (clip) and exp(0 - 0) = 1.
    log_probs = torch.zeros(1, 2, requires_grad=True)
    old = torch.zeros(1, 2)
    rollout = torch.tensor([[math.log(0.25), 0.0]])
    mask = torch.ones(1, 2)
    settings = _settings(use_tis=True, tis_clip=3.0)
    loss, metrics = rl_loss(log_probs, old, torch.ones(1, 2), mask, settings, rollout_log_probs=rollout)
    assert loss.item() == pytest.approx((-3.0 - 1.0) / 2)
    loss.sum().backward()
    # d/dlp of -A * w * exp(lp - old) at lp = old is -w / 2 per token (the mean over two tokens).
    assert torch.allclose(log_probs.grad, torch.tensor([[-1.5, -0.5]]))
    by_name = dict(
        zip(
            ("loss", "pg_loss", "kl", "clipfrac", "ppo_ratio", "entropy", "tis_weight", "tis_clipfrac"),
            metrics[:, 0].tolist(),
            strict=True,
        )
    )
    assert by_name["tis_weight"] == pytest.approx(2.0) and by_name["tis_clipfrac"] == pytest.approx(0.5)
    plain, plain_metrics = rl_loss(log_probs.detach(), old, torch.ones(1, 2), mask, _settings())
    assert plain.item() == pytest.approx(-1.0)
    assert plain_metrics[6, 0].item() == 1.0 and plain_metrics[7, 0].item() == 0.0


def test_tis_weights_only_the_policy_term_not_the_kl_or_the_entropy() -> None:
    log_probs = torch.zeros(1, 1)
    ref = torch.tensor([[-0.5]])
    entropy = torch.tensor([[2.0]])
    settings = _settings(use_tis=True, tis_clip=10.0, kl_loss_coef=0.1, entropy_coef=0.01)
    rollout = torch.tensor([[math.log(0.5)]])  # weight 2
    weighted, _ = rl_loss(log_probs, log_probs, torch.ones(1, 1), torch.ones(1, 1), settings, entropy, ref, rollout)
    unweighted, _ = rl_loss(
        log_probs,
        log_probs,
        torch.ones(1, 1),
        torch.ones(1, 1),
        _settings(kl_loss_coef=0.1, entropy_coef=0.01),
        entropy,
        ref,
    )
    assert weighted.item() - unweighted.item() == pytest.approx(-1.0)  # only -A * ratio (= -1) is doubled


def test_tis_without_rollout_log_probs_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--use-tis needs the engines' log-probs"):
        rl_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), _settings(use_tis=True))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tis_clip": 0.0}, "--tis-clip must be > 0"),
        ({"tis_clip": 2.0, "tis_clip_low": 2.0}, r"--tis-clip-low \(2.0\) must be below --tis-clip \(2.0\)"),
        ({"tis_clip_low": -1.0}, "--tis-clip-low must be >= 0"),
        ({"tis_mode": "drop"}, "--tis-mode must be one of truncate, mask"),
    ],
)
def test_tis_settings_out_of_range_name_the_flag(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _settings(**overrides)


def test_the_tis_metrics_are_reported_only_with_use_tis() -> None:
    assert "tis_clipfrac" not in _settings().metric_names
    assert _settings(use_tis=True).metric_names[-2:] == ("tis_weight", "tis_clipfrac")


def test_the_torch_backend_weights_by_the_engines_log_probs(hf_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    actor, _ = start(make_args(hf_dir, tmp_path / "tis", use_tis=True, tis_clip=2.0))
    data = make_batch()
    trainer = actor._frozen_log_probs(actor.model, TrainBatch.from_data(data), [[0, 1, 2, 3]])
    data["rollout_log_probs"] = [(lp - 5.0).tolist() for lp in trainer]  # every weight e^5, clipped to 2
    metrics = actor.train_from_data(0, data)
    assert metrics["train/tis_weight"] == pytest.approx(2.0) and metrics["train/tis_clipfrac"] == pytest.approx(1.0)
    data = make_batch()
    with pytest.raises(ValueError, match="--use-tis needs the engines' log-probs"):
        actor.train_from_data(1, data)  # no rollout_log_probs in the batch
    plain, _ = start(make_args(hf_dir, tmp_path / "plain"))
    assert "train/tis_weight" not in plain.train_from_data(0, make_batch())


def test_tis_with_the_engines_log_probs_as_the_old_policy_is_refused_at_parse_time(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--plugin", "straw", "--save", str(tmp_path / "r"), "--use-tis", "--use-rollout-logprobs"])
    assert exited.value.code == 2
    assert "--use-tis with --use-rollout-logprobs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--plugin", "straw", "--save", str(tmp_path / "r"), "--use-tis", "--tis-clip", "-1"])
    assert "--tis-clip must be > 0" in capsys.readouterr().err
    args = parse_args(["--plugin", "straw", "--save", str(tmp_path / "r"), "--use-tis", "--tis-mode", "mask"])
    assert LossSettings.from_args(args).tis_mode == "mask"


def test_masked_mean_of_clipped_gives_the_clipped_fraction() -> None:
    _, clipped = importance_weights(torch.zeros(2, 2), torch.tensor([[-3.0, 0.0], [0.0, 0.0]]), _settings(use_tis=True))
    assert masked_mean(clipped, torch.tensor([[1, 1], [1, 0]])).tolist() == [0.5, 0.0]
