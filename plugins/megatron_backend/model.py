"""Megatron-core's parallel state, GPTModel and optimizer for a Hugging Face Qwen2, Qwen3 or Llama config.

Everything a training rank builds comes from here so that one place decides how a Hugging Face config maps onto
Megatron: `transformer_config` (the layer shapes and options of the family), `build_model` (this rank's pipeline
stage as a GPTModel with the local layer spec, which needs no TransformerEngine and therefore runs on CPU too,
wrapped for bf16 and data parallelism), `build_optimizer` (Megatron's Adam with fp32 main weights in bf16) and the
attention inputs (`causal_inputs`, `pack_sequences`): the local attention takes an explicit boolean mask, so
packed sequences are one row with a block-diagonal causal mask rather than TransformerEngine's THD format.

The vocabulary is padded to a multiple of `VOCAB_PAD_MULTIPLE` (and of the tensor-parallel size), never refused;
`vocab_parallel` masks the padding out of log-probs and entropy and `convert` strips it on export.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from slime.plugins.megatron_backend.cpu_compat import apply_cpu_compat, cpu_mode

#: Megatron's usual padding unit: independent of the tensor-parallel size (for TP sizes dividing it), so that a
#: checkpoint's embedding shape does not change when it is resumed with another TP size.
VOCAB_PAD_MULTIPLE = 128


@dataclass(frozen=True)
class ParallelLayout:
    """How the ranks of a job split the model: tensor, pipeline, context and expert parallel sizes. The rest of
    the ranks are data parallel."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelLayout.{name} must be a positive integer, got {value!r}")

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model between them (tp x pp x cp)."""
        return self.tp * self.pp * self.cp

    def dp(self, world_size: int) -> int:
        """Data-parallel size for `world_size` ranks; ValueError when tp x pp x cp does not divide it."""
        if world_size < 1 or world_size % self.model_parallel_size:
            raise ValueError(
                f"{world_size} ranks cannot be split into tensor {self.tp} x pipeline {self.pp} x context {self.cp} "
                f"= {self.model_parallel_size}-rank model replicas; use a multiple of {self.model_parallel_size} ranks"
            )
        return world_size // self.model_parallel_size


# ---------------------------------------------------------------------------------------------------------------
# Parallel state.


def initialize_parallel(layout: ParallelLayout, seed: int) -> None:
    """Create Megatron's tensor/pipeline/data-parallel groups over the already initialized default process group
    and seed the generators.

    torch.distributed must be initialized first (gloo without a GPU, nccl with one). On CPU the CPU fixes are
    applied first (`cpu_compat.apply_cpu_compat`). Seeding follows Megatron's training loop: torch's generator gets
    `seed + 100 * pipeline_rank`, then `model_parallel_cuda_manual_seed` fills the tracked model-parallel states
    (on CPU a tracker on the CPU generator).
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise RuntimeError(
            "initialize_parallel needs torch.distributed initialized first: call "
            "torch.distributed.init_process_group('gloo' without a GPU, 'nccl' with one) on every rank"
        )
    if cpu_mode():
        _check_cpu_layout(layout)
    apply_cpu_compat()
    from megatron.core import parallel_state, tensor_parallel

    layout.dp(torch.distributed.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron's parallel state is already initialized; call destroy_parallel() first")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
    )
    torch.manual_seed(seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Forget Megatron's parallel state and RNG tracker (the default process group stays: its creator destroys it)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mpu_random

    parallel_state.destroy_model_parallel()
    mpu_random.initialize_rng_tracker(force_reset=True)


# ---------------------------------------------------------------------------------------------------------------
# Model configuration.


def _check_cpu_layout(layout: ParallelLayout) -> None:
    if layout.cp > 1:
        raise ValueError(
            f"context parallel size {layout.cp} needs a GPU: megatron-core's context-parallel attention exists only "
            "in TransformerEngine, which is CUDA-only; use 1 without a GPU"
        )
    if layout.ep > 1:
        raise ValueError(
            f"expert parallel size {layout.ep}: the supported families (Qwen2, Qwen3, Llama) are dense models "
            "without experts, and expert parallelism needs a GPU; use 1"
        )


def _heads(hf_config: Any) -> tuple[int, int]:
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    return heads, kv_heads


def head_dim(hf_config: Any) -> int:
    """Per-head width: the config's explicit `head_dim` (Qwen3, some Llamas) or hidden_size / num_attention_heads."""
    explicit = getattr(hf_config, "head_dim", None)
    return int(explicit) if explicit else int(hf_config.hidden_size) // int(hf_config.num_attention_heads)


def check_layout(hf_config: Any, layout: ParallelLayout) -> None:
    """ValueError, naming the numbers, when `layout` cannot split this model evenly or cannot run on this machine.

    TP must divide the attention heads and the key/value heads, PP the layers. Without a GPU, context and expert
    parallelism are refused (why is in the message). The vocabulary is padded, never refused.
    """
    heads, kv_heads = _heads(hf_config)
    layers = int(hf_config.num_hidden_layers)
    if heads % layout.tp or kv_heads % layout.tp:
        raise ValueError(
            f"tensor parallel size {layout.tp} must divide the model's num_attention_heads ({heads}) and "
            f"num_key_value_heads ({kv_heads}); choose a tensor parallel size dividing both"
        )
    if layers % layout.pp:
        raise ValueError(
            f"pipeline parallel size {layout.pp} must divide the model's num_hidden_layers ({layers}); "
            "choose a pipeline parallel size dividing it"
        )
    if layout.ep > 1:
        raise ValueError(
            f"expert parallel size {layout.ep}: the supported families (Qwen2, Qwen3, Llama) are dense models "
            "without experts; use 1"
        )
    if cpu_mode():
        _check_cpu_layout(layout)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """`vocab_size` rounded up to a multiple of lcm(VOCAB_PAD_MULTIPLE, tp): every TP rank holds an equal slice."""
    multiple = math.lcm(VOCAB_PAD_MULTIPLE, tp)
    return -(-int(vocab_size) // multiple) * multiple


def rope_settings(hf_config: Any) -> dict[str, Any]:
    """GPTModel's RoPE arguments for the config: `rotary_base` and, for Llama 3's "llama3" scaling, `rope_scaling`
    and `rope_scaling_factor`. ValueError for scalings Megatron's RoPE cannot reproduce exactly."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})  # transformers >= 5
    legacy = getattr(hf_config, "rope_scaling", None)  # transformers 4
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return {"rotary_base": float(theta), "rope_scaling": False}
    # Megatron's llama3 scaling hard-codes low 1, high 4 and an original context of 8192 (Llama 3.1 / 3.2 / 3.3).
    fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if rope_type == "llama3" and all(float(params.get(key, -1)) == value for key, value in fixed.items()):
        return {"rotary_base": float(theta), "rope_scaling": True, "rope_scaling_factor": float(params["factor"])}
    raise ValueError(
        f"RoPE scaling {params} is not supported by the Megatron backend (supported: none, and 'llama3' with "
        "low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192)"
    )


def transformer_config(
    hf_config: Any,
    layout: ParallelLayout,
    *,
    bf16: bool,
    recompute_granularity: str | None,
    recompute_method: str | None,
    recompute_num_layers: int | None,
):
    """Megatron's TransformerConfig for a Hugging Face Qwen2, Qwen3 or Llama config (ValueError for other families
    or layouts that do not split the model; see `check_layout`)."""
    from megatron.core.transformer import TransformerConfig

    from slime.plugins.megatron_backend.convert import family_spec

    family = family_spec(hf_config)
    check_layout(hf_config, layout)
    heads, kv_heads = _heads(hf_config)
    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        num_layers=int(hf_config.num_hidden_layers),
        hidden_size=int(hf_config.hidden_size),
        ffn_hidden_size=int(hf_config.intermediate_size),
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        sequence_parallel=False,
        # Sequences differ in length from one micro-batch to the next: let the pipeline exchange shapes. Megatron
        # refuses that with its default MoE token dispatcher even for dense models; these have no experts.
        variable_seq_lengths=layout.pp > 1,
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=cpu_mode(),
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        attention_softmax_in_fp32=True,
        recompute_granularity=recompute_granularity,
        recompute_method=recompute_method,
        recompute_num_layers=recompute_num_layers,
    )


# ---------------------------------------------------------------------------------------------------------------
# Model and optimizer.


def unwrap_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Megatron's DistributedDataParallel and Float16Module wrappers."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def build_model(
    hf_config: Any,
    layout: ParallelLayout,
    *,
    bf16: bool = False,
    recompute_granularity: str | None = None,
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
    use_distributed_optimizer: bool = False,
    wrap_ddp: bool = True,
) -> list[torch.nn.Module]:
    """This rank's model chunks (one: no virtual pipeline) for `get_forward_backward_func`.

    A GPTModel with the local layer spec holding this rank's pipeline stage (embedding on the first stage, final
    norm and output layer on the last) and tensor-parallel slice, vocabulary padded (`padded_vocab_size`);
    wrapped in Float16Module when `bf16`, then in Megatron's DistributedDataParallel (fp32 gradient buffers) when
    `wrap_ddp`, with `finalize_model_grads` installed as the config's `finalize_model_grads_func` so that the
    forward/backward schedules reduce gradients over data parallelism and tied embeddings; gradients land in each
    parameter's `main_grad`. `initialize_parallel` must have run. Weights are randomly initialized: load them with
    `convert.load_hf_weights` before building the optimizer.
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    model_config = transformer_config(
        hf_config,
        layout,
        bf16=bf16,
        recompute_granularity=recompute_granularity,
        recompute_method=recompute_method,
        recompute_num_layers=recompute_num_layers,
    )
    layer_spec = get_gpt_layer_local_spec(qk_layernorm=model_config.qk_layernorm, normalization="RMSNorm")
    model = GPTModel(
        config=model_config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(hf_config.vocab_size, layout.tp),
        max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        **rope_settings(hf_config),
    )
    model.model_type = ModelType.encoder_or_decoder
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    chunk: torch.nn.Module = model
    if bf16:
        chunk = Float16Module(model_config, chunk)
    if wrap_ddp:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=use_distributed_optimizer,
        )
        chunk = DistributedDataParallel(config=model_config, ddp_config=ddp_config, module=chunk)
        # The schedules call it after the last backward: the data-parallel gradient all-reduce, and the sum of the
        # tied embedding's gradients over the first and last pipeline stages.
        model_config.finalize_model_grads_func = finalize_model_grads
    return [chunk]


