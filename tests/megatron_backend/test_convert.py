"""Hugging Face <-> Megatron weights: exact round trips (in memory at any layout, and through real Megatron models
at TP=1, TP=2 and PP=2), exported directories that transformers and the CPU engine load, strict loading, and the
family checks."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from megatron_jobs import load_error_job
from megatron_workers import WorkerError

from slime.plugins.megatron_backend.convert import (
    SUPPORTED_FAMILIES,
    family_of,
    hf_to_megatron,
    megatron_to_hf,
    tp_split_dim,
    write_hf_checkpoint,
)
from slime.plugins.megatron_backend.model import ParallelLayout

pytestmark = pytest.mark.megatron


def _assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("kind", ["qwen2", "qwen2_tied", "qwen3", "qwen3_tiny", "llama"])
def test_in_memory_round_trip_is_exact(tiny_models, kind, tp, pp):
    model = tiny_models[kind]
    hf_state = model.state()
    layout = ParallelLayout(tp=tp, pp=pp)
    rebuilt: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        shards = [hf_to_megatron(hf_state, model.config, layout, tp_rank=r, pp_rank=pp_rank) for r in range(tp)]
        assert all(tensor.is_contiguous() for shard in shards for tensor in shard.values())
        full = {}
        for name in shards[0]:
            dim = tp_split_dim(name)
            full[name] = shards[0][name] if dim is None else torch.cat([shard[name] for shard in shards], dim=dim)
        rebuilt.update(megatron_to_hf(full, model.config, layout, pp_rank=pp_rank))
    _assert_same_state(rebuilt, hf_state)


def test_shards_are_interleaved_per_kv_group_and_padded():
    config = SimpleNamespace(
        model_type="qwen2",
        vocab_size=5,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=2,
        head_dim=1,
        tie_word_embeddings=True,
    )
    # head_dim 1: each row of q/k/v is one head, numbered so that the interleaving is visible.
    state = {
        "model.embed_tokens.weight": torch.arange(10.0).view(5, 2),
        "model.layers.0.input_layernorm.weight": torch.ones(2),
        "model.layers.0.self_attn.q_proj.weight": torch.tensor([[10.0], [11.0], [12.0], [13.0]]).expand(4, 2),
        "model.layers.0.self_attn.k_proj.weight": torch.tensor([[20.0], [21.0]]).expand(2, 2),
        "model.layers.0.self_attn.v_proj.weight": torch.tensor([[30.0], [31.0]]).expand(2, 2),
        "model.layers.0.self_attn.q_proj.bias": torch.tensor([10.0, 11.0, 12.0, 13.0]),
        "model.layers.0.self_attn.k_proj.bias": torch.tensor([20.0, 21.0]),
        "model.layers.0.self_attn.v_proj.bias": torch.tensor([30.0, 31.0]),
        "model.layers.0.self_attn.o_proj.weight": torch.zeros(2, 4),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(2),
        "model.layers.0.mlp.gate_proj.weight": torch.tensor([[1.0], [2.0]]).expand(2, 2),
        "model.layers.0.mlp.up_proj.weight": torch.tensor([[3.0], [4.0]]).expand(2, 2),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(2, 2),
        "model.norm.weight": torch.ones(2),
    }
    shards = [hf_to_megatron(state, config, ParallelLayout(tp=2), tp_rank=rank, pp_rank=0) for rank in range(2)]
    assert shards[0]["decoder.layers.0.self_attention.linear_qkv.bias"].tolist() == [10, 11, 20, 30]
    assert shards[1]["decoder.layers.0.self_attention.linear_qkv.bias"].tolist() == [12, 13, 21, 31]
    assert shards[0]["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [1, 3]  # gate shard, up shard
    assert shards[1]["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [2, 4]
    embedding = [shard["embedding.word_embeddings.weight"] for shard in shards]
    assert [tuple(t.shape) for t in embedding] == [(64, 2), (64, 2)]  # 5 rows padded to 128
    assert torch.equal(embedding[0][:5], state["model.embed_tokens.weight"])
    assert not embedding[0][5:].any() and not embedding[1].any()
    assert "output_layer.weight" not in shards[0]  # tied, one stage


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen3_tiny", "llama"])
def test_megatron_round_trip_is_exact(model_runs, tiny_models, kind, layout):
    _assert_same_state(model_runs.get(kind, layout)["state"], tiny_models[kind].state())


def test_exported_checkpoint_loads_in_transformers_and_the_cpu_engine(model_runs, tiny_models, sample_tokens, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime.plugins.cpu_engine_core import CPUEngine

    source = tiny_models["qwen3_tiny"]
    state = model_runs.get("qwen3_tiny", "tp2")["state"]
    target = tmp_path / "exported"
    target.mkdir()
    write_hf_checkpoint(state, source.directory, target)
    names = sorted(path.name for path in target.iterdir())
    assert "model.safetensors" in names and "config.json" in names and "tokenizer.json" in names
    assert "slime_tiny_model.json" not in names  # the built-in model's marker is not a property of an export
    reloaded = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(sample_tokens).logits, source.model(sample_tokens).logits, rtol=0, atol=0)
    assert (
        AutoTokenizer.from_pretrained(target)("1+1").input_ids
        == AutoTokenizer.from_pretrained(source.directory)("1+1").input_ids
    )
    engine = CPUEngine(str(target))
    assert engine.vocab_size == 61
    served = CPUEngine(str(source.directory))
    assert "Succeeded" in served.update_weights_from_disk(str(target), weight_version="7")


def test_untied_export_has_lm_head(model_runs, tiny_models, tmp_path):
    state = model_runs.get("qwen2", "pp2")["state"]
    assert state["lm_head.weight"].shape == (61, 64)
    write_hf_checkpoint(state, tiny_models["qwen2"].directory, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2"


def test_write_needs_an_existing_target(tmp_path, tiny_models):
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        write_hf_checkpoint({}, tiny_models["qwen2"].directory, tmp_path / "missing")


def _copy_with_state(source, target, state) -> None:
    from safetensors.torch import save_file

    shutil.copytree(source, target)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})


def test_load_refuses_missing_and_unexpected_tensors(workers, tiny_models, tmp_path):
    model = tiny_models["qwen2"]
    missing = {k: v for k, v in model.state().items() if k != "model.layers.1.mlp.up_proj.weight"}
    _copy_with_state(model.directory, tmp_path / "missing", missing)
    with pytest.raises(WorkerError, match=r"model\.safetensors.*missing \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        workers.run(load_error_job, str(tmp_path / "missing"), {})
    extra = {**model.state(), "model.layers.9.extra.weight": torch.zeros(2)}
    _copy_with_state(model.directory, tmp_path / "extra", extra)
    with pytest.raises(WorkerError, match=r"unexpected \['model\.layers\.9\.extra\.weight'\]"):
        workers.run(load_error_job, str(tmp_path / "extra"), {"tp": 2})


def test_family_of_names_the_checkpoint_and_the_supported_families():
    assert set(SUPPORTED_FAMILIES) == {"qwen2", "qwen3", "llama"}
    config = SimpleNamespace(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        ValueError, match=r"model_type 'gpt2' \(architectures \['GPT2LMHeadModel'\]\).*qwen2, qwen3, llama"
    ):
        family_of(config)
    assert family_of(SimpleNamespace(model_type="qwen3")) == "qwen3"
    with pytest.raises(ValueError, match="llama checkpoints with attention_bias=True"):
        family_of(SimpleNamespace(model_type="llama", attention_bias=True))
