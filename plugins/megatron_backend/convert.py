"""Hugging Face <-> Megatron weights for the Qwen2, Qwen3 and Llama families, tensor- and pipeline-parallel aware.

megatron-bridge would do this but does not install without TransformerEngine; for these three dense families the
mapping is short and exact (the round trip is bit-identical):

- `model.embed_tokens` -> `embedding.word_embeddings` (rows padded to the padded vocabulary);
- q/k/v projections -> `self_attention.linear_qkv`, interleaved per key/value group: the query rows of the group,
  then its key rows, then its value rows (Qwen2's q/k/v biases the same way);
- `o_proj` -> `self_attention.linear_proj`; Qwen3's `q_norm`/`k_norm` -> `q_layernorm`/`k_layernorm`;
- gate and up projections -> `mlp.linear_fc1`, each tensor-parallel shard being [gate shard; up shard];
- `down_proj` -> `mlp.linear_fc2`; `input_layernorm` -> `input_layernorm` (the local layer spec's name);
  `post_attention_layernorm` -> `pre_mlp_layernorm`; `model.norm` -> `decoder.final_layernorm`;
- `lm_head` -> `output_layer` (with tied embeddings only a last pipeline stage without the embedding has one, a
  copy of the embedding; Hugging Face files then have no `lm_head.weight`).

Tensor-parallel split dimensions come from the Megatron parameter names (`tp_split_dim`): column-parallel
layers (linear_qkv, linear_fc1, output_layer, word_embeddings) split dim 0, row-parallel ones (linear_proj,
linear_fc2) dim 1, norms are replicated. Layer indices in Megatron names are local to the pipeline stage.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from slime.plugins.megatron_backend.model import ParallelLayout, head_dim, padded_vocab_size, unwrap_model
from slime.utils.atomic_files import fsync_path


@dataclass(frozen=True)
class FamilySpec:
    """What distinguishes one supported Hugging Face family in the Megatron layer."""

    description: str
    qkv_bias: bool
    qk_norm: bool


SUPPORTED_FAMILIES: Mapping[str, FamilySpec] = MappingProxyType(
    {
        "qwen2": FamilySpec("Qwen2 / Qwen2.5: biases on q/k/v, none elsewhere", qkv_bias=True, qk_norm=False),
        "qwen3": FamilySpec("Qwen3 (dense): RMSNorm on each query and key head, no biases", False, qk_norm=True),
        "llama": FamilySpec("Llama 2 / 3: no biases, optional llama3 RoPE scaling", qkv_bias=False, qk_norm=False),
    }
)

#: Non-weight files of a Hugging Face directory that an exported checkpoint carries over from its source.
_COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def family_of(hf_config: Any) -> str:
    """The supported family of a Hugging Face config (its `model_type`); ValueError naming the checkpoint's
    model_type and architectures and the supported families, or the variant of the family that is not supported."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_FAMILIES:
        architectures = getattr(hf_config, "architectures", None)
        raise ValueError(
            f"the Megatron backend does not support model_type {model_type!r} (architectures {architectures}); "
            f"supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    unsupported = []
    if model_type != "qwen2" and getattr(hf_config, "attention_bias", False):
        unsupported.append("attention_bias=True (a bias on o_proj too)")
    if getattr(hf_config, "mlp_bias", False):
        unsupported.append("mlp_bias=True")
    if getattr(hf_config, "use_sliding_window", False):
        unsupported.append("use_sliding_window=True")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={hf_config.hidden_act!r} (only silu)")
    if unsupported:
        raise ValueError(
            f"{model_type} checkpoints with {', '.join(unsupported)} are not supported by the Megatron backend"
        )
    return model_type


def family_spec(hf_config: Any) -> FamilySpec:
    """The `FamilySpec` of a Hugging Face config (ValueError as `family_of`)."""
    return SUPPORTED_FAMILIES[family_of(hf_config)]


def tp_split_dim(megatron_name: str) -> int | None:
    """The dimension along which tensor parallelism splits a Megatron parameter, None when it is replicated."""
    if any(part in megatron_name for part in ("linear_qkv.", "linear_fc1.", "output_layer.", "word_embeddings.")):
        return 0
    if megatron_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


# ---------------------------------------------------------------------------------------------------------------
# The name table.


def _layer_table(spec: FamilySpec) -> list[tuple[str, tuple[str, ...]]]:
    """(Megatron name under `decoder.layers.N.`, Hugging Face names under `model.layers.N.`) of one layer."""
    table = [
        ("input_layernorm.weight", ("input_layernorm.weight",)),
        (
            "self_attention.linear_qkv.weight",
            ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        ),
        ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",)),
        ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
        ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
        ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",)),
    ]
    if spec.qkv_bias:
        table.append(
            (
                "self_attention.linear_qkv.bias",
                ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
            )
        )
    if spec.qk_norm:
        table.append(("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",)))
        table.append(("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",)))
    return table


