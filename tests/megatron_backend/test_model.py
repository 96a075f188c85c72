"""Megatron's GPTModel built from Hugging Face configs: log-probs equal transformers' at TP=1, TP=2 and PP=2 for
Qwen2, Qwen3 and Llama; packed rows equal separate rows; the layout checks; optimizer steps (fp32, bf16, the
distributed optimizer, activation recompute) agree across layouts; the CPU fixes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from megatron_jobs import cpu_compat_job, hf_reference, packed_job, train_job

from slime.plugins.megatron_backend import cpu_compat
from slime.plugins.megatron_backend.model import (
    ParallelLayout,
    causal_inputs,
    check_layout,
    pack_sequences,
    padded_vocab_size,
    rope_settings,
)

pytestmark = pytest.mark.megatron

FAMILY_MODELS = ("qwen2", "qwen3", "llama", "qwen3_tiny", "qwen2_tied")


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
@pytest.mark.parametrize("kind", FAMILY_MODELS)
def test_log_probs_equal_transformers(model_runs, tiny_models, sample_tokens, kind, layout):
    run = model_runs.get(kind, layout)
    reference = hf_reference(tiny_models[kind].model, sample_tokens)
    assert run["logprobs"].dtype == torch.float32
    assert run["logprobs"].shape == reference["logprobs"].shape
    torch.testing.assert_close(run["logprobs"], reference["logprobs"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_packed_rows_give_the_log_probs_of_separate_rows(workers, tiny_models, layout):
    model = tiny_models["qwen3"]
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 61, (length,), generator=generator) for length in (7, 12, 3)]
    (result,) = [
        r for r in workers.run(packed_job, str(model.directory), {"tp": 2} if layout == "tp2" else {"pp": 2}, rows) if r
    ]
    offsets = result["offsets"]
    assert offsets == [0, 7, 19, 22]
    for index, row in enumerate(rows):
        separate = hf_reference(model.model, row.unsqueeze(0))["logprobs"][0]
        # Inside the packed row, row i's next-token log-probs sit at offsets[i] .. offsets[i+1]-2.
        packed = result["logprobs"][0, offsets[index] : offsets[index + 1] - 1]
        torch.testing.assert_close(packed, separate, rtol=0, atol=1e-5)


def test_pack_sequences_mask_and_positions():
    tokens, position_ids, mask, offsets = pack_sequences([torch.tensor([5, 6, 7]), torch.tensor([8, 9])])
    assert tokens.tolist() == [[5, 6, 7, 8, 9]]
    assert position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert offsets == [0, 3, 5]
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.bool
    allowed = (~mask[0, 0]).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    with pytest.raises(ValueError, match="row 1 must be a non-empty 1-D"):
        pack_sequences([torch.tensor([1]), torch.tensor([], dtype=torch.long)])


def test_causal_inputs_shapes():
    position_ids, mask = causal_inputs(torch.zeros(3, 4, dtype=torch.long))
    assert position_ids.shape == (3, 4) and position_ids[2].tolist() == [0, 1, 2, 3]
    assert mask.shape == (3, 1, 4, 4) and mask.dtype == torch.bool
    assert mask[1, 0].tolist()[0] == [False, True, True, True]


def _train(workers, model, layout, steps=3, **options):
    per_rank = workers.run(
        train_job,
        str(model.directory),
        layout,
        torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(5)),
        options,
        steps,
    )
    merged = {"steps": per_rank[-1]["steps"], "losses": [loss for r in per_rank for loss in r["losses"]][:steps]}
    merged.update(lrs=per_rank[0]["lrs"], weight_decays=per_rank[0]["weight_decays"], state=per_rank[0]["state"])
    return merged


def test_optimizer_steps_agree_across_layouts(workers, tiny_models):
    model = tiny_models["qwen2"]
    runs = {
        name: _train(workers, model, layout) for name, layout in (("dp2", {}), ("tp2", {"tp": 2}), ("pp2", {"pp": 2}))
    }
    for name, run in runs.items():
        for success, grad_norm, zeros in run["steps"]:
            assert success is True and zeros is None, name
            assert math.isfinite(grad_norm) and grad_norm > 0, name
        assert run["lrs"] == [pytest.approx(1e-3)], name
        assert run["weight_decays"] == [0.0, 0.01], name  # no weight decay on norms and biases
        assert run["losses"][-1] < run["losses"][0], name
    for name in ("tp2", "pp2"):
        for (_, norm, _), (_, reference, _) in zip(runs[name]["steps"], runs["dp2"]["steps"], strict=True):
            assert norm == pytest.approx(reference, rel=1e-5), name
        for key, tensor in runs["dp2"]["state"].items():
            torch.testing.assert_close(runs[name]["state"][key], tensor, rtol=0, atol=1e-5, msg=f"{name} {key}")
    trained = runs["dp2"]["state"]["model.layers.0.mlp.down_proj.weight"]
    assert not torch.equal(trained, model.state()["model.layers.0.mlp.down_proj.weight"])


@pytest.mark.parametrize(
    "options",
    [
        {"bf16": True},
        {
            "use_distributed_optimizer": True,
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        },
        {"bf16": True, "use_distributed_optimizer": True, "recompute_granularity": "selective"},
    ],
    ids=["bf16", "distopt-full-recompute", "bf16-distopt-selective"],
)
def test_optimizer_steps_with_memory_options(workers, tiny_models, options):
    model = tiny_models["qwen3_tiny"]
    run = _train(workers, model, {}, **options)
    assert all(success for success, _, _ in run["steps"])
    assert run["losses"][-1] < run["losses"][0]
    dtype = torch.float32  # config.json says float32: exported in it whatever the training precision
    assert {tensor.dtype for tensor in run["state"].values()} == {dtype}


def test_cpu_compat_on_a_rank(workers, tiny_models):
    if not cpu_compat.cpu_mode():
        pytest.skip("the CPU fixes are not installed where CUDA is available")
    result = workers.run(cpu_compat_job, str(tiny_models["qwen3"].directory))[0]
    assert result["default_mask_equal"]
    assert result["rng_replayed"] and result["tracker_differs"]
    assert result["rng_state_types"] == ["NoneType", "Tensor", "dict"]
    assert result["scope_device"] == "cpu" and result["scope_type"] == "torch.cuda.FloatTensor"
    assert result["current_device"] == "cpu"


def test_layout_dp_and_padding():
    assert ParallelLayout(tp=2, pp=2).dp(8) == 2
    with pytest.raises(ValueError, match=r"6 ranks .* tensor 2 x pipeline 2 x context 1 = 4"):
        ParallelLayout(tp=2, pp=2).dp(6)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        ParallelLayout(tp=0)
    assert padded_vocab_size(61, 1) == padded_vocab_size(61, 2) == 128
    assert padded_vocab_size(151936, 8) == 151936
    assert padded_vocab_size(1000, 3) % 3 == 0


def test_check_layout_names_the_numbers():
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    with pytest.raises(
        ValueError, match=r"tensor parallel size 4 .*num_attention_heads \(4\).*num_key_value_heads \(2\)"
    ):
        check_layout(config, ParallelLayout(tp=4))
    with pytest.raises(ValueError, match=r"tensor parallel size 3 .*num_attention_heads \(4\)"):
        check_layout(config, ParallelLayout(tp=3))
    with pytest.raises(ValueError, match=r"pipeline parallel size 3 must divide the model's num_hidden_layers \(2\)"):
        check_layout(config, ParallelLayout(pp=3))
    with pytest.raises(ValueError, match="expert parallel size 2.*dense"):
        check_layout(config, ParallelLayout(ep=2))
    check_layout(config, ParallelLayout(tp=2, pp=2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="context parallelism is refused only without a GPU")
def test_check_layout_refuses_context_parallel_on_cpu():
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    with pytest.raises(ValueError, match="context parallel size 2 needs a GPU.*TransformerEngine"):
        check_layout(config, ParallelLayout(cp=2))


def test_rope_settings():
    assert rope_settings(SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6})) == {
        "rotary_base": 1e6,
        "rope_scaling": False,
    }
    yarn = SimpleNamespace(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})
    with pytest.raises(ValueError, match="RoPE scaling .*yarn.* not supported"):
        rope_settings(yarn)


def test_check_megatron_core_refuses_another_version(monkeypatch):
    monkeypatch.setattr(cpu_compat, "_installed_megatron_core_version", lambda: "0.15.0")
    with pytest.raises(
        RuntimeError, match=r"megatron-core==0\.16\.1, found 0\.15\.0.*pip install 'slime-rl\[megatron\]'"
    ):
        cpu_compat.check_megatron_core()
    monkeypatch.setattr(cpu_compat, "_installed_megatron_core_version", lambda: None)
    with pytest.raises(RuntimeError, match="found not installed"):
        cpu_compat.check_megatron_core()
