"""The Megatron backend's settings: its parallel layout and training options, parsed once from the run's arguments.

`MegatronSettings.from_args(args)` is all a rank reads; it carries the torch backend's `TrainSettings` (model,
checkpoints, loss, optimizer: the flags both backends share) and what only Megatron has: the parallel layout,
activation recompute, the distributed optimizer and `--save-hf`. `check_cpu_support` refuses, with the reason,
what megatron-core cannot do without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime.plugins.torch_settings import TrainSettings
from slime.utils.settings import Settings, option, options_from_args

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(frozen=True)
class MegatronSettings(Settings):
    """One Megatron training rank's settings (see the flags of the same names in `slime-run --help`)."""

    tensor_model_parallel_size: int = option("tensor_model_parallel_size", 1, convert=int, minimum=1)
    pipeline_model_parallel_size: int = option("pipeline_model_parallel_size", 1, convert=int, minimum=1)
    context_parallel_size: int = option("context_parallel_size", 1, convert=int, minimum=1)
    expert_model_parallel_size: int = option("expert_model_parallel_size", 1, convert=int, minimum=1)
    sequence_parallel: bool = option("sequence_parallel", False)
    recompute_granularity: str | None = option("recompute_granularity", None, choices=RECOMPUTE_GRANULARITIES)
    recompute_method: str | None = option("recompute_method", None, choices=RECOMPUTE_METHODS)
    recompute_num_layers: int | None = option("recompute_num_layers", None, convert=int, minimum=1)
    use_distributed_optimizer: bool = option("use_distributed_optimizer", False)
    bf16: bool = option("bf16", False)
    #: Also write each checkpoint as a Hugging Face directory here (`{rollout_id}` is replaced by the step).
    save_hf: str | None = option("save_hf")
    train: TrainSettings = field(default_factory=TrainSettings)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recompute_granularity == "full" and self.recompute_method is None:
            raise ValueError("--recompute-granularity full needs --recompute-method uniform or block")
        if self.recompute_method is not None and self.recompute_granularity != "full":
            raise ValueError("--recompute-method applies to --recompute-granularity full only")
        if self.recompute_method is not None and self.recompute_num_layers is None:
            raise ValueError(f"--recompute-method {self.recompute_method} needs --recompute-num-layers")

    @classmethod
    def from_args(cls, args: Any) -> MegatronSettings:
        """The settings of `args`; ValueError naming the flag when one is out of range or inconsistent."""
        return cls(**options_from_args(cls, args), train=TrainSettings.from_args(args))

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model between them (tensor x pipeline x context parallel)."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def layout(self) -> Any:
        """The `model.ParallelLayout` of these settings (imports megatron-core's parallel state helpers lazily)."""
        from slime.plugins.megatron_backend.model import ParallelLayout

        return ParallelLayout(
            tp=self.tensor_model_parallel_size,
            pp=self.pipeline_model_parallel_size,
            cp=self.context_parallel_size,
            ep=self.expert_model_parallel_size,
        )

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel ranks among `world_size` training ranks; ValueError when the layout does not divide it."""
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"{world_size} training ranks cannot be split into --tensor-model-parallel-size "
                f"{self.tensor_model_parallel_size} x --pipeline-model-parallel-size "
                f"{self.pipeline_model_parallel_size} x --context-parallel-size {self.context_parallel_size} "
                f"= {self.model_parallel_size}; use a multiple of {self.model_parallel_size} ranks "
                "(--actor-num-nodes x --actor-num-gpus-per-node)"
            )
        return world_size // self.model_parallel_size


def check_cpu_support(settings: MegatronSettings) -> None:
    """Refuse what megatron-core cannot run without a GPU, naming the flag and why (never degrade silently)."""
    if settings.sequence_parallel:
        raise ValueError(
            "--sequence-parallel needs a GPU: megatron-core's sequence parallelism is not supported by the torch "
            "normalization layers a CPU run uses (TransformerEngine is CUDA-only); drop it on this machine"
        )
    if settings.context_parallel_size > 1:
        raise ValueError(
            "--context-parallel-size > 1 needs a GPU: context-parallel attention exists only in TransformerEngine; "
            "use 1 on this machine"
        )


def check_model_support(settings: MegatronSettings) -> None:
    """Refuse options that have no meaning for the dense model families this backend builds, or that it lacks."""
    if settings.train.fp16:
        raise ValueError(
            "--fp16: the Megatron backend here trains in float32 or --bf16 (float16 loss scaling is not wired); "
            "use --bf16, or --train-backend torch for --fp16"
        )
    if settings.expert_model_parallel_size > 1:
        raise ValueError(
            f"--expert-model-parallel-size {settings.expert_model_parallel_size}: the Megatron backend builds the "
            "dense Qwen2, Qwen3 and Llama families, which have no experts; use 1"
        )


def check_model(hf_dir: str, settings: MegatronSettings, flag: str = "--hf-checkpoint") -> Any:
    """The Hugging Face config of `hf_dir`, checked: a supported family, and a layout that splits its heads and
    layers evenly (imports megatron-core). Errors name `flag`, the option that gave `hf_dir`."""
    from transformers import AutoConfig

    from slime.plugins.megatron_backend.cpu_compat import silence_fallback_notices

    silence_fallback_notices()
    from slime.plugins.megatron_backend.convert import family_of
    from slime.plugins.megatron_backend.model import check_layout

    try:
        hf_config = AutoConfig.from_pretrained(hf_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag} {hf_dir}: cannot read its config.json ({exc})") from exc
    try:
        family_of(hf_config)
        check_layout(hf_config, settings.layout)
    except ValueError as exc:
        raise ValueError(f"{flag} {hf_dir}: {exc}") from exc
    return hf_config


#: What a reference model must share with the policy to be built with the policy's layout and score its tokens.
ARCHITECTURE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)


def check_same_architecture(policy_config: Any, reference_config: Any, reference_dir: str) -> None:
    """`--ref-load` on this backend: the reference is built with the policy's layout, so its shape must match."""
    differences = [
        f"{key} {getattr(reference_config, key, None)} (policy: {getattr(policy_config, key, None)})"
        for key in ARCHITECTURE_KEYS
        if getattr(reference_config, key, None) != getattr(policy_config, key, None)
    ]
    if differences:
        raise ValueError(
            f"--ref-load {reference_dir} is not the policy's architecture, which the Megatron backend needs to build "
            f"the reference with the policy's layout: {', '.join(differences)}; give a checkpoint of the same model"
        )
