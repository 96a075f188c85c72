"""`--kl-coef`: a KL penalty in the reward (upstream slime's meaning), checked by hand and in the torch backend."""

from __future__ import annotations

import math

import pytest
import torch
from test_torch_backend import hf_dir, make_args, make_batch, start  # noqa: F401  (hf_dir: a fixture)

from slime.plugins.rl_losses import LossSettings, kl_shaped_advantages


def test_each_token_loses_the_penalty_of_itself_and_every_later_counted_token() -> None:
    # Old policy vs reference log-ratios 0.2, -0.1, 0.4, 0.3 (k1 estimates the KL as the log-ratio itself); the
    # third token is masked out (tool output), so its KL is not charged.
    old = torch.tensor([0.2, -0.1, 0.4, 0.3])
    ref = torch.zeros(4)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    settings = LossSettings(kl_reward_coef=0.5, kl_loss_type="k1")
    shaped, penalties = kl_shaped_advantages([torch.full((4,), 2.0)], [old], [ref], [mask], settings)
    # Token penalties 0.1, -0.05, 0, 0.15; from token t on: 0.2, 0.1, 0.15, 0.15.
    assert torch.allclose(shaped[0], torch.tensor([1.8, 1.9, 1.85, 1.85]))
    assert penalties == [pytest.approx(0.2)]


def test_k3_penalty_is_zero_where_the_old_policy_is_the_reference_and_positive_elsewhere() -> None:
    settings = LossSettings(kl_reward_coef=0.1, kl_loss_type="k3")
    same = torch.log(torch.tensor([0.5, 0.25]))
    shaped, penalties = kl_shaped_advantages(
        [torch.tensor([1.0, 1.0]), torch.tensor([-1.0])],
        [same, torch.tensor([math.log(0.5)])],
        [same, torch.tensor([math.log(0.25)])],
        [torch.ones(2), torch.ones(1)],
        settings,
    )
    assert torch.equal(shaped[0], torch.tensor([1.0, 1.0])) and penalties[0] == 0.0
    # k3 of log-ratio d = log(0.5 / 0.25): exp(-d) - (-d) - 1 = 0.5 + log 2 - 1.
    expected = 0.1 * (0.5 + math.log(2.0) - 1.0)
    assert penalties[1] == pytest.approx(expected) and shaped[1].item() == pytest.approx(-1.0 - expected)


def test_lengths_that_disagree_are_refused() -> None:
    with pytest.raises(ValueError):
        kl_shaped_advantages(
            [torch.ones(2)], [torch.zeros(2), torch.zeros(2)], [torch.zeros(2)], [torch.ones(2)], LossSettings()
        )


def test_the_torch_backend_charges_the_penalty_once_the_policy_leaves_the_reference(hf_dir, tmp_path):  # noqa: F811
    actor, _ = start(make_args(hf_dir, tmp_path, kl_coef=0.05, kl_loss_type="k3"))
    assert actor.ref_model is not None
    data = make_batch()
    first = actor.train_from_data(0, data)
    assert first["train/kl_reward"] == 0.0  # the policy starts as the reference
    assert first["train/kl"] == 0.0  # no KL term in the loss: only the reward is shaped
    for step in range(1, 4):
        later = actor.train_from_data(step, data)
    assert later["train/kl_reward"] > 0.0


def test_equal_rewards_still_train_when_the_kl_penalty_gives_a_signal(hf_dir, tmp_path):  # noqa: F811
    actor, _ = start(make_args(hf_dir, tmp_path, kl_coef=0.5, kl_loss_type="k1"))
    moved = actor.train_from_data(0, make_batch())  # the rewarded answers move the policy off the reference
    assert moved["train/steps"] >= 1.0
    flat = make_batch(rewards=(0.0, 0.0, 0.0, 0.0))  # no reward signal: only the KL penalty is left
    metrics = actor.train_from_data(1, flat)
    assert metrics["train/kl_reward"] != 0.0
    assert metrics["train/skipped_steps"] == 0.0 and metrics["train/pg_loss"] != 0.0
