"""The built-in torch training backend: one data-parallel rank of a GRPO/PPO-style policy trainer.

`TorchTrainRayActor` is a plain class. `RayTrainGroup` wraps it with `ray.remote(...)` (with the CPUs or
GPUs it allots) at the point of use, so tests and tools can also drive it in-process. It trains a
Hugging Face causal LM (`--hf-checkpoint`, default the built-in tiny model) on CPU, or on the GPU of its
`LOCAL_RANK` when CUDA is present. With `WORLD_SIZE > 1` (the group sets `MASTER_ADDR`, `MASTER_PORT`,
`RANK`, `WORLD_SIZE` in each actor's environment, or passes them to the constructor) the model is wrapped
in `DistributedDataParallel` over gloo (NCCL on GPU). `init` reads the run's arguments once, into a
validated `slime.plugins.torch_settings.TrainSettings`; nothing else reads them.

One `train` call is one rollout step: the rank loads its shard (`process_rollout_data`), computes the
old-policy (and, with `--kl-coef`, reference) log-probs of the response tokens, then takes one AdamW step
per global batch of the schedule, accumulating gradients over its micro batches. Checkpoints and disk
weight exports are made durable before they become visible (see `slime.plugins.torch_checkpoint`); with
`--update-weight-transport distributed` or `tensor`, rank 0 sends the weights itself (`slime.weight_sync`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slime import hookimpl
from slime.plugins import torch_checkpoint as ckpt
from slime.plugins.torch_losses import (
    KL_ESTIMATORS,
    kl_penalty,
    masked_mean,
    pad_right,
    policy_loss,
    token_log_probs_and_entropy,
)
from slime.plugins.torch_optim import add_optimizer_options, build_optimizer
from slime.plugins.torch_settings import TrainSettings
from slime.specs import TrainBackendSpec
from slime.weight_sync import WeightUpdate, send_weights

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
METRIC_NAMES = ("loss", "pg_loss", "kl", "clipfrac", "ppo_ratio", "entropy")


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
        self.world_size = int(world_size if world_size is not None else os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(rank if rank is not None else os.environ.get("RANK", "0"))
        if master_addr is not None:
            os.environ["MASTER_ADDR"] = master_addr
        if master_port is not None:
            os.environ["MASTER_PORT"] = str(master_port)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size} (RANK / WORLD_SIZE)")
        self.settings: TrainSettings | None = None
        self.model: Any = None

    # ------------------------------------------------------------------ setup

    def init(self, args: Any, role: str, with_ref: bool = False, with_opd_teacher: bool = False) -> int:
        """Load model, optimizer and (when resuming) their state; return the first rollout id to train."""
        if role != "actor":
            raise ValueError(f"the torch backend trains the policy only, not role {role!r}; drop --use-critic")
        if with_opd_teacher:
            raise ValueError("the torch backend has no on-policy distillation teacher; choose another --train-backend")
        settings = self.settings = TrainSettings.from_args(args)
        from transformers import AutoModelForCausalLM

        self.role = role
        self.device = self._select_device()
        self._init_process_group()
        torch.manual_seed(settings.seed + self.rank)

        load_root, step = self._checkpoint_to_load(settings)
        self.hf_source = self._hf_source(settings)
        source = ckpt.iter_dir(load_root, step) if step is not None else self.hf_source
        logger.info("rank %d loads the policy from %s", self.rank, source)
        self.model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(self.device)
        self.model.train()
        self.ref_model = None
        if with_ref or settings.loss.kl_coef != 0.0:
            # The reference is the policy the run started from.
            self.ref_model = AutoModelForCausalLM.from_pretrained(self.hf_source, dtype=torch.float32).to(self.device)
            self.ref_model.eval().requires_grad_(False)
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = DistributedDataParallel(self.model, device_ids=device_ids)
        else:
            self.ddp = None
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), settings.optimizer)
        self.global_step = 0
        if step is not None:
            self._load_training_state(ckpt.iter_dir(load_root, step))
            return step + 1
        return settings.start_rollout_id or 0

    def _select_device(self) -> torch.device:
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            return device
        return torch.device("cpu")

    def _init_process_group(self) -> None:
        if self.world_size == 1 or dist.is_initialized():
            return
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise RuntimeError(f"world size {self.world_size} needs {' and '.join(missing)} in the environment")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size)

    @staticmethod
    def _hf_source(settings: TrainSettings) -> str:
        if settings.hf_checkpoint:
            return str(settings.hf_checkpoint)
        from slime.plugins.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())

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
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(
                f"model checkpoint {directory} is missing or incomplete (no config.json); "
                "pick an existing step with --ckpt-step or fix latest_checkpointed_iteration.txt"
            )
        return root, int(step)

    def _load_training_state(self, directory: Path) -> None:
        scheduler_state = ckpt.load_state_file(directory / ckpt.SCHEDULER_FILE)
        self.scheduler.load_state_dict(scheduler_state["scheduler"])
        self.global_step = int(scheduler_state["global_step"])
        if not self.settings.no_load_optim:
            self.optimizer.load_state_dict(ckpt.load_state_file(directory / ckpt.OPTIMIZER_FILE))
        if not self.settings.no_load_rng:
            ckpt.restore_rng_state(ckpt.load_state_file(directory / ckpt.rng_file(self.rank)))

    # --------------------------------------------------------------- training

    def train(self, rollout_id: int, rollout_data_ref: Sequence[Any]) -> dict[str, float]:
        """Train on this rank's shard of one rollout step (`rollout_data_ref`: one reference per rank)."""
        from slime.utils.data import process_rollout_data

        started = time.perf_counter()
        data = process_rollout_data(rollout_data_ref, self.rank, self.world_size)
        loaded = time.perf_counter() - started
        metrics = self.train_from_data(rollout_id, data)
        # Reading the shard through the transport: part of perf/train_time, shown apart in the breakdown.
        metrics["perf/train_data_load_time"] = loaded
        return metrics

    def train_from_data(self, rollout_id: int, data: dict[str, Any]) -> dict[str, float]:
        """One rollout step on an already loaded shard (the dict `process_rollout_data` returns)."""
        batch = _Batch.from_data(data)
        schedule = self._schedule(data, len(batch))
        advantages = self._advantages(data, batch)
        micro_batches = [mb for step in schedule for mb in step[1]]
        old_log_probs = self._old_log_probs(data, batch, micro_batches)
        ref_log_probs = self._frozen_log_probs(self.ref_model, batch, micro_batches) if self.ref_model else None

        loss = self.settings.loss
        clip_grad = self.settings.optimizer.clip_grad
        sums = torch.zeros(len(METRIC_NAMES) + 1, dtype=torch.float64)
        grad_norms = []
        trained = self.ddp if self.ddp is not None else self.model
        skipped = 0
        for global_size, step_micro_batches in schedule:
            if not self._has_signal(batch, advantages, step_micro_batches):
                # Every advantage is 0 (all its prompt groups answered alike): the gradient would be 0, and an
                # AdamW step on it would only move the weights further along stale momentum.
                skipped += 1
                continue
            self.optimizer.zero_grad(set_to_none=True)
            for position, indices in enumerate(step_micro_batches):
                last = position == len(step_micro_batches) - 1
                sync = self.ddp.no_sync() if (self.ddp is not None and not last) else contextlib.nullcontext()
                with sync:
                    if not indices:
                        # Keeps DDP's gradient all-reduce in step with ranks that do have samples here.
                        trained(torch.zeros(1, 1, dtype=torch.long, device=self.device)).logits.sum().mul(0).backward()
                        continue
                    log_probs, mask, entropy = self._log_probs(trained, batch, indices)
                    old = pad_right([old_log_probs[i] for i in indices]).to(self.device)
                    adv = pad_right([advantages[i] for i in indices]).to(self.device)
                    pg_tok, clipped = policy_loss(log_probs, old, adv, loss.eps_clip, loss.eps_clip_high)
                    per_token = pg_tok
                    if ref_log_probs is not None:
                        ref = pad_right([ref_log_probs[i] for i in indices]).to(self.device)
                        kl_tok = kl_penalty(log_probs, ref, loss.kl_loss_type)
                        per_token = pg_tok + loss.kl_coef * kl_tok
                    else:
                        kl_tok = torch.zeros_like(pg_tok)
                    if loss.entropy_coef:
                        # An entropy bonus keeps sampling diverse: a policy that answers a prompt the same way
                        # eight times gives GRPO a zero-variance group and nothing to learn from.
                        per_token = per_token - loss.entropy_coef * entropy
                    sample_loss = masked_mean(per_token, mask)
                    # Per-sample mean over tokens, summed over the global batch; DDP averages over ranks.
                    (sample_loss.sum() * (self.world_size / global_size)).backward()
                    with torch.no_grad():
                        ratio = torch.exp(log_probs - old)
                        for k, values in enumerate((per_token, pg_tok, kl_tok, clipped, ratio, entropy)):
                            sums[k] += masked_mean(values, mask).sum().item()
                        sums[-1] += len(indices)
            params = [p for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, clip_grad if clip_grad > 0 else float("inf"))
            grad_norms.append(float(norm))
            self.optimizer.step()
            self.scheduler.step()
            self.global_step += 1
        sums = self._all_reduce(sums)
        count = max(float(sums[-1]), 1.0)
        metrics = {f"train/{name}": float(sums[k]) / count for k, name in enumerate(METRIC_NAMES)}
        metrics["train/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        metrics["train/lr"] = float(self.scheduler.get_last_lr()[0])
        metrics["train/steps"] = float(len(schedule) - skipped)
        metrics["train/skipped_steps"] = float(skipped)
        metrics["train/rollout_id"] = float(rollout_id)
        if (mismatch := self._rollout_log_prob_mismatch(data, batch, old_log_probs)) is not None:
            metrics["train/rollout_logprob_abs_diff"] = mismatch
        return metrics

    def _rollout_log_prob_mismatch(
        self, data: dict[str, Any], batch: _Batch, old_log_probs: list[torch.Tensor]
    ) -> float | None:
        """Mean |engine log-prob - trainer log-prob| over response tokens, across ranks: near 0 when the
        engines generated with the weights being trained (same model, same precision); None when the engines
        sent no log-probs or they are the old log-probs themselves (`--use-rollout-logprobs`)."""
        if self.settings.use_rollout_logprobs or "rollout_log_probs" not in data:
            return None
        total = torch.zeros(2, dtype=torch.float64)
        for engine, trainer in zip(_rollout_log_probs(data, batch), old_log_probs, strict=True):
            total[0] += (engine - trainer).abs().sum().item()
            total[1] += engine.numel()
        total = self._all_reduce(total)
        return float(total[0] / total[1]) if total[1] > 0 else None

    def _has_signal(self, batch: _Batch, advantages: list[torch.Tensor], micro_batches: list[list[int]]) -> bool:
        """Collective: whether any rank's samples in this optimizer step have a non-zero advantage on a token
        the loss counts."""
        local = any(
            bool((advantages[i] * batch.loss_masks[i]).ne(0).any()) for indices in micro_batches for i in indices
        )
        return not self._all_ok(not local)

    def _schedule(self, data: dict[str, Any], n_local: int) -> list[tuple[int, list[list[int]]]]:
        """`[(global_batch_size, [micro batch indices, ...]), ...]`, one entry per optimizer step.

        From the data's schedule (`global_batch_sizes`, `num_microbatches`, `micro_batch_indices`) when the
        batch builder planned one; otherwise one step over the whole rollout in `--micro-batch-size` chunks,
        with every rank running as many micro batches as the busiest one.
        """
        if "num_microbatches" in data:
            sizes = [int(x) for x in data["global_batch_sizes"]]
            counts = [int(x) for x in data["num_microbatches"]]
            flat = [[int(i) for i in mb] for mb in data["micro_batch_indices"]]
            if len(sizes) != len(counts) or sum(counts) != len(flat):
                raise ValueError(
                    f"inconsistent training schedule: {len(sizes)} global batch sizes, micro batch counts {counts}, "
                    f"{len(flat)} micro batches"
                )
            steps, start = [], 0
            for size, count in zip(sizes, counts, strict=True):
                steps.append((size, flat[start : start + count]))
                start += count
            return steps
        size = self.settings.micro_batch_size
        chunks = [list(range(i, min(i + size, n_local))) for i in range(0, n_local, size)]
        stats = self._all_reduce(torch.tensor([float(n_local)], dtype=torch.float64))
        count = int(self._all_reduce(torch.tensor([float(len(chunks))]), op=dist.ReduceOp.MAX).item())
        chunks += [[] for _ in range(count - len(chunks))]
        return [(int(stats.item()), chunks)]

    def _advantages(self, data: dict[str, Any], batch: _Batch) -> list[torch.Tensor]:
        """Per-token advantages (one 1-D tensor per sample, of its response length).

        `rewards` are used as they come: the batch builder has already centred (and, with
        `--grpo-std-normalization`, scaled) them per prompt group when `--rewards-normalization` is on.
        """
        for key in ("advantages", "returns", "rewards"):
            if key in data:
                return [batch.broadcast(i, value) for i, value in enumerate(data[key])]
        raise ValueError("training data has none of 'advantages', 'returns', 'rewards'; nothing to learn from")

    def _old_log_probs(self, data: dict[str, Any], batch: _Batch, micro_batches: list[list[int]]) -> list[torch.Tensor]:
        if self.settings.use_rollout_logprobs and "rollout_log_probs" in data:
            return _rollout_log_probs(data, batch)
        return self._frozen_log_probs(self.model, batch, micro_batches)

    def _frozen_log_probs(self, model: Any, batch: _Batch, micro_batches: list[list[int]]) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(batch)
        with torch.no_grad():
            for indices in micro_batches:
                if not indices:
                    continue
                log_probs, _, _ = self._log_probs(model, batch, indices)
                for row, i in enumerate(indices):
                    out[i] = log_probs[row, : batch.response_lengths[i]].cpu()
        missing = [i for i, value in enumerate(out) if value is None]
        if missing:
            raise ValueError(f"samples {missing[:8]} of this rank's shard are in no micro batch of the schedule")
        return out  # type: ignore[return-value]

    def _log_probs(
        self, model: Any, batch: _Batch, indices: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Response-token log-probs `[B, R_max]`, the loss mask and the response positions' entropy for samples
        `indices` (right padded).

        No attention mask is needed: padding sits after every real token, and causal attention keeps
        it from influencing them.
        """
        tokens = pad_right([batch.tokens[i] for i in indices], dtype=torch.long).to(self.device)
        logits = model(tokens).logits
        all_log_probs, all_entropy = token_log_probs_and_entropy(logits[:, :-1], tokens[:, 1:])
        width = max(batch.response_lengths[i] for i in indices)

        def responses(values: torch.Tensor) -> torch.Tensor:
            rows = []
            for row, i in enumerate(indices):
                total, response = batch.total_lengths[i], batch.response_lengths[i]
                rows.append(
                    torch.nn.functional.pad(values[row, total - response - 1 : total - 1], (0, width - response))
                )
            return torch.stack(rows)

        mask = pad_right([batch.loss_masks[i] for i in indices]).to(self.device)
        return responses(all_log_probs), mask, responses(all_entropy)

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
        """Write `<save>/iter_<rollout_id:07d>/` atomically, then the tracker (`force_sync`: saves are always
        synchronous here; the argument is accepted for the group's calling convention)."""
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
            if self._all_ok(error is None) and self.rank == 0:
                try:
                    self._write_rank0_checkpoint(root, staging, rollout_id)
                except BaseException as exc:
                    error = exc
        if self.rank == 0 and error is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if not self._all_ok(error is None):
            if error is not None:
                raise RuntimeError(f"saving {ckpt.iter_dir(root, rollout_id)} failed: {error}") from error
            raise RuntimeError(f"saving {ckpt.iter_dir(root, rollout_id)} failed on another rank")

    def _write_rank0_checkpoint(self, root: Path, staging: Path, rollout_id: int) -> None:
        self.model.save_pretrained(staging, safe_serialization=True)
        if not self.settings.no_save_optim:
            torch.save(self.optimizer.state_dict(), staging / ckpt.OPTIMIZER_FILE)
        torch.save(
            {"scheduler": self.scheduler.state_dict(), "global_step": self.global_step},
            staging / ckpt.SCHEDULER_FILE,
        )
        ckpt.publish_dir(staging, ckpt.iter_dir(root, rollout_id))
        ckpt.write_text_atomic(root / ckpt.TRACKER_FILE, str(rollout_id))

    # ---------------------------------------------------------- weight update

    def update_weights(self, update: WeightUpdate) -> None:
        """Bring the engines to the current weights as `update.version` (DDP keeps every rank's weights equal, so
        rank 0 does the work while the others wait): transport "disk" exports to `update.disk_dir`, which
        appears complete or not at all (the group then has the engines load it); "distributed" and "tensor" send
        the model's state dict, Hugging Face names as `save_pretrained` writes them, to the paused engines."""
        error: BaseException | None = None
        if self.rank == 0:
            try:
                if update.transport == "disk":
                    self._export_weights(Path(str(update.disk_dir)))
                else:
                    send_weights(update, self.model.state_dict().items())
            except BaseException as exc:
                error = exc
        if not self._all_ok(error is None):
            where = update.disk_dir if update.transport == "disk" else ", ".join(update.engine_urls)
            raise RuntimeError(
                f"weight update {update.version} ({update.transport}) to {where} failed: {error or 'on rank 0'}"
            ) from error

    def _export_weights(self, target: Path) -> None:
        """Write the model (and the tokenizer files of its source) to `target` through a staging directory."""
        staging = target.with_name(f".{target.name}.partial")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)
            self.model.save_pretrained(staging, safe_serialization=True)
            for name in TOKENIZER_FILES:
                source = Path(self.hf_source) / name
                if source.is_file():
                    shutil.copyfile(source, staging / name)
            ckpt.publish_dir(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def _rollout_log_probs(data: dict[str, Any], batch: _Batch) -> list[torch.Tensor]:
    """The engines' log-probs of each response token, one float32 tensor per sample, checked against its length."""
    values = [torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in data["rollout_log_probs"]]
    for i, value in enumerate(values):
        if value.numel() != batch.response_lengths[i]:
            raise ValueError(
                f"sample {i}: {value.numel()} rollout log-probs for {batch.response_lengths[i]} response tokens"
            )
    return values


class _Batch:
    """This rank's samples as tensors: tokens, response lengths, total lengths, response loss masks."""

    def __init__(self, tokens: list[torch.Tensor], response_lengths: list[int], loss_masks: list[torch.Tensor]):
        self.tokens = tokens
        self.response_lengths = response_lengths
        self.total_lengths = [int(t.numel()) for t in tokens]
        self.loss_masks = loss_masks

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> _Batch:
        for key in ("tokens", "response_lengths"):
            if key not in data:
                raise ValueError(f"training data lacks {key!r} (keys: {sorted(data)})")
        tokens = [torch.as_tensor(t, dtype=torch.long).reshape(-1) for t in data["tokens"]]
        lengths = [int(r) for r in data["response_lengths"]]
        if len(lengths) != len(tokens):
            raise ValueError(f"{len(tokens)} token rows but {len(lengths)} response lengths")
        masks = data.get("loss_masks")
        loss_masks = (
            [torch.as_tensor(m, dtype=torch.float32).reshape(-1) for m in masks]
            if masks is not None
            else [torch.ones(r) for r in lengths]
        )
        for i, (t, r, m) in enumerate(zip(tokens, lengths, loss_masks, strict=True)):
            if not 0 < r < t.numel():
                raise ValueError(f"sample {i}: response length {r} must be positive and leave a prompt ({t.numel()})")
            if m.numel() != r:
                raise ValueError(f"sample {i}: loss mask has {m.numel()} entries for a response of {r} tokens")
        return cls(tokens, lengths, loss_masks)

    def broadcast(self, i: int, value: Any) -> torch.Tensor:
        """Sample `i`'s advantage as a per-token tensor: a scalar is repeated over its response."""
        tensor = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
        if tensor.numel() == 1:
            return tensor.expand(self.response_lengths[i]).clone()
        if tensor.numel() != self.response_lengths[i]:
            raise ValueError(f"sample {i}: {tensor.numel()} advantages for {self.response_lengths[i]} response tokens")
        return tensor


@hookimpl
def slime_train_backends() -> Iterable[TrainBackendSpec]:
    return [
        TrainBackendSpec(
            "torch",
            TorchTrainRayActor,
            "PyTorch policy trainer (HF causal LM, AdamW, GRPO/PPO clipped loss, DDP over gloo); CPU or one GPU "
            "per rank; plain class, wrapped with ray.remote by RayTrainGroup",
        )
    ]


@hookimpl
def slime_addoption(parser) -> None:
    add_optimizer_options(parser)
    group = parser.add_argument_group("loss (torch backend)")
    group.add_argument("--eps-clip-high", type=float, default=None, help="upper clip range (default: --eps-clip)")
    group.add_argument("--kl-loss-type", choices=KL_ESTIMATORS, default="k3", help="KL estimator when --kl-coef > 0")
    group.add_argument(
        "--entropy-coef", type=float, default=0.0, help="weight of the entropy bonus subtracted from the loss"
    )
    group.add_argument(
        "--use-rollout-logprobs",
        action="store_true",
        help="take the engines' log-probs as the old policy instead of recomputing them in the trainer",
    )
