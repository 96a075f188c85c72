"""The Megatron backend's rank (`MegatronTrainRayActor`) trains the same at every parallel layout, and resumes.

Synthetic GRPO steps (megatron_actor_runs.py) through real ranks over gloo: TP=2, PP=2, DP=2 (plain and with
the distributed optimizer) against one rank, step by step; checkpoints saved at one layout resume at the same
one exactly and at another one with the same model and optimizer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_actor_runs import run_ranks, synthetic_steps
from slime.plugins.tiny_model import ensure_tiny_model

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

NUM_STEPS = 3
LAYOUTS = {
    "tp2": {"tensor_model_parallel_size": 2},
    "pp2": {"pipeline_model_parallel_size": 2},
    "dp2": {},
    "dp2-distributed-optimizer": {"use_distributed_optimizer": True},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("megatron") / "model")


@pytest.fixture(scope="module")
def steps(model_dir: Path) -> list[dict]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return synthetic_steps(NUM_STEPS, vocab)


def _options(model_dir: Path, **overrides) -> dict:
    return {
        "train_backend": "megatron",
        "hf_checkpoint": str(model_dir),
        "lr": 1e-3,
        "entropy_coef": 0.05,
        "kl_coef": 0.01,  # a KL penalty in the reward
        "use_kl_loss": True,
        "kl_loss_coef": 0.01,
        **overrides,
    }


@pytest.fixture(scope="module")
def one_rank(model_dir: Path, steps: list, tmp_path_factory: pytest.TempPathFactory) -> tuple[list, dict]:
    out = tmp_path_factory.mktemp("one-rank")
    result = run_ranks(1, _options(model_dir), steps, out, export=str(out / "export"))
    return result["metrics"], load_file(out / "export" / "model.safetensors")


def _series(metrics: list[dict], name: str) -> list[float]:
    return [step[name] for step in metrics]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_rank_layouts_train_like_one_rank(layout, model_dir, steps, one_rank, tmp_path):
    reference, reference_weights = one_rank
    out = tmp_path / layout
    result = run_ranks(2, _options(model_dir, **LAYOUTS[layout]), steps, out, export=str(out / "export"))
    metrics = result["metrics"]
    for name in ("train/loss", "train/pg_loss", "train/kl", "train/kl_reward", "train/entropy", "train/grad_norm"):
        got, want = _series(metrics, name), _series(reference, name)
        assert got == pytest.approx(want, abs=1e-6), f"{layout}: {name} {got} != {want}"
    assert all(step["train/steps"] == 2 for step in metrics)
    weights = load_file(out / "export" / "model.safetensors")
    assert weights.keys() == reference_weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, reference_weights[name], atol=1e-5, rtol=0, msg=f"{layout}: {name}")


def test_a_checkpoint_resumes_exactly_and_at_another_layout(model_dir, steps, tmp_path):
    tp2 = _options(model_dir, tensor_model_parallel_size=2, save=str(tmp_path / "save"))
    straight = run_ranks(2, {**tp2, "save": None}, steps, tmp_path / "straight")["metrics"]
    run_ranks(2, tp2, steps[:2], tmp_path / "first", save_every_step=True)
    saved = tmp_path / "save"
    assert (saved / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert sorted(p.name for p in saved.iterdir() if p.name.startswith("iter_")) == ["iter_0000000", "iter_0000001"]
    assert not list(saved.glob(".iter_*")), "a staging directory was left behind"
    state = json.loads((saved / "iter_0000001" / "train_state.json").read_text())
    assert (state["tensor_model_parallel_size"], state["global_step"]) == (2, 4)

    resumed = run_ranks(2, {**tp2, "load": str(saved)}, steps[2:], tmp_path / "resumed")
    assert resumed["first"] == 2
    assert resumed["metrics"][0]["train/loss"] == straight[2]["train/loss"]
    assert resumed["metrics"][0]["train/grad_norm"] == straight[2]["train/grad_norm"]

    one_rank = {**tp2, "tensor_model_parallel_size": 1, "load": str(saved), "no_load_rng": True}
    resharded = run_ranks(1, one_rank, steps[2:], tmp_path / "resharded")
    assert resharded["metrics"][0]["train/loss"] == pytest.approx(straight[2]["train/loss"], abs=1e-6)


def test_resuming_at_another_layout_with_the_random_state_is_refused(model_dir, steps, tmp_path):
    options = _options(model_dir, tensor_model_parallel_size=2, save=str(tmp_path / "save"))
    run_ranks(2, options, steps[:1], tmp_path / "first", save_every_step=True)
    with pytest.raises(AssertionError, match="--no-load-rng"):
        run_ranks(1, {**options, "tensor_model_parallel_size": 1, "load": options["save"]}, steps[1:], tmp_path / "x")


def test_the_distributed_optimizer_resumes_at_its_layout_and_refuses_another(model_dir, steps, one_rank, tmp_path):
    reference, _ = one_rank
    options = _options(model_dir, use_distributed_optimizer=True, save=str(tmp_path / "save"))
    run_ranks(2, options, steps[:2], tmp_path / "first", save_every_step=True)
    resumed = run_ranks(2, {**options, "load": options["save"]}, steps[2:], tmp_path / "resumed")
    assert resumed["metrics"][0]["train/loss"] == pytest.approx(reference[2]["train/loss"], abs=1e-6)

    tp2 = {**options, "tensor_model_parallel_size": 2, "load": options["save"], "no_load_rng": True}
    with pytest.raises(AssertionError, match="cannot reshard it to TP=2 PP=1"):
        run_ranks(2, tp2, steps[2:], tmp_path / "refused")
    fresh_optimizer = run_ranks(2, {**tp2, "no_load_optim": True}, steps[2:], tmp_path / "fresh-optimizer")
    assert fresh_optimizer["first"] == 2


def test_tis_and_the_token_mean_loss_on_tensor_parallel_ranks(model_dir, steps, tmp_path):
    """`--use-tis` on TP=2: engine log-probs far below the trainer's give weights far above `--tis-clip`, so every
    token's weight is the bound and every token counts as clipped; the step divides by the global batch's tokens
    (`--loss-agg-mode token-mean`, a count summed once per data-parallel replica)."""
    engine_far_off = [{**s, "rollout_log_probs": [[-50.0] * n for n in s["response_lengths"]]} for s in steps[:1]]
    options = _options(model_dir, tensor_model_parallel_size=2, use_tis=True, tis_clip=1.5, loss_agg_mode="token-mean")
    metrics = run_ranks(2, options, engine_far_off, tmp_path)["metrics"][0]
    assert metrics["train/steps"] >= 1 and math.isfinite(metrics["train/grad_norm"])
    assert metrics["train/tis_weight"] == pytest.approx(1.5)
    assert metrics["train/tis_clipfrac"] == pytest.approx(1.0)


def test_tp2_ranks_send_their_weights_to_a_running_engine(model_dir, steps, tmp_path):
    """Gathered from both tensor-parallel ranks and sent by rank 0 through `slime.weight_sync` (gloo on CPU): the
    engine then serves exactly the weights the ranks exported, as the new version."""
    import httpx
    from transformers import AutoModelForCausalLM

    from slime.plugins.cpu_engine_server import EngineServer

    engine = EngineServer(str(model_dir), num_threads=1)
    try:
        export = tmp_path / "export"
        send = ("distributed", engine.url, 7)
        run_ranks(
            2, _options(model_dir, tensor_model_parallel_size=2), steps[:1], tmp_path, export=str(export), send=send
        )
        trained = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
        prompt = [5, 17, 42, 9, 33, 7]
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True}
        meta = httpx.post(f"{engine.url}/generate", json=body, timeout=60).json()["meta_info"]
        tokens = [token for _, token, *_ in meta["output_token_logprobs"]]
        with torch.no_grad():
            log_probs = torch.log_softmax(trained(torch.tensor([prompt + tokens])).logits[0], -1)
        ours = [log_probs[len(prompt) - 1 + i, token].item() for i, token in enumerate(tokens)]
        served = [log_prob for log_prob, *_ in meta["output_token_logprobs"]]
        assert meta["weight_version"] == "7"
        assert max(abs(a - b) for a, b in zip(served, ours, strict=True)) < 1e-4
    finally:
        engine.stop()
