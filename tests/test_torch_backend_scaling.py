"""The torch backend for real models: `--bf16`, `--gradient-checkpointing` and `--fsdp` (FSDP2 over gloo).

Single-process tests compare a flag against float32 / no flag on the same data. The two-rank tests spawn one
pair of processes (gloo) that runs DDP, FSDP, FSDP resumed from its own and from DDP's checkpoint, and FSDP
with bf16 and gradient checkpointing on the same shards; the tests below judge what the ranks saved.
"""

from __future__ import annotations

import json
import math
import socket
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from slime.data.checkpoint import critic_arguments
from slime.plugins import torch_checkpoint as ckpt
from slime.plugins.torch_backend import TorchTrainRayActor
from slime.plugins.torch_parallel import Parallelism
from slime.weight_sync import WeightUpdate

RESPONSE_LEN = 3
#: |bf16 - fp32| of the per-step mean loss on the tiny model (measured: up to ~3e-3; the loss is ~0.5).
BF16_LOSS_TOLERANCE = 2e-2
#: Exactness of FSDP against DDP, of resumed against uninterrupted runs, of gradient checkpointing against none.
EXACT = 1e-6


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model (tied input and output embeddings, as the demo trains)."""
    from slime.plugins.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def make_args(hf_dir: Path, save: Path, **overrides) -> types.SimpleNamespace:
    values = dict(
        hf_checkpoint=str(hf_dir), lr=1e-2, eps_clip=0.2, kl_coef=0.0, micro_batch_size=2, save=str(save), seed=7
    )
    values.update(overrides)
    return types.SimpleNamespace(**values)


def make_batch(count: int = 4) -> dict:
    """`count` samples (pairs of responses to one prompt; the first of each pair is rewarded) trained in two
    optimizer steps of one micro batch each: the second step's loss sees a policy ratio other than 1."""
    prompts = [[1 + i // 2, 2 + i // 2, 3 + i // 2, 4 + i // 2] for i in range(count)]
    tokens = [prompt + [10 + 5 * i, 11 + 5 * i, 12 + 5 * i] for i, prompt in enumerate(prompts)]
    return {
        "tokens": [torch.tensor(t) for t in tokens],
        "response_lengths": [RESPONSE_LEN] * count,
        "loss_masks": [torch.ones(RESPONSE_LEN) for _ in range(count)],
        "rewards": [float(i % 2 == 0) for i in range(count)],
        "global_batch_sizes": [count // 2, count - count // 2],
        "num_microbatches": [1, 1],
        "micro_batch_indices": [list(range(count // 2)), list(range(count // 2, count))],
    }


def start(args, world_size: int = 1, rank: int = 0) -> TorchTrainRayActor:
    actor = TorchTrainRayActor(world_size=world_size, rank=rank)
    actor.init(args, "actor")
    return actor


def full_params(actor: TorchTrainRayActor) -> dict[str, torch.Tensor]:
    """The full weights (gathered on rank 0 under FSDP; every rank must call this)."""
    return {k: v.detach().clone() for k, v in actor.parallel.full_model_state(actor.model).items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def sequence_log_probs(actor: TorchTrainRayActor, data: dict) -> torch.Tensor:
    from slime.plugins.train_batch import TrainBatch

    batch = TrainBatch.from_data(data)
    return torch.stack([lp.sum() for lp in actor._frozen_log_probs(actor.model, batch, [list(range(len(batch)))])])


def losses(history: list[dict]) -> list[float]:
    return [m["train/loss"] for m in history]


# ------------------------------------------------------------ one process


def test_bf16_trains_with_float32_weights_and_tracks_float32_losses(hf_dir, tmp_path):
    data = make_batch()
    fp32 = start(make_args(hf_dir, tmp_path / "fp32"))
    bf16 = start(make_args(hf_dir, tmp_path / "bf16", bf16=True))
    assert bf16.settings.bf16 and not fp32.settings.bf16
    with torch.no_grad():
        logits = bf16.parallel.logits(bf16.model, torch.tensor([data["tokens"][0].tolist()]))
    assert logits.dtype == torch.bfloat16  # the forward runs in bf16; the loss upcasts the logits
    before = sequence_log_probs(bf16, data)
    want = [fp32.train_from_data(step, data) for step in range(3)]
    got = [bf16.train_from_data(step, data) for step in range(3)]
    for g, w in zip(got, want, strict=True):
        assert abs(g["train/loss"] - w["train/loss"]) < BF16_LOSS_TOLERANCE, (losses(got), losses(want))
        assert math.isfinite(g["train/grad_norm"]) and g["train/grad_norm"] > 0
    after = sequence_log_probs(bf16, data)
    assert (after[0::2] > before[0::2]).all() and (after[1::2] < before[1::2]).all()  # it learns
    gap = max(abs(a - b) for a, b in zip(losses(got), losses(want), strict=True))
    drift = (after - sequence_log_probs(fp32, data)).abs().max().item()
    print(f"bf16 - fp32: loss max {gap:.2e} over {losses(want)}; sequence log-probs max {drift:.2e} of {after}")
    # Old log-probs are computed in the same precision: one optimizer step on fresh old log-probs has ratio 1.
    one_step = {k: v for k, v in data.items() if k not in ("global_batch_sizes", "num_microbatches")}
    one_step["micro_batch_indices"] = [list(range(len(data["tokens"])))]
    one_step.update(global_batch_sizes=[len(data["tokens"])], num_microbatches=[1])
    assert bf16.train_from_data(3, one_step)["train/ppo_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    moments = next(iter(bf16.optimizer.state.values()))
    assert moments["exp_avg"].dtype == moments["exp_avg_sq"].dtype == torch.float32
    # Exports and checkpoints are float32 Hugging Face files.
    bf16.save_model(2)
    bf16.update_weights(WeightUpdate(3, "disk", disk_dir=str(tmp_path / "weights" / "weight_v000003")))
    for directory in (ckpt.iter_dir(tmp_path / "bf16", 2), tmp_path / "weights" / "weight_v000003"):
        with safe_open(str(directory / "model.safetensors"), "pt") as handle:
            assert {handle.get_slice(k).get_dtype() for k in handle.keys()} == {"F32"}


def test_gradient_checkpointing_gives_the_same_losses_and_gradients(hf_dir, tmp_path):
    data = make_batch()
    plain = start(make_args(hf_dir, tmp_path / "plain"))
    checkpointed = start(make_args(hf_dir, tmp_path / "gc", gradient_checkpointing=True))
    for actor, enabled in ((checkpointed, True), (plain, False)):
        layers = [m for m in actor.model.modules() if hasattr(m, "gradient_checkpointing")]
        assert layers and all(m.gradient_checkpointing == enabled for m in layers)
    for step in range(2):
        want, got = plain.train_from_data(step, data), checkpointed.train_from_data(step, data)
        assert abs(got["train/loss"] - want["train/loss"]) < EXACT
        assert abs(got["train/grad_norm"] - want["train/grad_norm"]) < EXACT
        # The last optimizer step's gradients are still on the parameters.
        grads = zip(plain.model.parameters(), checkpointed.model.parameters(), strict=True)
        assert max((a.grad - b.grad).abs().max().item() for a, b in grads) < EXACT
    assert max_diff(full_params(plain), full_params(checkpointed)) < EXACT


def test_fsdp_on_one_rank_trains_like_no_fsdp(hf_dir, tmp_path):
    import torch.distributed as dist

    data = make_batch()
    plain = start(make_args(hf_dir, tmp_path / "plain"))
    want = [plain.train_from_data(step, data) for step in range(2)]
    try:
        sharded = start(make_args(hf_dir, tmp_path / "fsdp", fsdp=True))  # a one-rank process group of its own
        assert dist.get_world_size() == 1
        got = [sharded.train_from_data(step, data) for step in range(2)]
        assert max(abs(a - b) for a, b in zip(losses(got), losses(want), strict=True)) < EXACT
        assert max_diff(full_params(sharded), full_params(plain)) < EXACT
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_models_that_cannot_be_wrapped_are_refused_naming_the_flag(hf_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    parallel = Parallelism(device=torch.device("cpu"), world_size=1, rank=0, fsdp=True, gradient_checkpointing=True)
    monkeypatch.setattr(type(model), "supports_gradient_checkpointing", False)
    with pytest.raises(ValueError, match="--gradient-checkpointing: .* does not support .*drop the flag"):
        parallel.prepare(model)
    monkeypatch.setattr(model, "_no_split_modules", None)
    parallel.gradient_checkpointing = False
    with pytest.raises(ValueError, match="--fsdp: .* names no decoder layer class .*drop --fsdp"):
        parallel.prepare(model)


def test_the_flags_parse_into_the_settings():
    from slime.utils.arguments import parse_args

    args = parse_args(["--bf16", "--gradient-checkpointing", "--fsdp", "--num-rollout", "1"])
    from slime.plugins.torch_settings import TrainSettings

    settings = TrainSettings.from_args(args)
    assert (settings.bf16, settings.gradient_checkpointing, settings.fsdp) == (True, True, True)
    defaults = TrainSettings.from_args(types.SimpleNamespace())
    assert (defaults.bf16, defaults.gradient_checkpointing, defaults.fsdp) == (False, False, False)


# ------------------------------------------------------------ two ranks


def _shard(rank: int) -> dict:
    """Eight samples over two ranks in two optimizer steps of four: the first accumulates two micro batches, of
    which rank 1's second is empty (it must still take part in FSDP's all-gathers and reduce-scatter)."""
    full = make_batch(8)
    partition = [[0, 1, 2, 3, 4], [5, 6, 7]][rank]
    shard = {key: [full[key][i] for i in partition] for key in ("tokens", "response_lengths", "loss_masks", "rewards")}
    shard.update(partition=partition, global_batch_sizes=[4, 4], num_microbatches=[2, 1])
    shard["micro_batch_indices"] = [[[0, 1], [2], [3, 4]], [[0], [], [1, 2]]][rank]
    return shard


def _run(actor: TorchTrainRayActor, rank: int, steps: range, save_at: int | None = None) -> dict:
    history = []
    for step in steps:
        history.append(actor.train_from_data(step, _shard(rank)))
        if step == save_at:
            actor.save_model(step)
    return {"losses": losses(history), "grad_norms": [m["train/grad_norm"] for m in history]}


def _two_rank_worker(rank: int, port: int, hf: str, out: str) -> None:
    torch.set_num_threads(1)
    out_dir = Path(out)

    def actor(name: str, **overrides) -> TorchTrainRayActor:
        # A KL loss: the reference model is sharded too and its forwards are collectives as well.
        args = make_args(Path(hf), out_dir / name, use_kl_loss=True, kl_loss_coef=0.05, **overrides)
        instance = TorchTrainRayActor(world_size=2, rank=rank, master_addr="127.0.0.1", master_port=port)
        instance.init(args, "actor")
        return instance

    results = {}
    ddp = actor("ddp")
    results["ddp"] = _run(ddp, rank, range(4), save_at=1)
    results["ddp"]["params"] = full_params(ddp)
    del ddp
    ddp_gc = actor("ddp-gc", gradient_checkpointing=True)
    results["ddp_gc"] = _run(ddp_gc, rank, range(2))
    del ddp_gc
    fsdp = actor("fsdp", fsdp=True)
    results["fsdp"] = _run(fsdp, rank, range(4), save_at=1)
    results["fsdp"]["params"] = full_params(fsdp)
    fsdp.update_weights(WeightUpdate(4, "disk", disk_dir=str(out_dir / "weights" / "weight_v000004")))
    del fsdp
    resumed = actor("fsdp-resumed", fsdp=True, load=str(out_dir / "fsdp"))
    results["resumed_start"] = resumed.global_step
    results["resumed"] = _run(resumed, rank, range(2, 4))
    results["resumed"]["params"] = full_params(resumed)
    del resumed
    from_ddp = actor("from-ddp", fsdp=True, load=str(out_dir / "ddp"))  # another layout, the same files
    results["from_ddp"] = _run(from_ddp, rank, range(2, 4))
    del from_ddp
    fast = actor("bf16-gc", fsdp=True, bf16=True, gradient_checkpointing=True)
    results["bf16_gc"] = _run(fast, rank, range(2))
    del fast
    # PPO's critic on two DDP ranks: its whitening and its value loss span both shards.
    critic = TorchTrainRayActor(world_size=2, rank=rank, master_addr="127.0.0.1", master_port=port)
    critic.init(critic_arguments(make_args(Path(hf), out_dir / "critic", use_critic=True)), "critic")
    results["critic"] = [critic.train_from_data(step, _shard(rank)) for step in range(2)]
    torch.save(results, out_dir / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(hf_dir, tmp_path_factory) -> tuple[dict, Path]:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("two-ranks")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_two_rank_worker, args=(port, str(hf_dir), str(out)), nprocs=2, join=True)
    return torch.load(out / "rank0.pt", weights_only=True), out


@pytest.mark.slow
def test_fsdp_on_two_ranks_equals_ddp(two_ranks):
    results, _ = two_ranks
    ddp, fsdp = results["ddp"], results["fsdp"]
    assert max(abs(a - b) for a, b in zip(fsdp["losses"], ddp["losses"], strict=True)) < EXACT
    assert max(abs(a - b) for a, b in zip(fsdp["grad_norms"], ddp["grad_norms"], strict=True)) < EXACT
    assert max_diff(fsdp["params"], ddp["params"]) < EXACT
    assert fsdp["losses"][-1] < fsdp["losses"][0]


@pytest.mark.slow
def test_fsdp_resumes_exactly_from_its_checkpoint_and_from_ddps(two_ranks):
    results, _ = two_ranks
    assert results["resumed_start"] == 4  # two rollout steps of two optimizer steps, restored with the schedule
    uninterrupted = results["fsdp"]
    assert results["resumed"]["losses"] == uninterrupted["losses"][2:]
    assert results["resumed"]["grad_norms"] == uninterrupted["grad_norms"][2:]
    assert max_diff(results["resumed"]["params"], uninterrupted["params"]) == 0.0
    # The optimizer state is saved by parameter name, whole: a DDP checkpoint resumes under FSDP.
    from_ddp = zip(results["from_ddp"]["losses"], results["ddp"]["losses"][2:], strict=True)
    assert max(abs(a - b) for a, b in from_ddp) < EXACT


@pytest.mark.slow
def test_fsdp_checkpoints_and_exports_load_with_from_pretrained(two_ranks):
    from transformers import AutoModelForCausalLM

    results, out = two_ranks
    directory = ckpt.iter_dir(out / "fsdp", 1)
    names = {p.name for p in directory.iterdir()}
    assert {"config.json", "model.safetensors", ckpt.OPTIMIZER_FILE, ckpt.SCHEDULER_FILE} <= names
    assert {"rng_state_rank0.pt", "rng_state_rank1.pt"} <= names
    assert (out / "fsdp" / ckpt.TRACKER_FILE).read_text() == "1"
    # The same files as DDP writes: one tensor for the tied embeddings, float32.
    ddp_files = ckpt.iter_dir(out / "ddp", 1) / "model.safetensors"
    with safe_open(str(directory / "model.safetensors"), "pt") as a, safe_open(str(ddp_files), "pt") as b:
        assert set(a.keys()) == set(b.keys()) and "lm_head.weight" not in set(a.keys())
        assert {a.get_slice(k).get_dtype() for k in a.keys()} == {"F32"}
    optimizer = torch.load(directory / ckpt.OPTIMIZER_FILE, weights_only=True)
    assert all(isinstance(name, str) for name in optimizer["state"])  # by parameter name, not position
    loaded = AutoModelForCausalLM.from_pretrained(directory)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight or loaded.config.tie_word_embeddings
    export = AutoModelForCausalLM.from_pretrained(out / "weights" / "weight_v000004")
    state = export.state_dict()
    assert max_diff({k: state[k] for k in results["fsdp"]["params"]}, results["fsdp"]["params"]) == 0.0
    assert json.loads((out / "weights" / "weight_v000004" / "config.json").read_text())["model_type"]


@pytest.mark.slow
def test_gradient_checkpointing_under_ddp_and_fsdp(two_ranks):
    results, _ = two_ranks
    for got, want in zip(results["ddp_gc"]["losses"], results["ddp"]["losses"][:2], strict=True):
        assert abs(got - want) < EXACT
    for got, want in zip(results["ddp_gc"]["grad_norms"], results["ddp"]["grad_norms"][:2], strict=True):
        assert abs(got - want) < EXACT
    # FSDP with bf16 and gradient checkpointing together: trains, close to FSDP in float32.
    got, want = results["bf16_gc"]["losses"], results["fsdp"]["losses"][:2]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < BF16_LOSS_TOLERANCE, (got, want)
    assert all(math.isfinite(n) and n > 0 for n in results["bf16_gc"]["grad_norms"])


@pytest.mark.slow
def test_two_critic_ranks_give_the_advantages_and_losses_of_one(two_ranks, hf_dir, tmp_path):
    _, out = two_ranks
    ranks = [torch.load(out / f"rank{rank}.pt", weights_only=True)["critic"] for rank in (0, 1)]
    single = TorchTrainRayActor(world_size=1, rank=0)
    single.init(critic_arguments(make_args(hf_dir, tmp_path, use_critic=True)), "critic")
    full = make_batch(8)
    # The two ranks' optimizer steps as one rank's: samples 0, 1, 2 and 5, then 3, 4, 6 and 7 (see `_shard`).
    full.update(partition=list(range(8)), global_batch_sizes=[4, 4], num_microbatches=[1, 1])
    full["micro_batch_indices"] = [[0, 1, 2, 5], [3, 4, 6, 7]]
    for step in range(2):
        one = single.train_from_data(step, full)
        by_sample = dict(zip(one["partition"], one["advantages"], strict=True))
        assert sorted(p for result in ranks for p in result[step]["partition"]) == list(range(8))
        for result in ranks:
            for position, advantages in zip(result[step]["partition"], result[step]["advantages"], strict=True):
                assert advantages == pytest.approx(by_sample[position], abs=1e-5), (step, position)
            assert result[step]["critic/value_loss"] == pytest.approx(one["critic/value_loss"], rel=1e-5)
