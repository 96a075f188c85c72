"""The torch training backend's settings: everything a rank reads from the run's arguments, validated once.

`TorchTrainRayActor.init(args, ...)` builds `TrainSettings.from_args(args)`; the backend, its optimizer
(`slime.plugins.torch_optim.OptimizerSettings`), its loss (`slime.plugins.rl_losses.LossSettings`) and its
adapters (`slime.plugins.torch_lora.LoraSettings`) read only this object afterwards. Attributes `args` lacks take
the flags' defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime.plugins.rl_losses import LossSettings
from slime.plugins.torch_lora import LoraSettings
from slime.plugins.torch_optim import OptimizerSettings
from slime.utils.settings import Settings, option, options_from_args


@dataclass(frozen=True)
class TrainSettings(Settings):
    """One torch training rank's settings (see the flags of the same names in `slime-run --help`)."""

    seed: int = option("seed", 1234, convert=int)
    #: The model to train, and the KL loss's reference unless `ref_load` (None: the built-in tiny model).
    hf_checkpoint: str | None = option("hf_checkpoint")
    #: The KL loss's reference model when not `hf_checkpoint` (a Hugging Face model directory).
    ref_load: str | None = option("ref_load")
    load: str | None = option("load")
    ckpt_step: int | None = option("ckpt_step", convert=int, minimum=0)
    no_load_optim: bool = option("no_load_optim", False)
    no_load_rng: bool = option("no_load_rng", False)
    save: str | None = option("save")
    no_save_optim: bool = option("no_save_optim", False)
    no_save_rng: bool = option("no_save_rng", False)
    #: Also copy each checkpoint's Hugging Face files to this directory (`{rollout_id}` is replaced by the step).
    save_hf: str | None = option("save_hf")
    micro_batch_size: int = option("micro_batch_size", 8, convert=int, minimum=1)
    use_rollout_logprobs: bool = option("use_rollout_logprobs", False)
    #: bfloat16 autocast for every forward pass; weights, gradients and optimizer state stay float32
    #: (`slime.plugins.torch_parallel`).
    bf16: bool = option("bf16", False)
    #: float16 autocast with dynamic loss scaling (`torch.amp.GradScaler`); weights and optimizer state float32.
    fp16: bool = option("fp16", False)
    #: Recompute decoder layers' activations in the backward pass (Hugging Face, non-reentrant).
    gradient_checkpointing: bool = option("gradient_checkpointing", False)
    #: Shard the model with FSDP2 instead of replicating it with DDP (also at world size 1: nothing to shard).
    fsdp: bool = option("fsdp", False)
    #: `--deterministic`: deterministic torch kernels (CUDA: with the cuBLAS workspace setting they need).
    deterministic: bool = option("deterministic", False)
    #: Set by the framework: the first rollout step of a run that loads no checkpoint (None: 0).
    start_rollout_id: int | None = option("start_rollout_id", convert=int, minimum=0)
    loss: LossSettings = field(default_factory=LossSettings)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    #: LoRA adapters instead of full fine-tuning when `lora.enabled` (`--lora-rank`; `slime.plugins.torch_lora`).
    lora: LoraSettings = field(default_factory=LoraSettings)

    @classmethod
    def from_args(cls, args: Any) -> TrainSettings:
        """The settings of `args`; ValueError naming the flag when one is out of range."""
        return cls(
            **options_from_args(cls, args),
            loss=LossSettings.from_args(args),
            optimizer=OptimizerSettings.from_args(args),
            lora=LoraSettings.from_args(args),
        )
