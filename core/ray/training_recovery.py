"""Trainer fault tolerance: when a run can recover its trainers, and the checkpoint settings that requires."""

from __future__ import annotations

from typing import Any


def training_recovery_enabled(args: Any) -> bool:
    """Whether trainer recovery applies: a durable transport (or a debug dump), Megatron, no external rollout.

    Debug and replay modes never recover: they neither own a live queue nor produce resumable steps.
    """
    from slime.data.transport import use_straw

    if any(
        getattr(args, name, False) for name in ("debug_train_only", "debug_rollout_only", "load_debug_rollout_data")
    ):
        return False
    if getattr(args, "rollout_external", False):
        return False
    if (getattr(args, "train_backend", None) or "megatron") != "megatron":
        return False
    return bool(use_straw(args) or getattr(args, "save_debug_rollout_data", None))


def configure_recovery_checkpoint(args: Any) -> None:
    """Require resumable trainer checkpoints (optimizer and RNG state, torch_dist) and make them reshardable.

    A recovered trainer may come back with a different data-parallel layout, so the distributed
    checkpoint must be saved fully parallel with a reshardable optimizer state.
    """
    if getattr(args, "no_save_rng", False) or (
        getattr(args, "no_save_optim", False) and not getattr(args, "use_stateless_adam", False)
    ):
        raise ValueError(
            "Trainer fault tolerance requires optimizer and RNG state; only --use-stateless-adam may omit optimizer "
            "state (drop --no-save-optim/--no-save-rng)"
        )
    ckpt_format = getattr(args, "ckpt_format", "torch_dist")
    if ckpt_format != "torch_dist":
        raise ValueError(f"Trainer fault tolerance requires --ckpt-format torch_dist, got {ckpt_format!r}")
    args.ckpt_fully_parallel_save = True
    args.dist_ckpt_optim_fully_reshardable = True
