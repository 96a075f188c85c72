"""The built-in torch training backend: losses, training steps, checkpoints, weight export, DDP."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import socket
import types
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from slime.plugins import torch_checkpoint as ckpt
from slime.plugins.rl_losses import LossSettings, kl_penalty, masked_mean, policy_loss
from slime.plugins.torch_backend import TorchTrainRayActor
from slime.weight_sync import WeightUpdate

PROMPT_LEN, RESPONSE_LEN = 4, 3


def save_tiny_qwen2(directory: Path, *, seed: int, vocab_size: int = 64, width: int = 64, layers: int = 2) -> Path:
    """A randomly initialised Qwen2 (`width` hidden units, twice that in the MLP, 4 heads per 64) saved to
    `directory`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = max(1, width // 16)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        Qwen2ForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = save_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)
    (directory / "tokenizer.json").write_text('{"marker": "tokenizer"}')
    return directory


def make_args(hf_dir: Path, tmp_path: Path, **overrides) -> types.SimpleNamespace:
    values = dict(
        hf_checkpoint=str(hf_dir),
        lr=1e-2,
        eps_clip=0.2,
        kl_coef=0.0,
        n_samples_per_prompt=2,
        micro_batch_size=2,
        save=str(tmp_path / "save"),
        load=None,
        seed=7,
    )
    values.update(overrides)
    return types.SimpleNamespace(**values)


def make_batch(rewards=(1.0, 0.0, 1.0, 0.0)) -> dict:
    """Two prompts, two responses each; the first response of each prompt is the rewarded one."""
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    responses = [[10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 42]]
    tokens = [prompts[i // 2] + responses[i] for i in range(4)]
    return {
        "tokens": [torch.tensor(t) for t in tokens],
        "response_lengths": [RESPONSE_LEN] * 4,
        "loss_masks": [torch.ones(RESPONSE_LEN, dtype=torch.int32) for _ in range(4)],
        "rewards": list(rewards),
        "total_lengths": [len(t) for t in tokens],
    }


def start(args, **kw) -> tuple[TorchTrainRayActor, int]:
    actor = TorchTrainRayActor(world_size=1, rank=0)
    return actor, actor.init(args, "actor", **kw)


def sequence_log_probs(actor: TorchTrainRayActor, data: dict) -> torch.Tensor:
    from slime.plugins.train_batch import TrainBatch

    batch = TrainBatch.from_data(data)
    per_sample = actor._frozen_log_probs(actor.model, batch, [list(range(len(batch)))])
    return torch.stack([lp.sum() for lp in per_sample])


def params(actor: TorchTrainRayActor) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in actor.model.state_dict().items()}


# ----------------------------------------------------------------- losses


def test_policy_loss_clips_the_ratio_on_the_side_the_advantage_favours():
    old = torch.zeros(1, 4)
    log_probs = torch.log(torch.tensor([[1.5, 1.5, 0.5, 1.0]])).requires_grad_()
    advantages = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    loss, clipped = policy_loss(log_probs, old, advantages, eps_clip=0.2)
    assert torch.allclose(loss, torch.tensor([[-1.2, 1.5, -0.5, -1.0]]))
    assert clipped.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    loss.sum().backward()
    assert log_probs.grad[0, 0] == 0  # the clipped branch carries no gradient
    assert log_probs.grad[0, 1] != 0
    high, _ = policy_loss(log_probs.detach(), old, advantages, eps_clip=0.2, eps_clip_high=0.28)
    assert math.isclose(high[0, 0].item(), -1.28, rel_tol=1e-6)
    with pytest.raises(ValueError, match="eps-clip"):
        policy_loss(log_probs, old, advantages, eps_clip=-0.1)


def test_masked_mean_counts_only_masked_in_tokens():
    values = torch.tensor([[1.0, 2.0, 100.0], [5.0, 7.0, 9.0], [3.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert masked_mean(values, mask).tolist() == [1.5, 7.0, 0.0]


def test_kl_is_zero_when_policy_equals_reference():
    log_probs = torch.log(torch.tensor([[0.2, 0.5, 0.9]]))
    for estimator in ("k1", "k2", "k3", "low_var_kl"):
        assert torch.equal(kl_penalty(log_probs, log_probs.clone(), estimator), torch.zeros(1, 3))
    other = log_probs + torch.tensor([[0.3, -0.2, 0.1]])
    assert (kl_penalty(log_probs, other, "k3") > 0).all()
    assert (kl_penalty(log_probs, other, "k2") > 0).all()
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
        kl_penalty(log_probs, other, "k9")


def test_training_raises_log_prob_of_rewarded_responses(hf_dir, tmp_path):
    actor, start_id = start(make_args(hf_dir, tmp_path))
    assert start_id == 0
    data = make_batch()
    before = sequence_log_probs(actor, data)
    history = [actor.train_from_data(step, data) for step in range(4)]
    after = sequence_log_probs(actor, data)
    assert (after[[0, 2]] > before[[0, 2]]).all(), (before, after)
    assert (after[[1, 3]] < before[[1, 3]]).all(), (before, after)
    first = history[0]
    assert set(first) >= {"train/loss", "train/pg_loss", "train/kl", "train/clipfrac", "train/grad_norm", "train/lr"}
    assert math.isclose(first["train/ppo_ratio"], 1.0, rel_tol=1e-6)  # old log-probs come from the same weights
    assert first["train/clipfrac"] == 0.0 and first["train/kl"] == 0.0
    assert all(math.isfinite(v) and v >= 0 for m in history for v in (m["train/grad_norm"], m["train/clipfrac"]))
    assert actor.global_step == 4


def test_loss_mask_excludes_tokens_and_precomputed_advantages_win(hf_dir, tmp_path):
    actor, _ = start(make_args(hf_dir, tmp_path))
    data = make_batch()
    data["loss_masks"] = [torch.zeros(RESPONSE_LEN, dtype=torch.int32) for _ in range(4)]
    weights = params(actor)
    metrics = actor.train_from_data(0, data)
    assert metrics["train/grad_norm"] == 0.0
    assert all(torch.equal(weights[k], v) for k, v in params(actor).items())

    # Advantages in the data replace the reward-based ones: here they reverse the preference.
    data = make_batch()
    data["advantages"] = [-1.0, 1.0, -1.0, 1.0]
    before = sequence_log_probs(actor, data)
    for step in range(3):
        actor.train_from_data(step, data)
    after = sequence_log_probs(actor, data)
    assert (after[[1, 3]] > before[[1, 3]]).all() and (after[[0, 2]] < before[[0, 2]]).all()


def test_kl_to_reference_starts_at_zero_and_grows(hf_dir, tmp_path):
    actor, _ = start(make_args(hf_dir, tmp_path, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3"))
    assert actor.ref_model is not None
    data = make_batch()
    first = actor.train_from_data(0, data)
    assert first["train/kl"] == 0.0
    later = [actor.train_from_data(step, data) for step in range(1, 3)]
    assert later[-1]["train/kl"] > 0.0


def test_ref_load_is_the_kl_reference_instead_of_the_starting_model(hf_dir, tmp_path):
    reference = save_tiny_qwen2(tmp_path / "reference", seed=1, width=32, layers=1)  # another model, same vocabulary
    actor, _ = start(
        make_args(hf_dir, tmp_path, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", ref_load=str(reference))
    )
    assert actor.ref_model.config.num_hidden_layers == 1  # any architecture that scores the policy's tokens
    assert actor.train_from_data(0, make_batch())["train/kl"] > 0.0  # the policy is not the reference at step 0

    other_vocabulary = save_tiny_qwen2(tmp_path / "other_vocabulary", seed=1, vocab_size=80, width=32, layers=1)
    with pytest.raises(
        ValueError, match=rf"--ref-load {other_vocabulary} has a vocabulary of 80 tokens but the policy has 64"
    ):
        start(make_args(hf_dir, tmp_path, kl_coef=0.1, ref_load=str(other_vocabulary)))


def test_schedule_from_the_batch_builder_gives_one_step_per_global_batch(hf_dir, tmp_path):
    actor, _ = start(make_args(hf_dir, tmp_path))
    data = make_batch()
    data.update(partition=[0, 1, 2, 3], global_batch_sizes=[2, 2], num_microbatches=[1, 1])
    data["micro_batch_indices"] = [[0, 1], [2, 3]]
    metrics = actor.train_from_data(0, data)
    assert metrics["train/steps"] == 2.0 and actor.global_step == 2
    data["num_microbatches"] = [1, 2]
    with pytest.raises(ValueError, match="inconsistent training schedule"):
        actor.train_from_data(1, data)


def test_an_optimizer_step_without_signal_is_skipped(hf_dir, tmp_path):
    actor, _ = start(make_args(hf_dir, tmp_path))
    data = make_batch()
    data.update(partition=[0, 1, 2, 3], global_batch_sizes=[2, 2], num_microbatches=[1, 1])
    data["micro_batch_indices"] = [[0, 1], [2, 3]]
    actor.train_from_data(0, data)  # builds AdamW momentum
    data["rewards"] = [0.0, 0.0, 0.0, 0.0]
    weights = params(actor)
    metrics = actor.train_from_data(1, data)
    assert metrics["train/steps"] == 0.0 and metrics["train/skipped_steps"] == 2.0
    assert actor.global_step == 2, "a skipped step is no optimizer step"
    assert all(torch.equal(weights[k], v) for k, v in params(actor).items()), "momentum moved the weights"

    data["rewards"] = [0.0, 0.0, 1.0, 0.0]  # only the second step has signal
    metrics = actor.train_from_data(2, data)
    assert metrics["train/steps"] == 1.0 and metrics["train/skipped_steps"] == 1.0 and actor.global_step == 3


def test_an_entropy_bonus_still_steps_when_every_advantage_is_zero(hf_dir, tmp_path):
    """A policy whose groups all answer alike gets no policy-gradient signal; the entropy bonus is what pushes it
    back to exploring, so the step is taken, on the entropy term alone."""
    actor, _ = start(make_args(hf_dir, tmp_path, entropy_coef=0.5))
    data = make_batch(rewards=(0.0, 0.0, 0.0, 0.0))
    weights = params(actor)
    metrics = actor.train_from_data(0, data)
    assert metrics["train/steps"] == 1.0 and metrics["train/skipped_steps"] == 0.0 and actor.global_step == 1
    assert metrics["train/pg_loss"] == 0.0 and metrics["train/entropy"] > 0.0
    assert metrics["train/loss"] == pytest.approx(-0.5 * metrics["train/entropy"])
    assert not all(torch.equal(weights[k], v) for k, v in params(actor).items()), "the step left the weights alone"
    assert LossSettings.from_args(make_args(hf_dir, tmp_path)).needs_advantages
    assert not LossSettings.from_args(make_args(hf_dir, tmp_path, entropy_coef=0.5)).needs_advantages
    assert not LossSettings.from_args(make_args(hf_dir, tmp_path, kl_coef=0.1)).needs_advantages
    assert not LossSettings.from_args(make_args(hf_dir, tmp_path, use_kl_loss=True, kl_loss_coef=0.1)).needs_advantages
    assert LossSettings.from_args(make_args(hf_dir, tmp_path, kl_loss_coef=0.1)).needs_advantages  # no --use-kl-loss


def test_engine_log_probs_are_compared_with_the_trainers(hf_dir, tmp_path):
    actor, _ = start(make_args(hf_dir, tmp_path))
    data = make_batch()
    from slime.plugins.train_batch import TrainBatch

    same = actor._frozen_log_probs(actor.model, TrainBatch.from_data(data), [[0, 1, 2, 3]])
    data["rollout_log_probs"] = [lp.tolist() for lp in same]
    assert actor.train_from_data(0, data)["train/rollout_logprob_abs_diff"] == pytest.approx(0.0, abs=1e-6)
    data = make_batch()
    data["rollout_log_probs"] = [(lp - 0.5).tolist() for lp in same]  # as if the engines ran other weights
    assert actor.train_from_data(1, data)["train/rollout_logprob_abs_diff"] > 0.1
    assert "train/rollout_logprob_abs_diff" not in actor.train_from_data(2, make_batch())


def test_entropy_bonus_keeps_the_policy_from_sharpening(hf_dir, tmp_path):
    def entropy_after(coef: float) -> float:
        actor, _ = start(make_args(hf_dir, tmp_path / str(coef), entropy_coef=coef))
        history = [actor.train_from_data(step, make_batch()) for step in range(4)]
        assert all(m["train/entropy"] > 0 for m in history)
        return actor.train_from_data(4, make_batch())["train/entropy"]

    assert entropy_after(1.0) > entropy_after(0.0)


def test_bad_training_data_is_rejected_with_the_reason(hf_dir, tmp_path):
    actor, _ = start(make_args(hf_dir, tmp_path))
    data = make_batch()
    data["loss_masks"][2] = torch.ones(RESPONSE_LEN + 1)
    with pytest.raises(ValueError, match="sample 2: loss mask has 4 entries"):
        actor.train_from_data(0, data)
    data = make_batch()
    data["response_lengths"][0] = PROMPT_LEN + RESPONSE_LEN
    with pytest.raises(ValueError, match="leave a prompt"):
        actor.train_from_data(0, data)
    data = make_batch()
    data["rollout_log_probs"] = [torch.zeros(RESPONSE_LEN - 1)] * 4
    actor.settings = dataclasses.replace(actor.settings, use_rollout_logprobs=True)
    with pytest.raises(ValueError, match="sample 0: 2 rollout log-probs for 3 response tokens"):
        actor.train_from_data(0, data)
    data = make_batch()
    del data["rewards"]
    with pytest.raises(ValueError, match="nothing to learn from"):
        actor.train_from_data(0, data)


def test_an_unknown_role_fails_at_init(hf_dir, tmp_path):
    with pytest.raises(ValueError, match="trains role 'actor' or 'critic', not 'teacher'"):
        TorchTrainRayActor(world_size=1, rank=0).init(make_args(hf_dir, tmp_path), "teacher")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"micro_batch_size": 0}, "--micro-batch-size must be >= 1, got 0"),
        ({"eps_clip": -0.1}, "--eps-clip must be >= 0.0, got -0.1"),
        ({"kl_loss_type": "k9"}, "--kl-loss-type must be one of k1, k2, k3, low_var_kl, got 'k9'"),
        ({"lr_decay_style": "linear"}, "--lr-decay-style linear needs --lr-decay-iters or --num-rollout"),
    ],
)
def test_settings_are_validated_at_init_naming_the_flag(hf_dir, tmp_path, overrides, message):
    actor = TorchTrainRayActor(world_size=1, rank=0)
    with pytest.raises(ValueError, match=re.escape(message)):
        actor.init(make_args(hf_dir, tmp_path, **overrides), "actor")
    assert actor.model is None  # refused before any model is loaded


# ------------------------------------------------------------ checkpoints


def test_save_load_round_trip_restores_weights_optimizer_and_rng(hf_dir, tmp_path):
    args = make_args(hf_dir, tmp_path)
    data = make_batch()
    first, _ = start(args)
    first.train_from_data(0, data)
    first.save_model(0)
    saved_weights = params(first)
    saved_moments = {k: v.clone() for k, v in first.optimizer.state[next(iter(first.optimizer.state))].items()}
    root = Path(args.save)
    assert (root / ckpt.TRACKER_FILE).read_text() == "0"
    names = {p.name for p in ckpt.iter_dir(root, 0).iterdir()}
    assert {"config.json", "model.safetensors", "optimizer.pt", "opt_param_scheduler.pt", "rng_state_rank0.pt"} <= names
    assert not list(root.glob(".*"))  # no staging left behind

    draw = (torch.rand(4), random.random(), np.random.rand())
    first.train_from_data(1, data)
    expected = params(first)

    resumed, start_id = start(make_args(hf_dir, tmp_path, load=args.save))
    assert start_id == 1
    assert all(torch.equal(saved_weights[k], v) for k, v in params(resumed).items())
    moments = resumed.optimizer.state[next(iter(resumed.optimizer.state))]
    assert all(torch.equal(saved_moments[k], moments[k]) for k in saved_moments)
    assert resumed.global_step == 1
    redraw = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(redraw[0], draw[0]) and redraw[1:] == draw[1:]
    resumed.train_from_data(1, data)
    assert all(torch.equal(expected[k], v) for k, v in params(resumed).items())

    fresh_optim, _ = start(make_args(hf_dir, tmp_path, load=args.save, no_load_optim=True))
    assert not fresh_optim.optimizer.state


def test_load_without_tracker_starts_fresh_and_missing_step_fails(hf_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    _, start_id = start(make_args(hf_dir, tmp_path, load=str(tmp_path / "empty")))
    assert start_id == 0
    with pytest.raises(FileNotFoundError, match="--ckpt-step"):
        start(make_args(hf_dir, tmp_path, load=str(tmp_path / "empty"), ckpt_step=5))


def test_failed_save_leaves_no_half_directory_and_keeps_the_tracker(hf_dir, tmp_path, monkeypatch):
    args = make_args(hf_dir, tmp_path)
    actor, _ = start(args)
    actor.save_model(0)
    real_save = torch.save

    def failing_save(obj, path, *a, **kw):
        if Path(path).name == ckpt.OPTIMIZER_FILE:
            raise OSError("disk full")
        return real_save(obj, path, *a, **kw)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(RuntimeError, match="iter_0000001 failed: disk full"):
        actor.save_model(1)
    root = Path(args.save)
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000000", ckpt.TRACKER_FILE]
    assert (root / ckpt.TRACKER_FILE).read_text() == "0"
    with pytest.raises(ValueError, match="--save"):
        start(make_args(hf_dir, tmp_path, save=None))[0].save_model(0)


def test_disk_weight_export_is_loadable_by_from_pretrained(hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    actor, _ = start(make_args(hf_dir, tmp_path))
    actor.train_from_data(0, make_batch())
    weights = tmp_path / "weights"
    actor.update_weights(WeightUpdate(4, "disk", disk_dir=str(weights / "weight_v000004")))
    assert sorted(p.name for p in weights.iterdir()) == ["weight_v000004"]
    loaded = AutoModelForCausalLM.from_pretrained(weights / "weight_v000004")
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in params(actor).items())
    assert json.loads((weights / "weight_v000004" / "tokenizer.json").read_text()) == {"marker": "tokenizer"}

    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(RuntimeError, match=r"weight update 5 \(disk\) to .*a-file/weight_v000005 failed"):
        actor.update_weights(WeightUpdate(5, "disk", disk_dir=str(tmp_path / "a-file" / "weight_v000005")))
    assert sorted(p.name for p in weights.iterdir()) == ["weight_v000004"]  # nothing half-written


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory) -> Path:
    """A model the CPU engine serves (with a real tokenizer): the built-in tiny model."""
    from slime.plugins.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("served") / "tiny")


@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_rank_zero_sends_the_trained_weights_to_a_cpu_engine(served_dir, tmp_path, transport):
    from slime.plugins.cpu_engine_server import EngineServer

    engine = EngineServer(str(served_dir), num_threads=1)
    try:
        actor, _ = start(make_args(served_dir, tmp_path))
        actor.train_from_data(0, make_batch())
        actor.update_weights(WeightUpdate(6, transport, (engine.url,), bucket_bytes=8192, timeout_s=60))
        prompt = [1, 2, 3, 4]
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_logprob": True}
        meta = httpx.post(f"{engine.url}/generate", json=body, timeout=60).json()["meta_info"]
        assert meta["weight_version"] == "6"
        tokens = [token for _, token, *_ in meta["output_token_logprobs"]]
        with torch.no_grad():
            log_probs = torch.log_softmax(actor.model(torch.tensor([prompt + tokens])).logits[0], -1)
        for i, (log_prob, token, *_) in enumerate(meta["output_token_logprobs"]):
            assert log_prob == pytest.approx(log_probs[len(prompt) - 1 + i, token].item(), abs=1e-4)
        engine.stop()
        with pytest.raises(RuntimeError, match=f"weight update 7 \\({transport}\\) to {engine.url} failed: rollout en"):
            actor.update_weights(WeightUpdate(7, transport, (engine.url,), timeout_s=10))
    finally:
        engine.stop()


def test_the_plugin_registers_the_torch_backend():
    from slime.plugin_manager import registry_for

    spec = registry_for(types.SimpleNamespace()).get("train_backends", "torch")
    assert spec.target is TorchTrainRayActor


# -------------------------------------------------------------------- DDP


def _ddp_worker(rank: int, port: int, hf: str, out: str) -> None:
    torch.set_num_threads(1)
    args = make_args(Path(hf), Path(out), save=str(Path(out) / "save"))
    actor = TorchTrainRayActor(world_size=2, rank=rank, master_addr="127.0.0.1", master_port=port)
    actor.init(args, "actor")
    full = make_batch(rewards=(1.0, 0.0, 0.0, 1.0))
    partition = [[0, 2], [1, 3]][rank]  # every prompt group is split across the two ranks
    shard = {key: [full[key][i] for i in partition] for key in ("tokens", "response_lengths", "loss_masks", "rewards")}
    shard.update(partition=partition, global_batch_sizes=[4], num_microbatches=[1], micro_batch_indices=[[0, 1]])
    metrics = [actor.train_from_data(step, shard) for step in range(2)]
    actor.save_model(1)
    actor.update_weights(WeightUpdate(2, "distributed"))  # no engines: nothing to send, both ranks return
    try:  # rank 0 cannot reach the engine (nothing listens on port 9): every rank learns it failed
        actor.update_weights(WeightUpdate(3, "distributed", ("http://127.0.0.1:9",), timeout_s=5))
        sent = "sent"
    except RuntimeError as exc:
        sent = str(exc)
    torch.save({"params": params(actor), "metrics": metrics, "sent": sent}, Path(out) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_rank_ddp_over_gloo_keeps_ranks_identical_and_matches_one_process(hf_dir, tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_ddp_worker, args=(port, str(hf_dir), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert all(torch.equal(ranks[0]["params"][k], ranks[1]["params"][k]) for k in ranks[0]["params"])
    assert ranks[0]["metrics"] == ranks[1]["metrics"]
    assert ranks[0]["sent"].startswith("weight update 3 (distributed) to http://127.0.0.1:9 failed: rollout engine")
    assert ranks[1]["sent"] == "weight update 3 (distributed) to http://127.0.0.1:9 failed: on another rank"
    assert {p.name for p in ckpt.iter_dir(tmp_path / "save", 1).glob("rng_state_rank*.pt")} == {
        "rng_state_rank0.pt",
        "rng_state_rank1.pt",
    }

    single, _ = start(make_args(hf_dir, tmp_path / "single", micro_batch_size=4))
    data = make_batch(rewards=(1.0, 0.0, 0.0, 1.0))
    expected = [single.train_from_data(step, data) for step in range(2)]
    for got, want in zip(ranks[0]["metrics"], expected, strict=True):
        assert math.isclose(got["train/loss"], want["train/loss"], rel_tol=1e-4, abs_tol=1e-6)
    diff = max((ranks[0]["params"][k] - v).abs().max().item() for k, v in params(single).items())
    assert diff < 1e-4, diff


# ------------------------------------------------------------ --fp16


def test_fp16_trains_with_loss_scaling_and_float32_master_weights(hf_dir, tmp_path):
    actor, _ = start(make_args(hf_dir, tmp_path, fp16=True))
    scaler = actor.parallel.grad_scaler
    assert scaler.is_enabled() and scaler.get_scale() == 2.0**16
    before = params(actor)
    metrics = actor.train_from_data(0, make_batch())
    assert metrics["train/steps"] == 1.0 and metrics["train/skipped_steps"] == 0.0
    assert math.isfinite(metrics["train/grad_norm"]) and metrics["train/grad_norm"] > 0
    after = params(actor)
    assert all(v.dtype == torch.float32 for v in after.values())
    assert any(not torch.equal(before[k], v) for k, v in after.items())


def test_an_fp16_step_whose_scaled_gradients_overflow_is_skipped_and_the_scale_lowered(hf_dir, tmp_path):
    actor, _ = start(make_args(hf_dir, tmp_path, fp16=True))
    actor.parallel.grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**64)  # float16 gradients overflow
    before = params(actor)
    metrics = actor.train_from_data(0, make_batch())
    assert (metrics["train/steps"], metrics["train/skipped_steps"]) == (0.0, 1.0)
    assert all(torch.equal(before[k], v) for k, v in params(actor).items()) and actor.global_step == 0
    assert actor.parallel.grad_scaler.get_scale() == 2.0**63


def test_the_fp16_loss_scale_is_saved_and_restored_with_the_checkpoint(hf_dir, tmp_path):
    args = make_args(hf_dir, tmp_path, fp16=True)
    first, _ = start(args)
    first.parallel.grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**64)
    first.train_from_data(0, make_batch())  # overflows: the scale halves
    first.save_model(0)
    resumed, _ = start(make_args(hf_dir, tmp_path, fp16=True, load=args.save))
    assert resumed.parallel.grad_scaler.get_scale() == 2.0**63


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--bf16", "--fp16"], "--bf16 with --fp16: choose one training precision"),
        (["--fp16", "--fsdp"], "--fp16 with --fsdp is not supported"),
        (["--fp16", "--train-backend", "megatron"], "--fp16: the Megatron backend here trains in float32 or --bf16"),
    ],
)
def test_precision_flags_a_run_cannot_use_are_refused_at_parse_time(argv, expected, capsys) -> None:
    from slime.utils.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--plugin", "straw", *argv])
    assert expected in capsys.readouterr().err
    assert parse_args(["--plugin", "straw", "--fp16"]).fp16 is True