def _tied(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def _stage_table(hf_config: Any, layout: ParallelLayout, pp_rank: int) -> list[tuple[str, tuple[str, ...]]]:
    """(Megatron name, Hugging Face names) of every parameter of pipeline stage `pp_rank`."""
    spec = family_spec(hf_config)
    layers = int(hf_config.num_hidden_layers)
    if layers % layout.pp:
        raise ValueError(f"pipeline parallel size {layout.pp} must divide num_hidden_layers ({layers})")
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank {pp_rank} is outside the pipeline of {layout.pp} stages")
    per_stage = layers // layout.pp
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    table: list[tuple[str, tuple[str, ...]]] = []
    if first:
        table.append(("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)))
    for local in range(per_stage):
        index = pp_rank * per_stage + local
        for megatron_name, hf_names in _layer_table(spec):
            table.append(
                (f"decoder.layers.{local}.{megatron_name}", tuple(f"model.layers.{index}.{n}" for n in hf_names))
            )
    if last:
        table.append(("decoder.final_layernorm.weight", ("model.norm.weight",)))
        if not _tied(hf_config):
            table.append(("output_layer.weight", ("lm_head.weight",)))
        elif not first:  # the last stage's copy of the tied embedding
            table.append(("output_layer.weight", ("model.embed_tokens.weight",)))
    return table


def hf_parameter_names(hf_config: Any) -> list[str]:
    """Every tensor name a Hugging Face checkpoint of this config holds (no lm_head with tied embeddings)."""
    return [name for _, hf_names in _stage_table(hf_config, ParallelLayout(), 0) for name in hf_names]


# ---------------------------------------------------------------------------------------------------------------
# Merging Hugging Face tensors into one Megatron tensor (at the full, unsplit TP width) and back.


def _merge(megatron_name: str, tensors: list[torch.Tensor], hf_config: Any, layout: ParallelLayout) -> torch.Tensor:
    if "linear_qkv." in megatron_name:
        q, k, v = tensors
        groups = _kv_heads(hf_config)
        width = head_dim(hf_config)
        trailing = q.shape[1:]
        parts = [t.reshape(groups, -1, *trailing) for t in (q, k, v)]
        merged = torch.cat(parts, dim=1)
        if parts[1].shape[1] != width or parts[2].shape[1] != width:
            raise ValueError(f"{megatron_name}: k/v projections do not have {groups} heads of width {width}")
        return merged.reshape(-1, *trailing)
    if "linear_fc1." in megatron_name:
        gate, up = (t.chunk(layout.tp, dim=0) for t in tensors)
        return torch.cat([torch.cat(pair, dim=0) for pair in zip(gate, up, strict=True)], dim=0)
    if "word_embeddings." in megatron_name or "output_layer." in megatron_name:
        (table,) = tensors
        padded = padded_vocab_size(table.shape[0], layout.tp)
        if padded == table.shape[0]:
            return table
        return torch.cat([table, table.new_zeros(padded - table.shape[0], *table.shape[1:])], dim=0)
    (single,) = tensors
    return single


def _split(megatron_name: str, full: torch.Tensor, hf_config: Any, layout: ParallelLayout) -> list[torch.Tensor]:
    if "linear_qkv." in megatron_name:
        groups = _kv_heads(hf_config)
        width = head_dim(hf_config)
        heads = int(hf_config.num_attention_heads)
        trailing = full.shape[1:]
        grouped = full.reshape(groups, -1, *trailing)
        q, k, v = grouped.split([heads // groups * width, width, width], dim=1)
        return [t.reshape(-1, *trailing) for t in (q, k, v)]
    if "linear_fc1." in megatron_name:
        shards = [shard.chunk(2, dim=0) for shard in full.chunk(layout.tp, dim=0)]
        return [torch.cat([gate for gate, _ in shards], dim=0), torch.cat([up for _, up in shards], dim=0)]
    if "word_embeddings." in megatron_name or "output_layer." in megatron_name:
        return [full[: int(hf_config.vocab_size)]]
    return [full]


def _kv_heads(hf_config: Any) -> int:
    return int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor],
    hf_config: Any,
    layout: ParallelLayout,
    *,
    tp_rank: int,
    pp_rank: int,
) -> dict[str, torch.Tensor]:
    """This rank's shard of a Hugging Face state dict, keyed by the unwrapped GPTModel's state-dict names (layer
    indices local to stage `pp_rank`, vocabulary padded with zero rows), every tensor contiguous.

    `hf_state` may be lazy (any Mapping): only the tensors of this stage are read. KeyError names a missing one.
    """
    if not 0 <= tp_rank < layout.tp:
        raise ValueError(f"tp_rank {tp_rank} is outside the tensor-parallel group of {layout.tp}")
    shard: dict[str, torch.Tensor] = {}
    for megatron_name, hf_names in _stage_table(hf_config, layout, pp_rank):
        try:
            tensors = [hf_state[name] for name in hf_names]
        except KeyError as exc:
            raise KeyError(f"the Hugging Face weights lack {exc.args[0]!r} (needed for {megatron_name})") from exc
        full = _merge(megatron_name, tensors, hf_config, layout)
        dim = tp_split_dim(megatron_name)
        if dim is not None and layout.tp > 1:
            if full.shape[dim] % layout.tp:
                raise ValueError(
                    f"{megatron_name}: dimension {dim} of size {full.shape[dim]} does not split into {layout.tp} "
                    "tensor-parallel shards"
                )
            full = full.chunk(layout.tp, dim=dim)[tp_rank]
        shard[megatron_name] = full.contiguous()
    return shard


def megatron_to_hf(
    stage_state: Mapping[str, torch.Tensor], hf_config: Any, layout: ParallelLayout, *, pp_rank: int
) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of pipeline stage `pp_rank` from its Megatron tensors gathered over tensor
    parallelism (full width, local layer indices). Vocabulary padding is stripped; a tied last stage's copy of
    the embedding is dropped."""
    hf_state: dict[str, torch.Tensor] = {}
    for megatron_name, hf_names in _stage_table(hf_config, layout, pp_rank):
        if megatron_name == "output_layer.weight" and _tied(hf_config):
            continue
        for name, tensor in zip(
            hf_names, _split(megatron_name, stage_state[megatron_name], hf_config, layout), strict=True
        ):
            hf_state[name] = tensor.contiguous()
    return hf_state


# ---------------------------------------------------------------------------------------------------------------
# Reading a Hugging Face directory.


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """The tensors of a Hugging Face directory's safetensors weights (one `model.safetensors`, or an index and its
    shards), read lazily one tensor at a time."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.directory = Path(hf_dir)
        index = self.directory / "model.safetensors.index.json"
        single = self.directory / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise ValueError(f"{index}: not a safetensors index with a weight_map ({exc})") from exc
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as handle:
                self.files = {name: single for name in handle.keys()}  # noqa: SIM118 - safe_open is no Mapping
        else:
            raise FileNotFoundError(
                f"{self.directory} has no model.safetensors or model.safetensors.index.json; save the model with "
                "save_pretrained(safe_serialization=True)"
            )
        self._handles: dict[Path, Any] = {}

    def describe(self) -> str:
        files = sorted({path.name for path in self.files.values()})
        return f"{self.directory} ({', '.join(files)})"

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self.files[name]
        if path not in self._handles:
            from safetensors import safe_open

            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def load_hf_weights(model_chunks: list[torch.nn.Module], hf_dir: str | Path, layout: ParallelLayout) -> None:
    """Load this rank's shard of the Hugging Face checkpoint in `hf_dir` into its (possibly DDP- and
    Float16Module-wrapped) model chunk, strictly: tensors the model does not use, missing tensors and shape
    mismatches raise ValueError naming them and the files.

    Call it before `model.build_optimizer`: the optimizer's fp32 main weights (bf16) and distributed-optimizer
    shards are copied from the model's parameters when the optimizer is built. In bf16 the parameters are the
    checkpoint's values rounded to bf16.
    """
    from megatron.core import parallel_state
    from transformers import AutoConfig

    if len(model_chunks) != 1:
        raise ValueError(f"expected one model chunk (no virtual pipeline), got {len(model_chunks)}")
    hf_config = AutoConfig.from_pretrained(str(hf_dir))
    checkpoint = SafetensorsCheckpoint(hf_dir)
    expected = set(hf_parameter_names(hf_config))
    tolerated = {"lm_head.weight"} if _tied(hf_config) else set()  # some tied checkpoints store a copy
    present = set(checkpoint)
    missing = sorted(expected - present)
    unexpected = sorted(name for name in present - expected - tolerated if not name.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise ValueError(
            f"the weights in {checkpoint.describe()} do not match its config.json ({hf_config.model_type}, "
            f"{hf_config.num_hidden_layers} layers): missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    shard = hf_to_megatron(
        checkpoint,
        hf_config,
        layout,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
    )
    model = unwrap_model(model_chunks[0])
    current = {name: t for name, t in model.state_dict(keep_vars=True).items() if not name.endswith("_extra_state")}
    if set(current) != set(shard):
        raise ValueError(
            f"the model built for {checkpoint.describe()} has parameters {sorted(set(current) - set(shard))[:8]} "
            f"that the converter does not produce, and the converter produces {sorted(set(shard) - set(current))[:8]} "
            "that the model lacks (a model built with another layout or config?)"
        )
    for name, tensor in shard.items():
        if tuple(tensor.shape) != tuple(current[name].shape):
            raise ValueError(
                f"{name}: the shard converted from {checkpoint.describe()} has shape {tuple(tensor.shape)}, the "
                f"model's parameter {tuple(current[name].shape)} (a model built with another layout or config?)"
            )
    with torch.no_grad():
        for name, tensor in shard.items():
            current[name].data.copy_(tensor)


# ---------------------------------------------------------------------------------------------------------------
# Gathering and writing a Hugging Face checkpoint.


def export_dtype(hf_config: Any, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype an exported checkpoint uses: the config's `dtype`/`torch_dtype` when it names one, else the
    model's parameter dtype."""
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(declared, str) and declared not in ("auto", ""):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) else model_dtype


def gather_hf_state(
    model_chunks: list[torch.nn.Module], hf_config: Any, layout: ParallelLayout
) -> dict[str, torch.Tensor] | None:
    """The full Hugging Face state dict of the model, on global rank 0 (None on every other rank).

    Collective: every rank of the job must call it. Ranks of the first data-parallel replica all-gather their
    tensor-parallel slices within their TP group, the first TP rank of each pipeline stage converts its stage to
    Hugging Face names (global layer indices) and sends it to rank 0. Vocabulary padding is stripped, tied
    embeddings give no `lm_head.weight` (as `save_pretrained` writes them). Tensors are the model's parameters
    (what the forward pass uses; in bf16 the bf16 weights, not the optimizer's fp32 main weights), on the CPU, in
    `export_dtype(hf_config, parameter dtype)`: the dtype the Hugging Face config declares (`dtype`/`torch_dtype`),
    else the parameters' own.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if len(model_chunks) != 1:
        raise ValueError(f"expected one model chunk (no virtual pipeline), got {len(model_chunks)}")
    if parallel_state.get_data_parallel_rank(with_context_parallel=True) != 0:
        return None
    model = unwrap_model(model_chunks[0])
    first_param = next(model.parameters())
    dtype = export_dtype(hf_config, first_param.dtype)
    device = first_param.device
    local = {name: t for name, t in model.state_dict().items() if not name.endswith("_extra_state")}
    tp_group = parallel_state.get_tensor_model_parallel_group()
    full: dict[str, torch.Tensor] = {}
    for name in sorted(local):  # the same order on every rank of the TP group
        tensor = local[name].detach().to(dtype).contiguous()
        dim = tp_split_dim(name)
        if dim is not None and layout.tp > 1:
            parts = [torch.empty_like(tensor) for _ in range(layout.tp)]
            dist.all_gather(parts, tensor, group=tp_group)
            tensor = torch.cat(parts, dim=dim)
        full[name] = tensor
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return None
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    stage = megatron_to_hf(full, hf_config, layout, pp_rank=pp_rank)
    if layout.pp > 1:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        pp_ranks = dist.get_process_group_ranks(pp_group)
        if pp_rank != 0:
            names = sorted(stage)
            meta = [(name, tuple(stage[name].shape)) for name in names]
            dist.send_object_list([meta], dst=pp_ranks[0], group=pp_group)
            for name in names:
                dist.send(stage[name], dst=pp_ranks[0], group=pp_group)
            return None
        for source in pp_ranks[1:]:
            received: list[Any] = [None]
            dist.recv_object_list(received, src=source, group=pp_group)
            for name, shape in received[0]:
                buffer = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buffer, src=source, group=pp_group)
                stage[name] = buffer
    if dist.get_rank() != 0:
        return None
    order = {name: index for index, name in enumerate(hf_parameter_names(hf_config))}
    # Copies: on CPU the tensors of a one-rank stage would otherwise share memory with the live parameters.
    return {name: stage[name].to("cpu", copy=True) for name in sorted(stage, key=lambda n: order.get(n, len(order)))}


def write_hf_checkpoint(state: dict[str, torch.Tensor], hf_source_dir: str | Path, target_dir: str | Path) -> None:
    """Write `state` (from `gather_hf_state`) as a Hugging Face directory: `model.safetensors` plus config.json,
    generation_config.json and the tokenizer files copied from `hf_source_dir` where present. `target_dir` must
    exist (the caller creates it and publishes it atomically); every file written is fsynced, then the directory.
    """
    from safetensors.torch import save_file

    source, target = Path(hf_source_dir), Path(target_dir)
    if not target.is_dir():
        raise FileNotFoundError(f"write_hf_checkpoint: target directory {target} does not exist; create it first")
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"write_hf_checkpoint: {source} has no config.json to copy")
    weights = target / "model.safetensors"
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(weights), metadata={"format": "pt"})
    fsync_path(weights)
    for name in _COPIED_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
            fsync_path(target / name)
    fsync_path(target)
