"""Fixtures of the Megatron backend tests: tiny Hugging Face models built in code, and a pool of two gloo ranks.

The whole directory is skipped when megatron-core is not installed. It is looked up without being imported:
Megatron code (and the CPU fixes that patch torch.cuda) runs only in the spawned ranks of `workers`, never in
the pytest process. This directory has no `__init__.py` on purpose: as a package it would be importable as
`megatron` (tests/ is on sys.path) and hide megatron-core.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron_workers import Workers

HERE = Path(__file__).parent


def _megatron_core_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


MEGATRON_CORE_INSTALLED = _megatron_core_installed()


def pytest_collection_modifyitems(config, items):
    """Skip this directory's tests when megatron-core is missing (its modules import no Megatron at the top, so
    they still collect; a skip raised while importing this conftest would abort `pytest tests/megatron_backend`)."""
    if MEGATRON_CORE_INSTALLED:
        return
    skip = pytest.mark.skip(reason="megatron-core is not installed (pip install 'slime-rl[megatron]')")
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(skip)


VOCAB = 61  # odd: exercises vocabulary padding at every tensor-parallel size
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


@dataclass(frozen=True)
class TinyModel:
    """A tiny Hugging Face checkpoint on disk and its model (float32, eval mode)."""

    name: str
    directory: Path
    model: Any

    @property
    def config(self) -> Any:
        return self.model.config

    def state(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors as `save_pretrained` wrote them (no lm_head when tied)."""
        from safetensors.torch import load_file

        return load_file(str(self.directory / "model.safetensors"))


def _perturbed(model: Any, seed: int) -> Any:
    """Give every tensor (biases and norms included, which start at 0 and 1) distinct random values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model.eval()


def _build(kind: str, directory: Path) -> TinyModel:
    import transformers

    from slime.plugins.tiny_model import ensure_tiny_model

    if kind == "qwen3_tiny":  # the built-in model: Qwen3, tied embeddings, vocab 61
        path = ensure_tiny_model(directory)
        return TinyModel(
            kind, path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        )
    specs = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"num_hidden_layers": 4}),
        "qwen2_tied": (
            transformers.Qwen2Config,
            transformers.Qwen2ForCausalLM,
            {"num_hidden_layers": 2, "tie_word_embeddings": True},
        ),
        "qwen3": (
            transformers.Qwen3Config,
            transformers.Qwen3ForCausalLM,
            {"num_hidden_layers": 2, "head_dim": 24, "tie_word_embeddings": False},
        ),
        "llama": (
            transformers.LlamaConfig,
            transformers.LlamaForCausalLM,
            {
                "num_hidden_layers": 2,
                "tie_word_embeddings": True,
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            },
        ),
    }
    config_class, model_class, extra = specs[kind]
    config = config_class(**{**SHAPE, **extra})
    torch.manual_seed(0)
    model = _perturbed(model_class(config), seed=len(kind))
    model.save_pretrained(directory)
    return TinyModel(kind, directory, model)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, TinyModel]:
    """qwen2 (untied, 4 layers), qwen2_tied, qwen3 (untied, head_dim 24 != hidden/heads), qwen3_tiny (the
    built-in tied model from `ensure_tiny_model`) and llama (tied, llama3 RoPE scaling); all with vocabulary 61."""
    root = tmp_path_factory.mktemp("tiny_hf")
    kinds = ("qwen2", "qwen2_tied", "qwen3", "qwen3_tiny", "llama")
    return {kind: _build(kind, root / kind) for kind in kinds}


@pytest.fixture(scope="session")
def workers():
    """Two spawned ranks joined over gloo, shared by every Megatron test of the session."""
    pool = Workers(world_size=2)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def sample_tokens() -> torch.Tensor:
    """A fixed [2, 12] batch of token ids below the true vocabulary size."""
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))


LAYOUTS = {"tp1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}  # on two ranks: DP=2, TP=2, PP=2


class ModelRuns:
    """`megatron_jobs.model_job` results per (model, layout), computed once per session and merged over ranks
    (rank 0's gathered `state` and `grads`, the last stage's `logprobs` and `entropy`)."""

    def __init__(self, workers: Workers, models: dict[str, TinyModel], tokens: torch.Tensor) -> None:
        self.workers, self.models, self.tokens = workers, models, tokens
        self._cache: dict[tuple[str, str], dict[str, Any]] = {}

    def get(self, kind: str, layout: str) -> dict[str, Any]:
        from megatron_jobs import model_job

        key = (kind, layout)
        if key not in self._cache:
            per_rank = self.workers.run(model_job, str(self.models[kind].directory), LAYOUTS[layout], self.tokens)
            merged: dict[str, Any] = {}
            for result in per_rank:
                merged.update({name: value for name, value in result.items() if value is not None})
            self._cache[key] = merged
        return self._cache[key]


@pytest.fixture(scope="session")
def model_runs(workers, tiny_models, sample_tokens) -> ModelRuns:
    return ModelRuns(workers, tiny_models, sample_tokens)
