"""One rank of the Megatron training backend (a `slime.backend_interfaces.TrainBackend`).

`MegatronTrainRayActor` is a plain class, wrapped with `ray.remote` by `RayTrainGroup` like the torch backend;
megatron-core is imported only in `init`. The ranks form one torch process group (NCCL on GPU, gloo on CPU, from
`MASTER_ADDR`/`MASTER_PORT`/`RANK`/`WORLD_SIZE`) split by Megatron into tensor-, pipeline- and data-parallel
groups; each step's data is split into data-parallel shards only (`data_parallel_size`), and the ranks of one
model replica load the same shard.

One `train` call is one rollout step: the old-policy (and, with a KL loss or `--kl-coef`, reference) log-probs come
from a forward-only pass, then one optimizer step per global batch of the schedule runs its micro batches through
Megatron's forward-backward schedule (1F1B with pipeline parallelism). Each micro batch is packed into one row
with a block-diagonal causal mask; the loss is `slime.plugins.rl_losses.rl_loss`, the torch backend's, on
log-probs and entropy computed over the vocabulary split across tensor-parallel ranks. Losses exist on the last
pipeline stage only; metrics are summed there and reduced to rank 0, whose `train` result the driver logs.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slime.plugins import torch_checkpoint as ckpt
from slime.plugins.megatron_backend import checkpoint as mckpt
from slime.plugins.megatron_backend.settings import MegatronSettings, check_model, check_same_architecture
from slime.plugins.rl_losses import METRIC_NAMES, kl_shaped_advantages, pad_right, rl_loss
from slime.plugins.torch_optim import lr_multiplier
from slime.plugins.train_batch import TrainBatch, planned_schedule, rank_and_world
from slime.weight_sync import WeightUpdate, send_weights

logger = logging.getLogger(__name__)


class MegatronTrainRayActor:
    """One training rank; call `init` once, then `train`, `save_model` and `update_weights` as the group does.

    Rank and world come from the explicit constructor arguments when given, else from the environment.
    """

    def __init__(
        self,
        world_size: int | None = None,
        rank: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
    ) -> None:
        self.world_size, self.rank = rank_and_world(world_size, rank, master_addr, master_port)
        self.settings: MegatronSettings | None = None
        self.model: list[Any] = []

    @staticmethod
    def data_parallel_size(args: Any, world_size: int) -> int:
        """Data-parallel shards of each step's data: the ranks divided by tensor x pipeline x context parallel."""
        return MegatronSettings.from_args(args).data_parallel_size(world_size)

    # ------------------------------------------------------------------ setup

    def init(self, args: Any, role: str, with_ref: bool = False, with_opd_teacher: bool = False) -> int:
        """Build the model for this rank's place in the layout, load weights and state; return the first step."""
        if role != "actor":
            raise ValueError(f"the Megatron backend trains the policy only, not role {role!r}; drop --use-critic")
        if with_opd_teacher:
            raise ValueError(
                "the Megatron backend has no on-policy distillation teacher; choose another --train-backend"
            )
        settings = self.settings = MegatronSettings.from_args(args)
        from slime.plugins.megatron_backend import cpu_compat

        cpu_compat.silence_fallback_notices()
        from slime.plugins.megatron_backend import model

        cpu_compat.apply_cpu_compat()
        self._init_process_group()
        self.layout = settings.layout
        self.dp_size = settings.data_parallel_size(self.world_size)
        model.initialize_parallel(self.layout, settings.train.seed)
        from megatron.core import parallel_state

        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        self.hf_source = self._hf_source(settings)
        self.hf_config = check_model(self.hf_source, settings)

        self.model = self._build(wrap_ddp=True)
        load_dir = mckpt.checkpoint_to_load(settings.train.load, settings.train.ckpt_step)
        train_state = None
        if load_dir is None:
            from slime.plugins.megatron_backend.convert import load_hf_weights

            logger.info("rank %d loads the policy from %s", self.rank, self.hf_source)
            load_hf_weights(self.model, self.hf_source, self.layout)
        else:
            train_state = self._check_checkpoint(load_dir)
            self._load_dist(load_dir, with_optimizer=False)
        self.optimizer = model.build_optimizer(
            self.model,
            lr=settings.train.optimizer.lr,
            adam_beta1=settings.train.optimizer.adam_beta1,
            adam_beta2=settings.train.optimizer.adam_beta2,
            adam_eps=settings.train.optimizer.adam_eps,
            weight_decay=settings.train.optimizer.weight_decay,
            clip_grad=settings.train.optimizer.clip_grad,
            bf16=settings.bf16,
            use_distributed_optimizer=settings.use_distributed_optimizer,
        )
        self.ref_model: list[Any] | None = None
        if with_ref or settings.train.loss.needs_reference:
            # The reference is --ref-load, else the policy the run started from; built with the policy's layout.
            from slime.plugins.megatron_backend.convert import load_hf_weights

            reference = settings.train.ref_load or self.hf_source
            if reference != self.hf_source:
                check_same_architecture(self.hf_config, check_model(reference, settings, "--ref-load"), reference)
            self.ref_model = self._build(wrap_ddp=False)
            load_hf_weights(self.ref_model, reference, self.layout)
            for chunk in self.ref_model:
                chunk.eval().requires_grad_(False)
        self.global_step = 0
        if load_dir is not None:
            self.global_step = train_state.global_step
            if not settings.train.no_load_optim:
                self._load_dist(load_dir, with_optimizer=True)
                mckpt.restore_adam_steps(self.optimizer, self.global_step)
            else:
                self.optimizer.reload_model_params()
            if not settings.train.no_load_rng:
                self._load_rng(load_dir)
            return mckpt.step_of(load_dir) + 1
        return settings.train.start_rollout_id or 0

    def _init_process_group(self) -> None:
        if dist.is_initialized():
            return
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if self.world_size == 1 and not os.environ.get("MASTER_ADDR"):
            # Megatron's parallel state needs a process group even for one rank.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            return
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise RuntimeError(f"world size {self.world_size} needs {' and '.join(missing)} in the environment")
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size)

    @staticmethod
    def _hf_source(settings: MegatronSettings) -> str:
        if settings.train.hf_checkpoint:
            return str(settings.train.hf_checkpoint)
        from slime.plugins.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())

    def _build(self, *, wrap_ddp: bool) -> list[Any]:
        from slime.plugins.megatron_backend.model import build_model

        settings = self.settings
        return build_model(
            self.hf_config,
            self.layout,
            bf16=settings.bf16,
            recompute_granularity=settings.recompute_granularity,
            recompute_method=settings.recompute_method,
            recompute_num_layers=settings.recompute_num_layers,
            use_distributed_optimizer=settings.use_distributed_optimizer,
            wrap_ddp=wrap_ddp,
        )

    # --------------------------------------------------------------- training

    def train(self, rollout_id: int, rollout_data_ref: Sequence[Any]) -> dict[str, float]:
        """Train on this rank's data-parallel shard of one rollout step (one reference per data-parallel rank)."""
        from slime.utils.data import process_rollout_data

        started = time.perf_counter()
        data = process_rollout_data(rollout_data_ref, self.dp_rank, self.dp_size)
        loaded = time.perf_counter() - started
        metrics = self.train_from_data(rollout_id, data)
        metrics["perf/train_data_load_time"] = loaded
        return metrics

    def train_from_data(self, rollout_id: int, data: dict[str, Any]) -> dict[str, float]:
        """One rollout step on an already loaded shard (the dict `process_rollout_data` returns)."""
        settings = self.settings.train
        batch = TrainBatch.from_data(data)
        schedule = planned_schedule(data) or self._default_schedule(len(batch))
        advantages = batch.advantages(data)
        micro_batches = [mb for _, step in schedule for mb in step]
        if settings.use_rollout_logprobs and "rollout_log_probs" in data:
            old_log_probs = batch.rollout_log_probs(data)
        else:
            old_log_probs = self._forward_log_probs(self.model, batch, micro_batches)
        ref_log_probs = self._forward_log_probs(self.ref_model, batch, micro_batches) if self.ref_model else None
        rollout_log_probs = (
            batch.rollout_log_probs(data) if settings.loss.use_tis and "rollout_log_probs" in data else None
        )
        kl_reward = None
        if settings.loss.kl_reward_coef:
            # Only the last pipeline stage has log-probs; the others need no advantages.
            penalties: list[float] = []
            if old_log_probs is not None and ref_log_probs is not None:
                advantages, penalties = kl_shaped_advantages(
                    advantages, old_log_probs, ref_log_probs, batch.loss_masks, settings.loss
                )
            kl_reward = self._sum_over_loss_ranks(torch.tensor([sum(penalties), len(penalties)], dtype=torch.float64))

        # Loss metrics (METRIC_NAMES, then the sample count), summed on the ranks that compute the loss.
        self._sums = torch.zeros(len(METRIC_NAMES) + 1, dtype=torch.float64)
        grad_norms, skipped = [], 0
        for global_size, step_micro_batches in schedule:
            if settings.loss.needs_advantages and not self._any_rank(batch.has_signal(advantages, step_micro_batches)):
                # Every advantage is 0 and the loss has no other term: the gradient would be 0, and an Adam step
                # would only follow stale momentum.
                skipped += 1
                continue
            grad_norms.append(
                self._optimizer_step(
                    batch, step_micro_batches, global_size, old_log_probs, advantages, ref_log_probs, rollout_log_probs
                )
            )
        sums = self._sum_over_loss_ranks(self._sums)
        count = max(float(sums[-1]), 1.0)
        metrics = {
            f"train/{name}": float(sums[k]) / count
            for k, name in enumerate(METRIC_NAMES)
            if name in settings.loss.metric_names
        }
        metrics["train/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        metrics["train/lr"] = self._lr()
        metrics["train/steps"] = float(len(schedule) - skipped)
        metrics["train/skipped_steps"] = float(skipped)
        metrics["train/rollout_id"] = float(rollout_id)
        if kl_reward is not None:
            metrics["train/kl_reward"] = float(kl_reward[0]) / max(float(kl_reward[1]), 1.0)
        if not settings.use_rollout_logprobs and "rollout_log_probs" in data:
            mismatch = torch.zeros(2, dtype=torch.float64)
            if old_log_probs is not None:
                for engine, trainer in zip(batch.rollout_log_probs(data), old_log_probs, strict=True):
                    mismatch[0] += (engine - trainer).abs().sum().item()
                    mismatch[1] += engine.numel()
            mismatch = self._sum_over_loss_ranks(mismatch)
            if mismatch[1] > 0:
                metrics["train/rollout_logprob_abs_diff"] = float(mismatch[0] / mismatch[1])
        return metrics

    def _lr(self) -> float:
        optimizer = self.settings.train.optimizer
        factor = lr_multiplier(
            self.global_step,
            lr=optimizer.lr,
            min_lr=optimizer.min_lr,
            warmup_iters=optimizer.lr_warmup_iters,
            decay_style=optimizer.lr_decay_style,
            decay_iters=optimizer.decay_iters,
        )
        return optimizer.lr * factor

    def _optimizer_step(
        self,
        batch: TrainBatch,
        micro_batches: list[list[int]],
        global_size: int,
        old_log_probs: list[torch.Tensor] | None,
        advantages: list[torch.Tensor],
        ref_log_probs: list[torch.Tensor] | None,
        rollout_log_probs: list[torch.Tensor] | None,
    ) -> float:
        """One optimizer step over `micro_batches` (this rank's share of a global batch of `global_size`)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        lr = self._lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        # Summed over the global batch and divided by its samples (or tokens: `--loss-agg-mode token-mean`):
        # Megatron divides each micro batch's loss by the number of micro batches and averages gradients over
        # data-parallel ranks; this undoes both.
        denominator = float(global_size)
        if self.settings.train.loss.per_token_denominator:
            local = sum(int(batch.loss_masks[i].sum()) for indices in micro_batches for i in indices)
            tokens = self._sum_over_loss_ranks(torch.tensor([float(local)], dtype=torch.float64))
            denominator = max(float(tokens.item()), 1.0)
        scale = self.dp_size * len(micro_batches) / denominator
        loss_of = partial(self._rl_loss, old_log_probs, advantages, ref_log_probs, rollout_log_probs, scale)
        get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, batch, loss_of),
            data_iterator=iter(micro_batches),
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=max(self._packed_length(batch, mb) for mb in micro_batches),
            micro_batch_size=1,
            forward_only=False,
        )
        succeeded, grad_norm, _ = self.optimizer.step()
        if not succeeded:
            raise RuntimeError(
                f"optimizer step {self.global_step} failed (non-finite gradients, grad norm {grad_norm})"
            )
        self.global_step += 1
        return float(grad_norm) if grad_norm is not None else 0.0

    @staticmethod
    def _packed_length(batch: TrainBatch, indices: list[int]) -> int:
        return sum(batch.total_lengths[i] for i in indices) if indices else 2

    def _forward_step(self, batch: TrainBatch, loss_of: Any, data_iterator: Any, model: Any) -> tuple[Any, Any]:
        """Megatron's `forward_step_func`: one packed micro batch through `model`; the loss closure for its output."""
        from slime.plugins.megatron_backend.model import pack_sequences

        indices = next(data_iterator)
        rows = [batch.tokens[i] for i in indices] if indices else [torch.zeros(2, dtype=torch.long)]
        tokens, position_ids, attention_mask, offsets = pack_sequences(rows)
        device = self._device()
        output = model(tokens.to(device), position_ids.to(device), attention_mask.to(device))
        return output, partial(loss_of, batch, indices, tokens.to(device), offsets)

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _response_values(
        self, values: torch.Tensor, batch: TrainBatch, indices: list[int], offsets: Sequence[int]
    ) -> torch.Tensor:
        """`[len(indices), R_max]` of a packed row's per-position `values` (`[1, T-1]`, position t predicting
        token t+1): each sample's response positions, right padded."""
        width = max(batch.response_lengths[i] for i in indices)
        rows = []
        for offset, i in zip(offsets[: len(indices)], indices, strict=True):
            total, response = batch.total_lengths[i], batch.response_lengths[i]
            start = offset + total - response - 1
            rows.append(torch.nn.functional.pad(values[0, start : start + response], (0, width - response)))
        return torch.stack(rows)

    def _token_log_probs_and_entropy(self, logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
        from slime.plugins.megatron_backend import vocab_parallel

        vocab = self.hf_config.vocab_size
        shifted = logits[:, :-1].contiguous()
        log_probs = vocab_parallel.token_log_probs(shifted, tokens[:, 1:].contiguous(), vocab)
        return log_probs, vocab_parallel.entropy(shifted, vocab)

    def _rl_loss(
        self,
        old_log_probs: list[torch.Tensor] | None,
        advantages: list[torch.Tensor],
        ref_log_probs: list[torch.Tensor] | None,
        rollout_log_probs: list[torch.Tensor] | None,
        scale: float,
        batch: TrainBatch,
        indices: list[int],
        tokens: torch.Tensor,
        offsets: Sequence[int],
        logits: torch.Tensor,
    ) -> tuple[torch.Tensor, dict]:
        """The loss of one micro batch on the last pipeline stage (Megatron's `loss_func`)."""
        if not indices:
            # A placeholder micro batch keeps this rank in step with ranks that have samples here.
            return logits.float().sum() * 0.0, {}
        device = logits.device
        all_log_probs, all_entropy = self._token_log_probs_and_entropy(logits, tokens)
        log_probs = self._response_values(all_log_probs, batch, indices, offsets)
        entropy = self._response_values(all_entropy, batch, indices, offsets)
        ref = pad_right([ref_log_probs[i] for i in indices]).to(device) if ref_log_probs is not None else None
        rollout = None
        if rollout_log_probs is not None:
            rollout = pad_right([rollout_log_probs[i] for i in indices]).to(device)
        sample_loss, sample_metrics = rl_loss(
            log_probs,
            old_log_probs=pad_right([old_log_probs[i] for i in indices]).to(device),
            advantages=pad_right([advantages[i] for i in indices]).to(device),
            mask=pad_right([batch.loss_masks[i] for i in indices]).to(device),
            settings=self.settings.train.loss,
            entropy=entropy,
            ref_log_probs=ref,
            rollout_log_probs=rollout,
        )
        self._sums[:-1] += sample_metrics.sum(dim=1).double().cpu()
        self._sums[-1] += len(indices)
        return sample_loss.sum() * scale, {}

    def _forward_log_probs(
        self, model: list[Any], batch: TrainBatch, micro_batches: list[list[int]]
    ) -> list[torch.Tensor] | None:
        """Each sample's response-token log-probs under `model` (no gradient), on the last pipeline stage; None on
        the other stages (the loss is computed on the last one only)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        out: list[torch.Tensor | None] = [None] * len(batch)

        def collect(batch: TrainBatch, indices: list[int], tokens: torch.Tensor, offsets: Sequence[int], logits):
            if indices:
                from slime.plugins.megatron_backend import vocab_parallel

                shifted = logits[:, :-1].contiguous()
                values = vocab_parallel.token_log_probs(shifted, tokens[:, 1:].contiguous(), self.hf_config.vocab_size)
                responses = self._response_values(values, batch, indices, offsets)
                for row, i in enumerate(indices):
                    out[i] = responses[row, : batch.response_lengths[i]].float().cpu()
            return logits.float().sum() * 0.0, {}

        non_empty = [mb for mb in micro_batches if mb] or [[]]
        for chunk in model:
            chunk.eval()
        try:
            with torch.no_grad():
                get_forward_backward_func()(
                    forward_step_func=partial(self._forward_step, batch, collect),
                    data_iterator=iter(non_empty),
                    model=model,
                    num_microbatches=len(non_empty),
                    seq_length=max(self._packed_length(batch, mb) for mb in non_empty),
                    micro_batch_size=1,
                    forward_only=True,
                )
        finally:
            if model is self.model:
                for chunk in model:
                    chunk.train()
        if not self.is_last_stage:
            return None
        missing = [i for i, value in enumerate(out) if value is None]
        if missing:
            raise ValueError(f"samples {missing[:8]} of this rank's shard are in no micro batch of the schedule")
        return out  # type: ignore[return-value]

    def _default_schedule(self, n_local: int) -> list[tuple[int, list[list[int]]]]:
        """One optimizer step over the whole rollout in `--micro-batch-size` chunks (no plan from the builder);
        every data-parallel rank runs as many micro batches as the busiest one."""
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
        size = self.settings.train.micro_batch_size
        chunks = [list(range(i, min(i + size, n_local))) for i in range(0, n_local, size)]
        total = torch.tensor([float(n_local)], dtype=torch.float64)
        count = torch.tensor([float(len(chunks))], dtype=torch.float64)
        dist.all_reduce(total, group=group)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        chunks += [[] for _ in range(int(count.item()) - len(chunks))]
        return [(int(total.item()), chunks)]

    def _any_rank(self, value: bool) -> bool:
        """Collective over every rank: whether `value` holds on any."""
        flag = torch.tensor([1.0 if value else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def _all_ok(self, ok: bool) -> bool:
        """Collective over every rank: whether `ok` holds on all."""
        return not self._any_rank(not ok)

    def _sum_over_loss_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Sum of `values` over the data-parallel replicas, counting each once: from the last pipeline stage's
        first tensor-parallel rank (the others hold copies or nothing). Collective over every rank."""
        counted = values.clone() if (self.is_last_stage and self.tp_rank == 0) else torch.zeros_like(values)
        dist.all_reduce(counted)
        return counted

    # ------------------------------------------------------------ checkpoints

    def _check_checkpoint(self, directory: Path) -> mckpt.TrainState:
        from slime.plugins.megatron_backend.convert import family_of

        settings = self.settings
        state = mckpt.TrainState.read(directory)
        mckpt.check_resumable(
            state,
            directory,
            tp=self.layout.tp,
            pp=self.layout.pp,
            world_size=self.world_size,
            load_optim=not settings.train.no_load_optim,
            load_rng=not settings.train.no_load_rng,
        )
        if state.model_family != family_of(self.hf_config):
            raise ValueError(
                f"{directory} holds a {state.model_family} model but --hf-checkpoint {self.hf_source} is "
                f"{family_of(self.hf_config)}; pass the checkpoint's own Hugging Face model"
            )
        if not settings.train.no_load_optim and state.use_distributed_optimizer != settings.use_distributed_optimizer:
            raise ValueError(
                f"{directory} was saved {'with' if state.use_distributed_optimizer else 'without'} "
                "--use-distributed-optimizer; resume the same way, or with --no-load-optim to start a fresh optimizer"
            )
        return state

    def _sharded_state(self, *, with_optimizer: bool, is_loading: bool) -> dict[str, Any]:
        from slime.plugins.megatron_backend.model import unwrap_model

        model_state = unwrap_model(self.model[0]).sharded_state_dict()
        state: dict[str, Any] = {"model": model_state}
        if with_optimizer:
            metadata = {"distrib_optim_sharding_type": mckpt.DISTRIBUTED_OPTIMIZER_SHARDING}
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model_state, is_loading=is_loading, metadata=metadata
            )
        return state

    def _load_dist(self, directory: Path, *, with_optimizer: bool) -> None:
        """Load the model (before the optimizer exists) or, with `with_optimizer`, the optimizer's state."""
        from megatron.core import dist_checkpointing

        from slime.plugins.megatron_backend.model import unwrap_model

        what = "the optimizer" if with_optimizer else "the policy"
        logger.info("rank %d loads %s from %s", self.rank, what, directory)
        if with_optimizer:
            mckpt.prime_adam_state(self.optimizer)
        sharded = self._sharded_state(with_optimizer=with_optimizer, is_loading=True)
        loaded = dist_checkpointing.load(sharded, str(directory / mckpt.DIST_DIR))
        # The distributed optimizer's load_state_dict writes into views of leaf parameters: no autograd here.
        with torch.no_grad():
            if with_optimizer:
                self.optimizer.load_state_dict(loaded["optimizer"])
            else:
                unwrap_model(self.model[0]).load_state_dict(loaded["model"])

    def _load_rng(self, directory: Path) -> None:
        from slime.plugins.megatron_backend.cpu_compat import set_rng_state

        state = ckpt.load_state_file(directory / ckpt.rng_file(self.rank))
        ckpt.restore_rng_state(state["host"])
        set_rng_state(state["megatron"])

    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        """Write `<save>/iter_<rollout_id:07d>/` (see `checkpoint`) from every rank, publish it, then the tracker;
        with `--save-hf` also the Hugging Face directory. Saves are synchronous; `force_sync` is accepted for the
        group's calling convention."""
        from megatron.core import dist_checkpointing

        from slime.plugins.megatron_backend.convert import family_of
        from slime.plugins.megatron_backend.cpu_compat import rng_state

        settings = self.settings
        if not settings.train.save:
            raise ValueError("save_model needs --save (the checkpoint directory)")
        root = Path(settings.train.save)
        staging = ckpt.partial_dir(root, rollout_id)
        final = ckpt.iter_dir(root, rollout_id)
        error: BaseException | None = None
        if self.rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                if staging.exists():
                    shutil.rmtree(staging)
                (staging / mckpt.DIST_DIR).mkdir(parents=True)
            except OSError as exc:
                error = exc
        if self._all_ok(error is None):
            try:
                sharded = self._sharded_state(with_optimizer=not settings.train.no_save_optim, is_loading=False)
                dist_checkpointing.save(sharded, str(staging / mckpt.DIST_DIR))
                if not settings.train.no_save_rng:
                    state = {"host": ckpt.capture_rng_state(), "megatron": rng_state()}
                    torch.save(state, staging / ckpt.rng_file(self.rank))
            except BaseException as exc:
                error = exc
            if self._all_ok(error is None) and self.rank == 0:
                try:
                    mckpt.TrainState(
                        global_step=self.global_step,
                        tensor_model_parallel_size=self.layout.tp,
                        pipeline_model_parallel_size=self.layout.pp,
                        data_parallel_size=self.dp_size,
                        world_size=self.world_size,
                        megatron_core=_megatron_core_version(),
                        model_family=family_of(self.hf_config),
                        optimizer_saved=not settings.train.no_save_optim,
                        use_distributed_optimizer=settings.use_distributed_optimizer,
                    ).write(staging)
                    ckpt.publish_dir(staging, final)
                    ckpt.write_text_atomic(root / ckpt.TRACKER_FILE, str(rollout_id))
                except BaseException as exc:
                    error = exc
        if self.rank == 0 and error is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if not self._all_ok(error is None):
            if error is not None:
                raise RuntimeError(f"saving {final} failed: {error}") from error
            raise RuntimeError(f"saving {final} failed on another rank")
        if settings.save_hf:
            self._export_hf(Path(settings.save_hf.replace("{rollout_id}", str(rollout_id))), "--save-hf")

    # ---------------------------------------------------------- weight update

    def update_weights(self, update: WeightUpdate) -> None:
        """Bring the engines to the current weights as `update.version`: every rank takes part in gathering the
        Hugging Face state dict on rank 0, which exports it to `update.disk_dir` (transport "disk") or sends it
        to the paused engines ("distributed", "tensor")."""
        if update.transport == "disk":
            self._export_hf(Path(str(update.disk_dir)), f"weight update {update.version}")
            return
        if not update.engine_urls:
            return  # no engines to send to (the same on every rank): nothing to gather
        state = self._gather_hf()
        error: BaseException | None = None
        if self.rank == 0:
            try:
                send_weights(update, state.items())
            except BaseException as exc:
                error = exc
        if not self._all_ok(error is None):
            raise RuntimeError(
                f"weight update {update.version} ({update.transport}) to {', '.join(update.engine_urls)} failed: "
                f"{error or 'on another rank'}"
            ) from error

    def _gather_hf(self) -> dict[str, torch.Tensor] | None:
        from slime.plugins.megatron_backend.convert import gather_hf_state

        with torch.no_grad():
            return gather_hf_state(self.model, self.hf_config, self.layout)

    def _export_hf(self, target: Path, purpose: str) -> None:
        """Gather the model on rank 0 and write it to `target` as a Hugging Face directory, complete or not at
        all (assembled in a hidden sibling, fsynced, renamed into place). Collective."""
        from slime.plugins.megatron_backend.convert import write_hf_checkpoint

        state = self._gather_hf()
        error: BaseException | None = None
        if self.rank == 0:
            staging = target.with_name(f".{target.name}.partial")
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                if staging.exists():
                    shutil.rmtree(staging)
                staging.mkdir()
                write_hf_checkpoint(state, self.hf_source, staging)
                ckpt.publish_dir(staging, target)
            except BaseException as exc:
                shutil.rmtree(staging, ignore_errors=True)
                error = exc
        if not self._all_ok(error is None):
            raise RuntimeError(f"{purpose}: writing {target} failed: {error or 'on another rank'}") from error


def _megatron_core_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")
