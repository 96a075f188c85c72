"""Log-probs and entropy over a vocabulary split across tensor-parallel ranks (with padding rows that must not
count): equal at TP=2, TP=1, PP=2 and in transformers, and their gradients too."""

from __future__ import annotations

import pytest
import torch
from megatron_jobs import hf_loss_grads, hf_reference

pytestmark = pytest.mark.megatron

KINDS = ("qwen2", "qwen3_tiny")


@pytest.mark.parametrize("kind", KINDS)
def test_entropy_and_log_probs_equal_across_tp_and_transformers(model_runs, tiny_models, sample_tokens, kind):
    reference = hf_reference(tiny_models[kind].model, sample_tokens)
    tp1, tp2 = model_runs.get(kind, "tp1"), model_runs.get(kind, "tp2")
    for name in ("entropy", "logprobs"):
        assert tp2[name].dtype == torch.float32
        torch.testing.assert_close(tp2[name], tp1[name], rtol=0, atol=1e-6)
        torch.testing.assert_close(tp2[name], reference[name], rtol=0, atol=1e-5)
    # The padding (61 real entries of 128) is left out: a uniform distribution over it would add log(128/61).
    assert (tp2["entropy"] < torch.log(torch.tensor(61.0)) + 1e-4).all()


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_through_entropy_match_tp1_and_transformers(model_runs, tiny_models, sample_tokens, kind, layout):
    tp1, other = model_runs.get(kind, "tp1")["grads"], model_runs.get(kind, layout)["grads"]
    reference = hf_loss_grads(tiny_models[kind].model, sample_tokens)
    assert sorted(other) == sorted(tp1) == sorted(name for name in reference if name != "lm_head.weight" or name in tp1)
    for name, grad in tp1.items():
        assert grad.abs().max() > 0, f"no gradient reached {name}"
        torch.testing.assert_close(other[name], grad, rtol=0, atol=1e-6, msg=f"{layout} vs tp1: {name}")
        torch.testing.assert_close(grad, reference[name], rtol=0, atol=1e-6, msg=f"tp1 vs transformers: {name}")