def build_optimizer(
    model_chunks: list[torch.nn.Module],
    *,
    lr: float,
    adam_beta1: float,
    adam_beta2: float,
    adam_eps: float,
    weight_decay: float,
    clip_grad: float,
    bf16: bool,
    use_distributed_optimizer: bool,
):
    """Megatron's Adam (decoupled weight decay, i.e. AdamW) over the DDP-wrapped `model_chunks`.

    bf16 keeps fp32 main weights in the optimizer (sharded over data-parallel ranks with
    `use_distributed_optimizer`, which the chunks must have been built with too). Biases and other 1-D parameters
    (norms) get no weight decay, as in Megatron's training loop. `clip_grad` is the global gradient-norm limit
    (0 disables clipping).

    Set the learning rate with `set_lr(optimizer, lr)` (or write `group["lr"]` for every group of
    `optimizer.param_groups`; all groups have lr_mult 1). `optimizer.step()` returns
    `(update_successful, grad_norm, num_zeros_in_grad)`: `update_successful` is always True here (Megatron skips a
    step only under fp16 loss scaling, which this backend does not use); `grad_norm` is the global gradient norm
    before clipping (a float; inf/NaN means non-finite gradients, and the update has been applied anyway, so check
    it); `num_zeros_in_grad` is None (not counted). Call `optimizer.zero_grad()` and each chunk's
    `zero_grad_buffer()` before the next accumulation.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=0.0,
        weight_decay=weight_decay,
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        adam_eps=adam_eps,
        clip_grad=clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, model_chunks)
    for group in optimizer.param_groups:
        # Without Megatron's lr scheduler nothing applies the per-group multipliers: do it once here.
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
    set_lr(optimizer, lr)
    return optimizer


def set_lr(optimizer: Any, lr: float) -> None:
    """Set the learning rate of every parameter group of a Megatron optimizer (times the group's lr_mult)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)


# ---------------------------------------------------------------------------------------------------------------
# Attention inputs.


def causal_inputs(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(position_ids [B, S], attention_mask [B, 1, S, S])` for a batch of unpacked rows: positions 0..S-1 and a
    boolean causal mask, True where attention is masked out (the local attention needs an explicit mask)."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    batch, seq = tokens.shape
    position_ids = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, seq)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).triu(diagonal=1)
    return position_ids, mask.view(1, 1, seq, seq).expand(batch, 1, seq, seq)


def pack_sequences(
    rows: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Pack 1-D token rows into one row: `(tokens [1, T], position_ids [1, T], attention_mask [1, 1, T, T],
    offsets)`, where row i is `tokens[0, offsets[i]:offsets[i + 1]]` (len(offsets) == len(rows) + 1).

    The mask is block-diagonal causal (True = masked): a token sees only earlier tokens of its own row, so each
    row's log-probs equal those of the row alone. Positions restart at 0 per row; Megatron's RoPE itself uses the
    packed row's positions, which gives the same attention because rotary scores depend only on the distance
    between two tokens of the same row.
    """
    if not rows:
        raise ValueError("pack_sequences needs at least one row")
    for index, row in enumerate(rows):
        if row.dim() != 1 or row.numel() == 0:
            raise ValueError(f"row {index} must be a non-empty 1-D token tensor, got shape {tuple(row.shape)}")
    device = rows[0].device
    lengths = torch.tensor([row.numel() for row in rows], device=device)
    offsets = [0, *torch.cumsum(lengths, 0).tolist()]
    tokens = torch.cat(list(rows)).unsqueeze(0)
    total = offsets[-1]
    segment = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)
    starts = torch.tensor(offsets[:-1], device=device)
    position_ids = (torch.arange(total, device=device) - starts[segment]).unsqueeze(0)
    same_row = segment.unsqueeze(0) == segment.unsqueeze(1)
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    attention_mask = ~(same_row & causal)
    return tokens, position_ids, attention_mask.view(1, 1, total, total), offsets
