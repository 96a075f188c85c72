"""The built-in torch training backend: one data-parallel rank of a GRPO/PPO-style policy trainer.

`TorchTrainRayActor` is a plain class. `RayTrainGroup` wraps it with `ray.remote(...)` (with the CPUs or
GPUs it allots) at the point of use, so tests and tools can also drive it in-process. It trains a
Hugging Face causal LM (`--hf-checkpoint`, default the built-in tiny model) on CPU, or on the GPU of its
`LOCAL_RANK` when CUDA is present. With `WORLD_SIZE > 1` (the group sets `MASTER_ADDR`, `MASTER_PORT`,
`RANK`, `WORLD_SIZE` in each actor's environment, or passes them to the constructor) the model is wrapped
in `DistributedDataParallel` over gloo (NCCL on GPU), or, with `--fsdp`, sharded with FSDP2; `--bf16` runs the
forward passes under bfloat16 autocast (`--fp16`: float16, with loss scaling) and `--gradient-checkpointing`
recomputes activations in the backward pass. How the models are wrapped and run is
`slime.plugins.torch_parallel`'s job. `init` reads the run's arguments once, into a validated
`slime.plugins.torch_settings.TrainSettings`; nothing else reads them.

One `train` call is one rollout step: the rank loads its shard (`process_rollout_data`), computes the
old-policy (and, with a KL loss or `--kl-coef`, reference) log-probs of the response tokens, then takes one AdamW step
per global batch of the schedule, accumulating gradients over its micro batches. Checkpoints and disk
weight exports (float32 Hugging Face files, also under `--bf16` and `--fsdp`: rank 0 writes the full state every
rank helps gather) are made durable before they become visible (see `slime.plugins.torch_checkpoint`); with
`--update-weight-transport distributed` or `tensor`, rank 0 sends the weights itself (`slime.weight_sync`).

With `--use-critic` a second group of these ranks, role "critic", trains PPO's value model
(`slime.plugins.torch_critic`): its `train` fits the values and returns the GAE advantages of its shard, which the
policy rank of the same index receives as `external_data` and trains on. The critic's group gets `--save` and
`--load` under `critic/` from the framework, and saves there as the policy saves under `--save`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slime import hookimpl
from slime.plugins import torch_checkpoint as ckpt
from slime.plugins import torch_critic, torch_lora
from slime.plugins.rl_losses import (
    METRIC_NAMES,
    kl_shaped_advantages,
    masked_mean,
    pad_right,
    rl_loss,
    token_log_probs_and_entropy,
)
from slime.plugins.torch_optim import build_optimizer
from slime.plugins.torch_parallel import Parallelism
from slime.plugins.torch_settings import TrainSettings
from slime.plugins.train_batch import TrainBatch, planned_schedule, rank_and_world
from slime.specs import TrainBackendSpec
from slime.storage_errors import with_context
from slime.utils.hf_checkpoint import check_reference_vocabulary
from slime.weight_sync import WeightUpdate, send_weights

logger = logging.getLogger(__name__)


class TorchTrainRayActor:
    """One training rank (a `slime.backend_interfaces.TrainBackend`). Call `init` once, then `train`,
    `save_model` and `update_weights` as the group does.

    The constructor only records the rank; `init` loads the model. Rank and world come from the explicit
    arguments when given, else from the environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`).
    """

    def __init__(
        self,
        world_size: int | None = None,
        rank: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
    ) -> None:
        self.world_size, self.rank = rank_and_world(world_size, rank, master_addr, master_port)
        self.settings: TrainSettings | None = None
        self.model: Any = None

    # ------------------------------------------------------------------ setup

    def init(self, args: Any, role: str, with_ref: bool = False, with_opd_teacher: bool = False) -> int:
        """Load model, optimizer and (when resuming) their state; return the first rollout id to train. Role
        "critic" (`--use-critic`) trains PPO's value model instead of the policy (`slime.plugins.torch_critic`)."""
        if role not in ("actor", "critic"):
            raise ValueError(f"the torch backend trains role 'actor' or 'critic', not {role!r}")
        if with_opd_teacher:
            raise ValueError("the torch backend has no on-policy distillation teacher; choose another --train-backend")
        settings = self.settings = TrainSettings.from_args(args)
        from transformers import AutoModelForCausalLM

        self.role = role
        if settings.deterministic:
            # Before CUDA's first use: deterministic cuBLAS needs a fixed workspace (ignored on CPU).
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.device = self._select_device()
        self._init_process_group(settings)
        torch.manual_seed(settings.seed + self.rank)
        self.parallel = Parallelism(
            device=self.device,
            world_size=self.world_size,
            rank=self.rank,
            bf16=settings.bf16,
            fp16=settings.fp16,
            fsdp=settings.fsdp,
            gradient_checkpointing=settings.gradient_checkpointing,
        )

        self.critic = torch_critic.CriticSettings.from_args(args) if role == "critic" else None
        settings = self.settings = self._for_role(settings)
        load_root, step = self._checkpoint_to_load(settings)
        self.hf_source = self._hf_source(settings)
        checkpoint = ckpt.iter_dir(load_root, step) if step is not None else None
        # Under LoRA the base model always comes from --hf-checkpoint; a checkpoint holds the adapters only.
        source = checkpoint if checkpoint is not None and not settings.lora.enabled else self.hf_source
        logger.info("rank %d loads the %s from %s", self.rank, "value model" if self.critic else "policy", source)
        # Weights stay float32 under --bf16 too: they are the optimizer's master weights (torch_parallel).
        if self.critic is not None:
            self.model = torch_critic.load_value_model(source)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        if settings.lora.enabled:
            self.model = self._with_adapters(self.model, checkpoint)
        self.model = self.model.to(self.device)
        self.model.train()
        # What training forwards call: the DDP wrapper, or the model itself (sharded in place under --fsdp).
        self.trained = self.parallel.prepare(self.model)
        self.ref_model = None
        if self.critic is None and (with_ref or settings.loss.needs_reference):
            # The reference is --ref-load, else the policy the run started from; run in the same precision (and
            # sharded alike).
            reference = settings.ref_load or self.hf_source
            logger.info("rank %d loads the KL reference from %s", self.rank, reference)
            self.ref_model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).to(self.device)
            check_reference_vocabulary(self.model.config.vocab_size, self.ref_model.config, reference)
            self.ref_model.eval().requires_grad_(False)
            self.parallel.prepare(self.ref_model, trainable=False)
        # Built after sharding: under FSDP the optimizer holds this rank's shards (DTensors) only.
        trainable = [parameter for parameter in self.model.parameters() if parameter.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(trainable, settings.optimizer)
        self.global_step = 0
        if step is not None:
            self._load_training_state(ckpt.iter_dir(load_root, step))
            return step + 1
        return settings.start_rollout_id or 0

    def _for_role(self, settings: TrainSettings) -> TrainSettings:
        """The settings this rank trains with: the critic learns at `--critic-lr` and has no adapters and no Hugging
        Face export (those are the policy's). Where it saves is the framework's choice: its group's `args.save`
        (`slime.data.checkpoint.critic_arguments`)."""
        if self.critic is None:
            return settings
        return replace(
            settings,
            save_hf=None,
            lora=replace(settings.lora, rank=0),
            optimizer=replace(settings.optimizer, lr=self.critic.critic_lr or settings.optimizer.lr),
        )

    def _select_device(self) -> torch.device:
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            return device
        return torch.device("cpu")

    def _init_process_group(self, settings: TrainSettings) -> None:
        if dist.is_initialized() or (self.world_size == 1 and not settings.fsdp):
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.world_size == 1:
            # --fsdp on one rank: FSDP needs a process group; a one-rank group needs no rendezvous.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            return
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise RuntimeError(f"world size {self.world_size} needs {' and '.join(missing)} in the environment")
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size)

    @staticmethod
    def _hf_source(settings: TrainSettings) -> str:
        if settings.hf_checkpoint:
            return str(settings.hf_checkpoint)
        from slime.plugins.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())

    def _with_adapters(self, model: Any, checkpoint: Path | None) -> Any:
        """`--lora-rank`: `model` (the base) with LoRA adapters, fresh or, when resuming, those of `checkpoint`."""
        settings = self.settings.lora
        wrapped = torch_lora.add_adapters(model, settings, seed=self.settings.seed, base=self.hf_source)
        if checkpoint is not None:
            torch_lora.check_shape(checkpoint, wrapped)
            torch_lora.check_base(checkpoint, self.hf_source)
            torch_lora.load_adapter_weights(wrapped, checkpoint)
        return wrapped

    @staticmethod
    def _checkpoint_to_load(settings: TrainSettings) -> tuple[Path | None, int | None]:
        """`(root, step)` of the checkpoint `--load` / `--ckpt-step` select, or `(None, None)` to start fresh.

        A `--load` directory without a tracker and without `--ckpt-step` is a fresh start from
        `--hf-checkpoint` (the first run of a job whose `--load` equals its `--save`).
        """
        step = settings.ckpt_step
        if not settings.load:
            return None, None
        root = Path(settings.load)
        if step is None:
            step = ckpt.read_tracker(root)
            if step is None:
                return None, None
        directory = ckpt.iter_dir(root, int(step))
        adapters = torch_lora.is_adapter_checkpoint(directory)
        if not adapters and not (directory / "config.json").is_file():
            raise FileNotFoundError(
                f"model checkpoint {directory} is missing or incomplete (no config.json); "
                "pick an existing step with --ckpt-step or fix latest_checkpointed_iteration.txt"
            )
        if adapters and not settings.lora.enabled:
            raise ValueError(
                f"model checkpoint {directory} holds LoRA adapters; to resume it, add the LoRA flags "
                "(--lora-rank, ...) it was trained with (or use a new --save)"
            )
        if settings.lora.enabled and not adapters:
            raise ValueError(
                f"model checkpoint {directory} holds full weights; to resume it, drop --lora-rank (or use a new --save)"
            )
        return root, int(step)

    def _load_training_state(self, directory: Path) -> None:
        scheduler_state = ckpt.load_state_file(directory / ckpt.SCHEDULER_FILE)
        self.scheduler.load_state_dict(scheduler_state["scheduler"])
        self.global_step = int(scheduler_state["global_step"])
        if self.parallel.grad_scaler.is_enabled() and scheduler_state.get("grad_scaler"):
            self.parallel.grad_scaler.load_state_dict(scheduler_state["grad_scaler"])
        if not self.settings.no_load_optim:
            # Every rank reads the full state (by parameter name) and keeps its part (its shard under FSDP).
            state = ckpt.load_state_file(directory / ckpt.OPTIMIZER_FILE)
            self.parallel.load_optimizer_state(self.model, self.optimizer, state)
        if not self.settings.no_load_rng:
            ckpt.restore_rng_state(ckpt.load_state_file(directory / ckpt.rng_file(self.rank)))

    # --------------------------------------------------------------- training

    def train(
        self, rollout_id: int, rollout_data_ref: Sequence[Any], external_data: Sequence[Any] | None = None
    ) -> dict[str, Any]:
        """Train on this rank's shard of one rollout step (`rollout_data_ref`: one reference per rank). With
        `--use-critic` the policy's ranks get `external_data`, the critic ranks' results (Ray references), and
        train on the advantages of the critic rank of their own index."""
        from slime.utils.data import process_rollout_data

        started = time.perf_counter()
        data = process_rollout_data(rollout_data_ref, self.rank, self.world_size)
        loaded = time.perf_counter() - started
        critic_metrics: dict[str, float] = {}
        if external_data is not None:
            import ray

            if len(external_data) != self.world_size:
                raise ValueError(
                    f"{len(external_data)} critic ranks for {self.world_size} policy ranks: with --use-critic give "
                    "the critic as many ranks as the actor (--critic-num-nodes, --critic-num-gpus-per-node)"
                )
            result = external_data[self.rank]
            result = ray.get(result) if isinstance(result, ray.ObjectRef) else result
            advantages, critic_metrics = torch_critic.critic_advantages(result, data["partition"], self.rank)
            data[torch_critic.ADVANTAGES_KEY] = advantages
        metrics = self.train_from_data(rollout_id, data)
        # Reading the shard through the transport: part of perf/train_time, shown apart in the breakdown.
        metrics["perf/train_data_load_time"] = loaded
        return {**metrics, **critic_metrics}

    def train_from_data(self, rollout_id: int, data: dict[str, Any]) -> dict[str, Any]:
        """One rollout step on an already loaded shard (the dict `process_rollout_data` returns)."""
        if self.critic is not None:
            return self._train_critic(data)
        batch = TrainBatch.from_data(data)
        schedule = self._schedule(data, len(batch))
        advantages = batch.advantages(data)
        micro_batches = [mb for step in schedule for mb in step[1]]
        old_log_probs = self._old_log_probs(data, batch, micro_batches)
        ref_log_probs = self._frozen_log_probs(self.ref_model, batch, micro_batches) if self.ref_model else None
        loss = self.settings.loss
        kl_reward = None
        if loss.kl_reward_coef:
            advantages, penalties = kl_shaped_advantages(
                advantages, old_log_probs, ref_log_probs, batch.loss_masks, loss
            )
            kl_reward = self._all_reduce(torch.tensor([sum(penalties), len(penalties)], dtype=torch.float64))
        rollout_log_probs = batch.rollout_log_probs(data) if loss.use_tis and "rollout_log_probs" in data else None

        def micro_batch_loss(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            log_probs, mask, entropy = self._log_probs(self.trained, batch, indices)
            ref = rollout = None
            if ref_log_probs is not None:
                ref = pad_right([ref_log_probs[i] for i in indices]).to(self.device)
            if rollout_log_probs is not None:
                rollout = pad_right([rollout_log_probs[i] for i in indices]).to(self.device)
            return rl_loss(
                log_probs,
                old_log_probs=pad_right([old_log_probs[i] for i in indices]).to(self.device),
                advantages=pad_right([advantages[i] for i in indices]).to(self.device),
                mask=mask,
                settings=loss,
                entropy=entropy,
                ref_log_probs=ref,
                rollout_log_probs=rollout,
            )

        def has_signal(micro_batches: list[list[int]]) -> bool:
            # Every advantage 0 (all its prompt groups answered alike) and no other loss term: the gradient would
            # be 0, and an AdamW step on it would only move the weights along stale momentum.
            return not loss.needs_advantages or self._has_signal(batch, advantages, micro_batches)

        sums = torch.zeros(len(METRIC_NAMES) + 1, dtype=torch.float64)
        grad_norms, skipped = self._optimizer_steps(batch, schedule, micro_batch_loss, sums, has_signal)
        sums = self._all_reduce(sums)
        count = max(float(sums[-1]), 1.0)
        metrics = {
            f"train/{name}": float(sums[k]) / count for k, name in enumerate(METRIC_NAMES) if name in loss.metric_names
        }
        metrics["train/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        metrics["train/lr"] = float(self.scheduler.get_last_lr()[0])
        metrics["train/steps"] = float(len(schedule) - skipped)
        metrics["train/skipped_steps"] = float(skipped)
        metrics["train/rollout_id"] = float(rollout_id)
        if kl_reward is not None:
            metrics["train/kl_reward"] = float(kl_reward[0]) / max(float(kl_reward[1]), 1.0)
        if (mismatch := self._rollout_log_prob_mismatch(data, batch, old_log_probs)) is not None:
            metrics["train/rollout_logprob_abs_diff"] = mismatch
        return metrics

    def _optimizer_steps(
        self,
        batch: TrainBatch,
        schedule: list[tuple[int, list[list[int]]]],
        micro_batch_loss: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]],
        sums: torch.Tensor,
        has_signal: Callable[[list[list[int]]], bool] | None = None,
    ) -> tuple[list[float], int]:
        """One optimizer step per entry of `schedule` (skipped when `has_signal` says it has none), accumulating
        `micro_batch_loss(indices) -> (sample_loss, metrics [k, batch])` over its micro batches; adds the metrics'
        sums and the sample count to `sums` (`[k + 1]`). Returns the steps' gradient norms and the skipped count."""
        clip_grad = self.settings.optimizer.clip_grad
        scaler = self.parallel.grad_scaler
        grad_norms: list[float] = []
        skipped = 0
        for global_size, step_micro_batches in schedule:
            if has_signal is not None and not has_signal(step_micro_batches):
                skipped += 1
                continue
            self.optimizer.zero_grad(set_to_none=True)
            denominator = self._loss_denominator(batch, step_micro_batches, global_size)
            for position, indices in enumerate(step_micro_batches):
                # Gradients reduce over the ranks once per optimizer step, in the last micro batch's backward.
                with self.parallel.gradient_sync(self.trained, position == len(step_micro_batches) - 1):
                    if not indices:
                        # Keeps the collectives (DDP's all-reduce; FSDP's all-gathers and reduce-scatter) in step
                        # with ranks that do have samples here.
                        scaler.scale(self.parallel.dummy_loss(self.trained)).backward()
                        continue
                    sample_loss, sample_metrics = micro_batch_loss(indices)
                    # Summed over the global batch and divided by its samples or tokens; DDP and FSDP average over
                    # ranks, which the world size undoes.
                    scaler.scale(sample_loss.sum() * (self.world_size / denominator)).backward()
                    sums[:-1] += sample_metrics.sum(dim=1).double().cpu()
                    sums[-1] += len(indices)
            params = [p for p in self.model.parameters() if p.grad is not None]
            grad_norm = self.parallel.optimizer_step(self.optimizer, params, clip_grad)
            if grad_norm is None:  # --fp16: the scaled gradients overflowed; the optimizer did not step
                skipped += 1
                continue
            grad_norms.append(grad_norm)
            self.scheduler.step()
            self.global_step += 1
        return grad_norms, skipped

    def _train_critic(self, data: dict[str, Any]) -> dict[str, Any]:
        """The critic's step (`slime.plugins.torch_critic`): old values, GAE advantages and returns from the
        shard's rewards, whitened over every rank's counted tokens, then the clipped value loss on the schedule.
        Returns the `critic/*` metrics, the shard's sample positions and their advantages (for the actor)."""
        batch = TrainBatch.from_data(data)
        schedule = self._schedule(data, len(batch))
        micro_batches = [mb for step in schedule for mb in step[1]]
        if "rewards" not in data:
            raise ValueError("training data has no 'rewards' for the critic's returns")
        rewards = [float(value) for value in data["rewards"]]
        old_values = self._frozen_values(batch, micro_batches)
        gamma, lambd = self.critic.gamma, self.critic.lambd
        estimates = [
            torch_critic.gae(reward, values, mask, gamma, lambd)
            for reward, values, mask in zip(rewards, old_values, batch.loss_masks, strict=True)
        ]
        returns = [estimate[1] for estimate in estimates]
        advantages = torch_critic.whiten([estimate[0] for estimate in estimates], batch.loss_masks, self._all_reduce)

        def micro_batch_loss(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            values, mask = self._values(self.trained, batch, indices)
            old = pad_right([old_values[i] for i in indices]).to(self.device)
            token_loss, clipped = torch_critic.value_loss(
                values, old, pad_right([returns[i] for i in indices]).to(self.device), mask, self.critic.value_clip
            )
            sample_loss = self.settings.loss.reduce_tokens(token_loss, mask)
            # Per sample, its masked mean of: the value loss, the clipped fraction, the predicted values.
            metrics = torch.stack([masked_mean(v.detach().float(), mask) for v in (token_loss, clipped, values)])
            return sample_loss, metrics

        sums = torch.zeros(4, dtype=torch.float64)
        grad_norms, skipped = self._optimizer_steps(batch, schedule, micro_batch_loss, sums)
        sums = self._all_reduce(sums)
        count = max(float(sums[-1]), 1.0)
        return {
            "critic/value_loss": float(sums[0]) / count,
            "critic/value_clipfrac": float(sums[1]) / count,
            "critic/values": float(sums[2]) / count,
            "critic/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "critic/lr": float(self.scheduler.get_last_lr()[0]),
            "critic/skipped_steps": float(skipped),
            torch_critic.PARTITION_KEY: [int(i) for i in data["partition"]],
            torch_critic.ADVANTAGES_KEY: [advantage.tolist() for advantage in advantages],
        }

    def _rollout_log_prob_mismatch(
        self, data: dict[str, Any], batch: TrainBatch, old_log_probs: list[torch.Tensor]
    ) -> float | None:
        """Mean |engine log-prob - trainer log-prob| over response tokens, across ranks: near 0 when the
        engines generated with the weights being trained (same model, same precision); None when the engines
        sent no log-probs or they are the old log-probs themselves (`--use-rollout-logprobs`)."""
        if self.settings.use_rollout_logprobs or "rollout_log_probs" not in data:
            return None
        total = torch.zeros(2, dtype=torch.float64)
        for engine, trainer in zip(batch.rollout_log_probs(data), old_log_probs, strict=True):
            total[0] += (engine - trainer).abs().sum().item()
            total[1] += engine.numel()
        total = self._all_reduce(total)
        return float(total[0] / total[1]) if total[1] > 0 else None

    def _loss_denominator(self, batch: TrainBatch, micro_batches: list[list[int]], global_size: int) -> float:
        """What an optimizer step's summed sample losses divide by: the global batch's sample count, or with
        `--loss-agg-mode token-mean` its count of tokens in the loss mask, over every rank (collective then)."""
        if not self.settings.loss.per_token_denominator:
            return float(global_size)
        local = sum(int(batch.loss_masks[i].sum()) for indices in micro_batches for i in indices)
        return max(float(self._all_reduce(torch.tensor([float(local)], dtype=torch.float64)).item()), 1.0)

    def _has_signal(self, batch: TrainBatch, advantages: list[torch.Tensor], micro_batches: list[list[int]]) -> bool:
        """Collective: whether any rank's samples in this optimizer step have a non-zero advantage on a token
        the loss counts."""
        return not self._all_ok(not batch.has_signal(advantages, micro_batches))

    def _schedule(self, data: dict[str, Any], n_local: int) -> list[tuple[int, list[list[int]]]]:
        """`[(global_batch_size, [micro batch indices, ...]), ...]`, one entry per optimizer step.

        From the data's schedule (`global_batch_sizes`, `num_microbatches`, `micro_batch_indices`) when the
        batch builder planned one; otherwise one step over the whole rollout in `--micro-batch-size` chunks,
        with every rank running as many micro batches as the busiest one.
        """
        planned = planned_schedule(data)
        if planned is not None:
            return planned
        size = self.settings.micro_batch_size
        chunks = [list(range(i, min(i + size, n_local))) for i in range(0, n_local, size)]
        stats = self._all_reduce(torch.tensor([float(n_local)], dtype=torch.float64))
        count = int(self._all_reduce(torch.tensor([float(len(chunks))]), op=dist.ReduceOp.MAX).item())
        chunks += [[] for _ in range(count - len(chunks))]
        return [(int(stats.item()), chunks)]

    def _old_log_probs(
        self, data: dict[str, Any], batch: TrainBatch, micro_batches: list[list[int]]
    ) -> list[torch.Tensor]:
        if self.settings.use_rollout_logprobs and "rollout_log_probs" in data:
            return batch.rollout_log_probs(data)
        return self._frozen_log_probs(self.model, batch, micro_batches)

    def _frozen_log_probs(self, model: Any, batch: TrainBatch, micro_batches: list[list[int]]) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(batch)
        with torch.no_grad():
            for indices in micro_batches:
                if not indices:
                    if self.parallel.collective_forward:
                        self.parallel.dummy_loss(model)  # the other ranks' all-gathers wait for this one's
                    continue
                log_probs, _, _ = self._log_probs(model, batch, indices)
                for row, i in enumerate(indices):
                    out[i] = log_probs[row, : batch.response_lengths[i]].cpu()
        missing = [i for i, value in enumerate(out) if value is None]
        if missing:
            raise ValueError(f"samples {missing[:8]} of this rank's shard are in no micro batch of the schedule")
        return out  # type: ignore[return-value]

    def _log_probs(
        self, model: Any, batch: TrainBatch, indices: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Response-token log-probs `[B, R_max]`, the loss mask and the response positions' entropy for samples
        `indices` (right padded).

        No attention mask is needed: padding sits after every real token, and causal attention keeps
        it from influencing them.
        """
        tokens = pad_right([batch.tokens[i] for i in indices], dtype=torch.long).to(self.device)
        logits = self.parallel.logits(model, tokens)
        all_log_probs, all_entropy = token_log_probs_and_entropy(logits[:, :-1], tokens[:, 1:])
        mask = pad_right([batch.loss_masks[i] for i in indices]).to(self.device)
        return self._responses(all_log_probs, batch, indices), mask, self._responses(all_entropy, batch, indices)

    def _values(self, model: Any, batch: TrainBatch, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The value model's estimate for each response token's state `[B, R_max]` (the position whose logits
        would predict the token, as for log-probs) and the loss mask, for samples `indices` (right padded)."""
        tokens = pad_right([batch.tokens[i] for i in indices], dtype=torch.long).to(self.device)
        values = self.parallel.logits(model, tokens).squeeze(-1).float()
        mask = pad_right([batch.loss_masks[i] for i in indices]).to(self.device)
        return self._responses(values[:, :-1], batch, indices), mask

    def _frozen_values(self, batch: TrainBatch, micro_batches: list[list[int]]) -> list[torch.Tensor]:
        """Each sample's response-token values before the step (no gradient), on the CPU."""
        out: list[torch.Tensor] = [torch.zeros(0)] * len(batch)
        with torch.no_grad():
            for indices in micro_batches:
                if not indices:
                    if self.parallel.collective_forward:
                        self.parallel.dummy_loss(self.trained)  # the other ranks' all-gathers wait for this one's
                    continue
                values, _ = self._values(self.trained, batch, indices)
                for row, i in enumerate(indices):
                    out[i] = values[row, : batch.response_lengths[i]].cpu()
        return out

    @staticmethod
    def _responses(values: torch.Tensor, batch: TrainBatch, indices: list[int]) -> torch.Tensor:
        """The response positions of `values` (`[B, T - 1]`, position p scoring token p + 1), right padded."""
        width = max(batch.response_lengths[i] for i in indices)
        rows = []
        for row, i in enumerate(indices):
            total, response = batch.total_lengths[i], batch.response_lengths[i]
            rows.append(torch.nn.functional.pad(values[row, total - response - 1 : total - 1], (0, width - response)))
        return torch.stack(rows)

    def _all_reduce(self, tensor: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        moved = tensor.to(device)
        dist.all_reduce(moved, op=op if op is not None else dist.ReduceOp.SUM)
        return moved.to(tensor.device)

    def _all_ok(self, ok: bool) -> bool:
        """Collective: True when `ok` holds on every rank (every rank must call it at the same point)."""
        return bool(self._all_reduce(torch.tensor([1.0 if ok else 0.0]), op=dist.ReduceOp.MIN).item() == 1.0)

    # ------------------------------------------------------------ checkpoints

    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        """Write `<save>/iter_<rollout_id:07d>/` atomically, then the tracker, then with `--save-hf` its Hugging Face
        part to that directory (`force_sync`: saves are always synchronous here; the argument is accepted for the
        group's calling convention)."""
        if not self.settings.save:
            raise ValueError("save_model needs --save (the checkpoint directory)")
        root = Path(self.settings.save)
        staging = ckpt.partial_dir(root, rollout_id)
        error: BaseException | None = None
        if self.rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                if staging.exists():
                    shutil.rmtree(staging)
                staging.mkdir()
            except OSError as exc:
                error = exc
        if self._all_ok(error is None):
            try:
                if not self.settings.no_save_rng:
                    torch.save(ckpt.capture_rng_state(), staging / ckpt.rng_file(self.rank))
            except OSError as exc:
                error = exc
            if self._all_ok(error is None):
                try:
                    # Every rank takes part in gathering the full states (collectives under FSDP); rank 0 writes.
                    # Under LoRA the checkpoint holds the adapters, which rank 0 reads from its own replica.
                    model_state = {} if self.settings.lora.enabled else self.parallel.full_model_state(self.model)
                    optimizer_state = None
                    if not self.settings.no_save_optim:
                        optimizer_state = self.parallel.optimizer_state(self.model, self.optimizer)
                    if self.rank == 0:
                        self._write_rank0_checkpoint(root, staging, rollout_id, model_state, optimizer_state)
                except BaseException as exc:
                    error = exc
        storage_error = None
        if self.rank == 0 and error is not None:
            # A full or read-only filesystem, named before the cleanup frees space (torch's writer hides the errno).
            storage_error = with_context(error, ckpt.iter_dir(root, rollout_id), "saving the model checkpoint")
            shutil.rmtree(staging, ignore_errors=True)
        if not self._all_ok(error is None):
            if storage_error is not None:
                raise storage_error from error
            if error is not None:
                raise RuntimeError(f"saving {ckpt.iter_dir(root, rollout_id)} failed: {error}") from error
            raise RuntimeError(f"saving {ckpt.iter_dir(root, rollout_id)} failed on another rank")
        if self.settings.save_hf:
            self._save_hf(ckpt.iter_dir(root, rollout_id), rollout_id)

    def _save_hf(self, checkpoint: Path, rollout_id: int) -> None:
        """`--save-hf`: rank 0 copies the Hugging Face part of the just published `checkpoint` (the weights as
        saved, no second serialization) to the flag's path, `{rollout_id}` replaced, replacing an older directory
        of that name atomically. Collective, so that every rank raises when it fails."""
        target = Path(str(self.settings.save_hf).replace("{rollout_id}", str(rollout_id)))
        lora = self.settings.lora
        error: BaseException | None = None
        if self.rank == 0:
            try:
                if lora.enabled and lora.save_hf == "merged":
                    self._export_weights(target, torch_lora.merged_state(self.model))
                else:
                    ckpt.export_hf_dir(checkpoint, target, replace=True)
            except BaseException as exc:
                error = exc
        if not self._all_ok(error is None):
            operation = "writing the --save-hf copy of the checkpoint"
            if error is not None and (storage_error := with_context(error, target, operation, probe=False)):
                raise storage_error from error
            raise RuntimeError(f"--save-hf: writing {target} failed: {error or 'on another rank'}") from error

    def _write_rank0_checkpoint(
        self,
        root: Path,
        staging: Path,
        rollout_id: int,
        model_state: dict[str, torch.Tensor],
        optimizer_state: dict[str, Any] | None,
    ) -> None:
        """The Hugging Face files (float32 weights, and the tokenizer files of `--hf-checkpoint`), the full
        optimizer state by parameter name (the same file whatever the world size and with or without --fsdp, see
        `slime.plugins.torch_parallel`) and the schedule."""
        if self.settings.lora.enabled:
            torch_lora.write_adapter(self.model, staging)
        else:
            self.model.save_pretrained(staging, state_dict=model_state, safe_serialization=True)
        ckpt.copy_hf_side_files(self.hf_source, staging)
        if optimizer_state is not None:
            torch.save(optimizer_state, staging / ckpt.OPTIMIZER_FILE)
        torch.save(
            {
                "scheduler": self.scheduler.state_dict(),
                "global_step": self.global_step,
                "grad_scaler": self.parallel.grad_scaler.state_dict(),  # {} without --fp16
            },
            staging / ckpt.SCHEDULER_FILE,
        )
        ckpt.publish_dir(staging, ckpt.iter_dir(root, rollout_id))
        ckpt.write_text_atomic(root / ckpt.TRACKER_FILE, str(rollout_id))

    # ---------------------------------------------------------- weight update

    def update_weights(self, update: WeightUpdate) -> None:
        """Bring the engines to the current weights as `update.version`: every rank helps gather the full state dict
        (under FSDP; DDP keeps every rank's weights equal), rank 0 does the rest while the others wait: transport
        "disk" exports to `update.disk_dir`, which appears complete or not at all (the group then has the engines
        load it); "distributed" and "tensor" send the state dict, Hugging Face names as `save_pretrained` writes
        them, to the paused engines."""
        if update.transport != "disk" and not update.engine_urls:
            return  # no engines to send to (the same on every rank): nothing to gather
        error: BaseException | None = None
        try:
            state = self._served_state()
            if self.rank == 0:
                if update.transport == "disk":
                    self._export_weights(Path(str(update.disk_dir)), state)
                else:
                    send_weights(update, state.items())
        except BaseException as exc:
            error = exc
        if not self._all_ok(error is None):
            where = update.disk_dir if update.transport == "disk" else ", ".join(update.engine_urls)
            if update.transport == "disk" and error is not None:
                operation = "exporting the new weights for the engines"
                if (storage_error := with_context(error, str(where), operation, probe=False)) is not None:
                    raise storage_error from error
            raise RuntimeError(
                f"weight update {update.version} ({update.transport}) to {where} failed: {error or 'on another rank'}"
            ) from error

    def _served_state(self) -> dict[str, torch.Tensor]:
        """The weights the engines serve, Hugging Face names, on rank 0 (`{}` elsewhere; a collective under FSDP):
        the model's, or under LoRA the base weights with the adapters merged in."""
        if self.settings.lora.enabled:
            return torch_lora.merged_state(self.model) if self.rank == 0 else {}
        return self.parallel.full_model_state(self.model)

    def _export_weights(self, target: Path, state: dict[str, torch.Tensor]) -> None:
        """Write the model's full `state` (float32, and the tokenizer files of its source) to `target` through a
        staging directory."""
        ckpt.write_hf_model(torch_lora.hf_model(self.model), state, target, [self.hf_source], replace=True)


@hookimpl
def slime_train_backends() -> Iterable[TrainBackendSpec]:
    return [
        TrainBackendSpec(
            "torch",
            TorchTrainRayActor,
            "PyTorch policy trainer (HF causal LM, AdamW, GRPO/PPO clipped loss, DDP or FSDP2 over gloo/NCCL, "
            "--bf16/--fp16 autocast); CPU or one GPU per rank; plain class, wrapped with ray.remote by RayTrainGroup",
            deterministic=TrainSettings.from_args,
        )
    ]


@hookimpl
def slime_addoption(parser) -> None:
    group = parser.add_argument_group(
        "torch backend", "--train-backend torch: how each rank holds and runs the model (see also --bf16)."
    )
    group.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each decoder layer's activations in the backward pass instead of keeping them (Hugging "
        "Face gradient checkpointing, non-reentrant): less memory for about one more forward pass per step",
    )
    group.add_argument(
        "--fsdp",
        action="store_true",
        help="shard weights, gradients and optimizer state over the training ranks with FSDP2 (per decoder layer, "
        "then the whole model; gloo on CPU, NCCL on GPU) instead of replicating them with DDP",
    )
    torch_lora.add_options(parser)
    torch_critic.add_options(parser)


@hookimpl
def slime_configure(args: Any) -> None:
    """Refuse, while the arguments are parsed, LoRA flags this run cannot use (`slime.plugins.torch_lora`) and
    precision flags it cannot combine."""
    torch_lora.check_args(args)
    torch_critic.check_args(args)
    if (
        getattr(args, "train_backend", "torch") == "torch"
        and getattr(args, "fp16", False)
        and getattr(args, "fsdp", False)
    ):
        raise ValueError(
            "--fp16 with --fsdp is not supported (loss scaling over FSDP2's sharded gradients is not implemented); "
            "use --bf16 with --fsdp, which needs no loss scaling"
        )
