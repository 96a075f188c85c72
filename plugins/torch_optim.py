"""The torch backend's optimizer and learning-rate schedule, and the command-line options that shape them.

One place builds both, so the trainer and `benchmarks/demo_floor.py` (the demo's algorithm without the
framework) cannot drift apart. The schedule counts optimizer steps (not rollout steps): linear warm-up over
`--lr-warmup-iters`, then `--lr-decay-style` (constant, linear or cosine) from `--lr` down to `--min-lr` at
`--lr-decay-iters`, and `--min-lr` after that. Without `--lr-decay-iters` a decaying schedule ends with the
run: `--num-rollout` times the optimizer steps of one rollout.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from typing import Any

import torch

LR_DECAY_STYLES = ("constant", "linear", "cosine")
#: Defaults of the optimizer options, for the flags and for `args` objects that lack one (tests, the floor).
DEFAULTS = {
    "adam_beta1": 0.9,
    "adam_beta2": 0.98,
    "adam_eps": 1e-8,
    "weight_decay": 0.0,
    "clip_grad": 1.0,
    "lr_warmup_iters": 0,
    "lr_decay_style": "constant",
    "lr_decay_iters": None,
    "min_lr": 0.0,
}


def optimizer_option(args: Any, name: str) -> Any:
    """`args.<name>`, or its default when `args` lacks it or holds None."""
    value = getattr(args, name, None)
    return DEFAULTS[name] if value is None else value


def lr_multiplier(
    step: int, *, lr: float, min_lr: float, warmup_iters: int, decay_style: str, decay_iters: int
) -> float:
    """The factor on `lr` for optimizer step `step` (0-based): warm-up, then decay to `min_lr / lr`."""
    if warmup_iters > 0 and step < warmup_iters:
        return (step + 1) / warmup_iters
    if decay_style == "constant":
        return 1.0
    floor = min_lr / lr if lr > 0 else 0.0
    span = max(decay_iters - warmup_iters, 1)
    progress = min(max(step - warmup_iters, 0) / span, 1.0)
    if decay_style == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    if decay_style == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown --lr-decay-style {decay_style!r}; use one of {', '.join(LR_DECAY_STYLES)}")


def optimizer_steps_per_rollout(args: Any) -> int:
    """Optimizer steps one rollout step takes: its samples over `--global-batch-size` (1 without one)."""
    samples = int(getattr(args, "rollout_batch_size", 0) or 0) * int(getattr(args, "n_samples_per_prompt", 1) or 1)
    global_batch = int(getattr(args, "global_batch_size", 0) or 0)
    if samples <= 0 or global_batch <= 0:
        return 1
    return max(samples // global_batch, 1)


def _decay_iters(args: Any, style: str) -> int:
    explicit = getattr(args, "lr_decay_iters", None)
    if explicit is not None:
        return int(explicit)
    if style == "constant":
        return 0
    num_rollout = getattr(args, "num_rollout", None)
    if not num_rollout:
        raise ValueError(f"--lr-decay-style {style} needs --lr-decay-iters or --num-rollout to know when to end")
    return int(num_rollout) * optimizer_steps_per_rollout(args)


def build_optimizer(
    parameters: Iterable[torch.nn.Parameter], args: Any
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `parameters` and its schedule, from `args` (`lr`, `min_lr`, `adam_beta1/2`, `adam_eps`,
    `weight_decay`, `lr_warmup_iters`, `lr_decay_style`, `lr_decay_iters`; absent ones take the defaults
    of `add_optimizer_options`)."""
    lr = float(getattr(args, "lr", 1e-3))
    min_lr = float(optimizer_option(args, "min_lr"))
    warmup = int(optimizer_option(args, "lr_warmup_iters"))
    style = optimizer_option(args, "lr_decay_style")
    if style not in LR_DECAY_STYLES:
        raise ValueError(f"unknown --lr-decay-style {style!r}; use one of {', '.join(LR_DECAY_STYLES)}")
    if lr <= 0 or not 0 <= min_lr <= lr:
        raise ValueError(f"need 0 < --lr and 0 <= --min-lr <= --lr, got --lr {lr} --min-lr {min_lr}")
    if warmup < 0:
        raise ValueError(f"--lr-warmup-iters must be non-negative, got {warmup}")
    decay_iters = _decay_iters(args, style)
    optimizer = torch.optim.AdamW(
        parameters,
        lr=lr,
        betas=(float(optimizer_option(args, "adam_beta1")), float(optimizer_option(args, "adam_beta2"))),
        eps=float(optimizer_option(args, "adam_eps")),
        weight_decay=float(optimizer_option(args, "weight_decay")),
    )
    schedule = {"lr": lr, "min_lr": min_lr, "warmup_iters": warmup, "decay_style": style, "decay_iters": decay_iters}
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, **schedule))
    return optimizer, scheduler


def add_optimizer_options(parser: argparse.ArgumentParser) -> None:
    """The `optimizer (torch backend)` option group of `slime-run --help`."""
    group = parser.add_argument_group("optimizer (torch backend)")
    group.set_defaults(**DEFAULTS)
    group.add_argument("--adam-beta1", type=float)
    group.add_argument("--adam-beta2", type=float)
    group.add_argument("--adam-eps", type=float)
    group.add_argument("--weight-decay", type=float)
    group.add_argument("--clip-grad", type=float, help="gradient-norm clip per optimizer step (0: off)")
    group.add_argument("--lr-warmup-iters", type=int, help="optimizer steps of linear warm-up")
    group.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES)
    group.add_argument(
        "--lr-decay-iters",
        type=int,
        help="optimizer step at which the decay reaches --min-lr (default: the run's last optimizer step)",
    )
    group.add_argument("--min-lr", type=float, help="learning rate at the end of the decay")
