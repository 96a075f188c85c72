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
from dataclasses import dataclass
from typing import Any

import torch

from slime.utils.settings import Settings, option, options_from_args

LR_DECAY_STYLES = ("constant", "linear", "cosine")
#: Defaults of the optimizer options: of the flags and of `OptimizerSettings` (for `args` objects that lack one).
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
#: The default of the core `--lr` flag.
DEFAULT_LR = 1e-3


@dataclass(frozen=True)
class OptimizerSettings(Settings):
    """AdamW and its schedule; `run_optimizer_steps` is the run's length in optimizer steps (None when unknown)."""

    lr: float = option("lr", DEFAULT_LR, convert=float)
    min_lr: float = option("min_lr", DEFAULTS["min_lr"], convert=float)
    adam_beta1: float = option("adam_beta1", DEFAULTS["adam_beta1"], convert=float)
    adam_beta2: float = option("adam_beta2", DEFAULTS["adam_beta2"], convert=float)
    adam_eps: float = option("adam_eps", DEFAULTS["adam_eps"], convert=float, minimum=0.0)
    weight_decay: float = option("weight_decay", DEFAULTS["weight_decay"], convert=float, minimum=0.0)
    clip_grad: float = option("clip_grad", DEFAULTS["clip_grad"], convert=float, minimum=0.0)
    lr_warmup_iters: int = option("lr_warmup_iters", DEFAULTS["lr_warmup_iters"], convert=int, minimum=0)
    lr_decay_style: str = option("lr_decay_style", DEFAULTS["lr_decay_style"], choices=LR_DECAY_STYLES)
    lr_decay_iters: int | None = option("lr_decay_iters", DEFAULTS["lr_decay_iters"], convert=int, minimum=0)
    run_optimizer_steps: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lr <= 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 < --lr and 0 <= --min-lr <= --lr, got --lr {self.lr} --min-lr {self.min_lr}")
        if self.lr_decay_style != "constant" and self.lr_decay_iters is None and self.run_optimizer_steps is None:
            raise ValueError(
                f"--lr-decay-style {self.lr_decay_style} needs --lr-decay-iters or --num-rollout to know when to end"
            )

    @classmethod
    def from_args(cls, args: Any) -> OptimizerSettings:
        """The settings of `args` (absent options take `DEFAULTS`); the run's length comes from `--num-rollout`,
        `--rollout-batch-size`, `--n-samples-per-prompt` and `--global-batch-size`."""
        return cls(**options_from_args(cls, args), run_optimizer_steps=_run_optimizer_steps(args))

    @property
    def decay_iters(self) -> int:
        """The optimizer step at which the decay reaches `min_lr` (0 for a constant schedule)."""
        if self.lr_decay_iters is not None:
            return self.lr_decay_iters
        return 0 if self.lr_decay_style == "constant" else int(self.run_optimizer_steps or 0)


def _run_optimizer_steps(args: Any) -> int | None:
    """`--num-rollout` times the optimizer steps of one rollout (its samples over `--global-batch-size`, 1
    without one); None without `--num-rollout`."""
    num_rollout = getattr(args, "num_rollout", None)
    if not num_rollout:
        return None
    samples = int(getattr(args, "rollout_batch_size", 0) or 0) * int(getattr(args, "n_samples_per_prompt", 1) or 1)
    global_batch = int(getattr(args, "global_batch_size", 0) or 0)
    per_rollout = max(samples // global_batch, 1) if samples > 0 and global_batch > 0 else 1
    return int(num_rollout) * per_rollout


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


def build_optimizer(
    parameters: Iterable[torch.nn.Parameter], settings: OptimizerSettings
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `parameters` and its schedule."""
    optimizer = torch.optim.AdamW(
        parameters,
        lr=settings.lr,
        betas=(settings.adam_beta1, settings.adam_beta2),
        eps=settings.adam_eps,
        weight_decay=settings.weight_decay,
    )
    schedule = {
        "lr": settings.lr,
        "min_lr": settings.min_lr,
        "warmup_iters": settings.lr_warmup_iters,
        "decay_style": settings.lr_decay_style,
        "decay_iters": settings.decay_iters,
    }
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, **schedule))
    return optimizer, scheduler


def add_optimizer_options(parser: argparse.ArgumentParser) -> None:
    """The `optimizer (every train backend)` option group of `slime-run --help`."""
    group = parser.add_argument_group("optimizer (every train backend)")
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
