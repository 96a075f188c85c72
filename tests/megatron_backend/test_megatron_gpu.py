"""The Megatron backend on a GPU (markers `gpu` and `megatron`; `.ci/device-check` runs them on a GPU machine).

On CPU the backend is tested over gloo at every layout (test_actor_parallel.py); what only a GPU shows is
checked here: a rank on CUDA over NCCL, in bf16 (Float16Module with fp32 main parameters), trains the same
synthetic GRPO steps as float32 within bf16's precision and exports weights Hugging Face loads; and the
rollout tensors a GPU run produces (CUDA tensors) go through the straw codec and come back equal.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_actor_runs import run_ranks, synthetic_steps
from slime.plugins.tiny_model import ensure_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.megatron]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_a_bf16_rank_on_cuda_over_nccl_trains_like_float32(tmp_path: Path) -> None:
    model = ensure_tiny_model(tmp_path / "model")
    steps = synthetic_steps(3, json.loads((model / "config.json").read_text())["vocab_size"])
    options = {"train_backend": "megatron", "hf_checkpoint": str(model), "lr": 1e-3, "entropy_coef": 0.05}
    fp32 = run_ranks(1, options, steps, tmp_path / "fp32")["metrics"]
    bf16 = run_ranks(1, {**options, "bf16": True}, steps, tmp_path / "bf16", export=str(tmp_path / "export"))
    for want, got in zip(fp32, bf16["metrics"], strict=True):
        assert got["train/loss"] == pytest.approx(want["train/loss"], abs=2e-2)
        assert torch.isfinite(torch.tensor(got["train/grad_norm"]))
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert exported.config.vocab_size == json.loads((model / "config.json").read_text())["vocab_size"]


@needs_cuda
def test_cuda_rollout_tensors_round_trip_through_the_straw_codec(tmp_path: Path) -> None:
    from slime.data.transport import pack_rollout_payload

    args = SimpleNamespace(rollout_data_transport="straw", rollout_data_dir=str(tmp_path / "pool"))
    value = {
        "log_probs": torch.randn(4, 37, device="cuda"),
        "tokens": torch.randint(0, 1000, (4, 37), device="cuda"),
        "hidden": torch.randn(2, 8, dtype=torch.bfloat16, device="cuda"),
    }
    restored = pack_rollout_payload(value, args, 0).load()
    for name, tensor in value.items():
        assert torch.equal(torch.as_tensor(restored[name]).cpu(), tensor.cpu()), name
        assert restored[name].dtype == tensor.dtype
