"""The torch backend's optimizer and learning-rate schedule (`slime.plugins.torch_optim`)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from slime.plugins.torch_optim import OptimizerSettings, build_optimizer, lr_multiplier

SCHEDULE = {"lr": 1e-3, "min_lr": 1e-4, "warmup_iters": 10, "decay_iters": 110}


def _lrs(args: SimpleNamespace, steps: int) -> list[float]:
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer, scheduler = build_optimizer([parameter], OptimizerSettings.from_args(args))
    lrs = []
    for _ in range(steps):
        lrs.append(scheduler.get_last_lr()[0])
        parameter.grad = torch.ones(1)
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_warmup_rises_linearly_then_the_style_decays_to_min_lr(style: str) -> None:
    factors = [lr_multiplier(step, decay_style=style, **SCHEDULE) for step in range(130)]
    assert factors[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert factors[10] == pytest.approx(1.0)
    if style == "constant":
        assert factors[10:] == pytest.approx([1.0] * 120)
        return
    assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False)), "the decay never rises"
    assert factors[110] == pytest.approx(0.1) and factors[129] == pytest.approx(0.1)  # min_lr / lr after the end
    middle = factors[60]
    assert middle == pytest.approx(0.55)  # halfway: linear and cosine agree


def test_cosine_decay_by_default_ends_with_the_run() -> None:
    args = SimpleNamespace(
        lr=2e-3,
        lr_decay_style="cosine",
        num_rollout=5,
        rollout_batch_size=4,
        n_samples_per_prompt=2,
        global_batch_size=4,
    )
    assert OptimizerSettings.from_args(args).run_optimizer_steps == 10  # 5 rollouts x 2 optimizer steps
    lrs = _lrs(args, 11)
    assert lrs[0] == pytest.approx(2e-3) and lrs[5] == pytest.approx(1e-3) and lrs[10] == pytest.approx(0.0, abs=1e-12)
    assert lrs[3] == pytest.approx(1e-3 * (1 + math.cos(math.pi * 0.3)))


def test_optimizer_takes_betas_eps_and_weight_decay_from_the_options() -> None:
    args = SimpleNamespace(lr=1e-3, adam_beta1=0.8, adam_beta2=0.999, adam_eps=1e-6, weight_decay=0.1)
    optimizer, _ = build_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimizerSettings.from_args(args))
    group = optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.999), 1e-6, 0.1)
    defaults, _ = build_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimizerSettings.from_args(SimpleNamespace()))
    assert defaults.param_groups[0]["betas"] == (0.9, 0.98) and defaults.param_groups[0]["weight_decay"] == 0.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr_decay_style": "step"}, "--lr-decay-style must be one of constant, linear, cosine, got 'step'"),
        ({"min_lr": 1e-2}, "0 <= --min-lr <= --lr"),
        ({"lr": 0.0}, "need 0 < --lr"),
        ({"lr_warmup_iters": -1}, "--lr-warmup-iters must be >= 0, got -1"),
        ({"lr_decay_style": "linear"}, "needs --lr-decay-iters or --num-rollout"),
        ({"adam_eps": "tiny"}, "--adam-eps must be float, got 'tiny'"),
    ],
)
def test_bad_schedule_options_are_rejected(options: dict, message: str) -> None:
    args = SimpleNamespace(**{"lr": 1e-3, **options})
    with pytest.raises(ValueError, match=message):
        OptimizerSettings.from_args(args)
