"""How a torch training rank wraps and runs its models: precision, activation checkpointing, DDP or FSDP2.

`Parallelism` is built once per rank from `TrainSettings` (`--bf16`/`--fp16`, `--gradient-checkpointing`, `--fsdp`)
and is the only place that knows how the models are wrapped. The backend (`slime.plugins.torch_backend`) keeps the
Hugging Face module as `model` (sharded in place under FSDP) and asks this object to `prepare` it, to run
forward passes (`logits`), to scope gradient synchronisation over micro batches (`gradient_sync`), to clip the
gradient norm and to produce the full, Hugging Face-named state dicts its checkpoints and weight exports write.

**Precision (`--bf16`): autocast, not bf16 weights with fp32 master copies.** Every forward pass of the policy and
of the reference runs under `torch.autocast(<device type>, dtype=torch.bfloat16)`: matrix multiplications run
in bfloat16, precision-sensitive ops (softmax, norms, reductions) stay in float32 as autocast decides, and the
log-probs of the loss are computed in float32 from the logits (`rl_losses.token_log_probs_and_entropy`).
Weights, gradients, their all-reduce / reduce-scatter and the AdamW state stay float32. Why:

- the float32 parameters *are* the master weights: there is one copy, so the optimizer, gradient clipping,
  DDP and FSDP, checkpoints and weight exports are the same code as without `--bf16`, and every checkpoint and
  export is float32 (loadable by `from_pretrained` and by the CPU engine, which serves float32);
- a bf16 model with fp32 master copies keeps two copies of the weights, copies gradients up and weights down
  every step, and runs norms and attention softmax in bf16 unless each is special-cased;
- speed is no reason to prefer either (benchmarks/torch_backend.py, "precision" section, one train step of a
  4-layer Qwen2 on 2 CPU cores with AMX, docs/benchmarks.md): at hidden sizes 512 and 1024 both take 0.35-0.5x
  the float32 time and lie within ~20% of each other, which one ahead changing between runs on a loaded
  machine; on the demo's tiny model both are ~1.5x slower than float32 (the casts dominate).

What autocast does not save is weight memory (float32 weights are cast per forward; the casts are cached
within one forward). On GPU, FSDP2's `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)` would
also halve the all-gather bytes; it is not used so that FSDP and DDP compute exactly the same numbers.

**`--fp16`: the same, in float16, with dynamic loss scaling.** Forward passes run under float16 autocast; float16's
narrow range makes small gradients underflow, so every backward pass runs on the loss times a scale
(`torch.amp.GradScaler`), the gradients are unscaled before clipping, and a step whose gradients hold an inf or NaN
is skipped and the scale halved (it grows again after 2000 clean steps). The scale is saved with the checkpoint's
schedule, so a resumed run scales as the uninterrupted one would. Not with `--fsdp`: FSDP2's sharded gradients
would need a sharded scaler.

**FSDP (`--fsdp`).** `fully_shard` on every decoder layer (the classes in the model's `_no_split_modules`), then on
the root, over the default process group (gloo on CPU, NCCL on GPU); the reference model is sharded the same
way. Every forward of a sharded model is a collective (it all-gathers the layer's weights), so ranks with no
samples in a micro batch must still run one (`collective_forward`, `dummy_loss`). Gradients reduce once per
optimizer step: `gradient_sync(False)` (DDP's `no_sync`, FSDP's `set_requires_gradient_sync(False)`) on every
micro batch but the last. Gradients are DTensors; `clip_grad_norm_` reduces their norm over the ranks. Each rank
loads the whole model from disk before sharding it (no meta-device initialisation), so a rank's memory must
hold the full float32 model once at start-up. On the demo's tiny model FSDP's per-layer collectives make a
train step about 2x DDP's on CPU (docs/benchmarks.md); it pays for models whose replicas do not fit.

**State dicts.** `full_model_state` is the model's Hugging Face state dict on rank 0 (under FSDP gathered with
`get_model_state_dict(full_state_dict=True, cpu_offload=True)`: every rank must call it; tied weights are tied
again so `save_pretrained` writes them once), `{}` on the other ranks. `optimizer_state` is the full optimizer
state keyed by parameter name (`get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)`), the same
for one rank, DDP and FSDP at any world size: a checkpoint can be resumed with another number of ranks or with
or without `--fsdp`. The price is that rank 0 holds the full optimizer state (twice the float32 weights) in CPU
memory while saving, next to the full weights it gathers anyway for the Hugging Face files.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

#: What `--gradient-checkpointing` passes to Hugging Face: non-reentrant checkpointing works with DDP and FSDP.
CHECKPOINTING_KWARGS = {"use_reentrant": False}


class Parallelism:
    """How this rank's models are wrapped (DDP / FSDP2 / none) and run (float32, or bf16 or fp16 autocast)."""

    def __init__(
        self,
        *,
        device: torch.device,
        world_size: int,
        rank: int,
        bf16: bool = False,
        fp16: bool = False,
        fsdp: bool = False,
        gradient_checkpointing: bool = False,
    ) -> None:
        self.device = device
        self.world_size = world_size
        self.rank = rank
        self.bf16 = bf16
        self.fp16 = fp16
        #: Scales every backward pass's loss under `--fp16` (float16 gradients underflow); a pass-through otherwise.
        self.grad_scaler = torch.amp.GradScaler(device.type, enabled=fp16)
        self.fsdp = fsdp
        self.gradient_checkpointing = gradient_checkpointing
        self._ddp: Any = None
        self._mesh: Any = None

    @property
    def collective_forward(self) -> bool:
        """Whether every forward pass is a collective (FSDP): every rank must run as many as the others."""
        return self.fsdp

    # ---------------------------------------------------------------- wrapping

    def prepare(self, model: torch.nn.Module, trainable: bool = True) -> torch.nn.Module:
        """Wrap `model` for this rank; returns the module to call for training forwards.

        Trainable: gradient checkpointing when asked, then FSDP (in place: the returned module is `model`) or,
        with several ranks, DDP (a wrapper around `model`). Frozen (the reference): sharded under FSDP, as is
        otherwise.
        """
        if trainable and self.gradient_checkpointing:
            if not getattr(model, "supports_gradient_checkpointing", False):
                raise ValueError(
                    f"--gradient-checkpointing: {type(model).__name__} does not support Hugging Face gradient "
                    "checkpointing; drop the flag or use a model that does"
                )
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:  # its name since transformers 5.x, where gradient_checkpointing_enable is deprecated
                enable(activation_checkpointing_kwargs=CHECKPOINTING_KWARGS)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINTING_KWARGS)
        if self.fsdp:
            self._shard(model)
            return model
        if trainable and self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self._ddp = DistributedDataParallel(model, device_ids=device_ids)
            return self._ddp
        return model

    def _shard(self, model: torch.nn.Module) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        names = set(getattr(model, "_no_split_modules", None) or ())
        layers = [module for module in model.modules() if type(module).__name__ in names]
        if not layers:
            raise ValueError(
                f"--fsdp: {type(model).__name__} names no decoder layer class in _no_split_modules "
                f"({sorted(names)}), so it cannot be sharded per layer; drop --fsdp for this model"
            )
        if not dist.is_initialized():
            raise RuntimeError("--fsdp needs the process group initialised before the model is sharded")
        if self._mesh is None:
            self._mesh = init_device_mesh(self.device.type, (self.world_size,))
        for layer in layers:
            fully_shard(layer, mesh=self._mesh)
        fully_shard(model, mesh=self._mesh)

    # ---------------------------------------------------------------- running

    def autocast(self) -> contextlib.AbstractContextManager:
        """bfloat16 (`--bf16`) or float16 (`--fp16`) autocast on the model's device type; nothing otherwise."""
        if not (self.bf16 or self.fp16):
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.float16 if self.fp16 else torch.bfloat16)

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, parameters: list[torch.nn.Parameter], max_norm: float
    ) -> float | None:
        """Clip the gradients (unscaled first under `--fp16`) and step `optimizer`; returns the gradient norm before
        clipping, or None when `--fp16`'s scaled gradients overflowed: then the step is skipped and the scale lowered
        (every rank decides alike: the gradients were reduced over the ranks)."""
        scaler = self.grad_scaler
        scaler.unscale_(optimizer)
        norm = self.clip_grad_norm(parameters, max_norm)
        scale = scaler.get_scale() if scaler.is_enabled() else None
        scaler.step(optimizer)
        scaler.update()
        if scale is not None and scaler.get_scale() < scale:
            return None
        return norm

    def logits(self, module: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """`module(tokens).logits` in this rank's precision (bf16 under `--bf16`: the loss upcasts them)."""
        with self.autocast():
            return module(tokens, use_cache=False).logits

    def dummy_loss(self, module: torch.nn.Module) -> torch.Tensor:
        """A zero loss from a one-token forward: a rank with no samples in a micro batch still takes part in the
        collectives of its forward (FSDP's all-gathers) and backward (DDP's all-reduce, FSDP's reduce-scatter)."""
        return self.logits(module, torch.zeros(1, 1, dtype=torch.long, device=self.device)).sum().mul(0)

    def gradient_sync(self, module: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Scope of one micro batch's backward: gradients reduce over the ranks only when `enabled` (the last
        micro batch of an optimizer step); before that they accumulate locally."""
        if self.fsdp:
            module.set_requires_gradient_sync(enabled)
            return contextlib.nullcontext()
        if self._ddp is not None and not enabled:
            return self._ddp.no_sync()
        return contextlib.nullcontext()

    @staticmethod
    def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> float:
        """Clip the total gradient norm of `parameters` to `max_norm` (0: no clipping); returns the norm before.

        Under FSDP the gradients are DTensor shards and the norm is reduced over the ranks (every rank calls it)."""
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    # ------------------------------------------------------------- state dicts

    def full_model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's full state dict with Hugging Face names on rank 0, `{}` on the others.

        Under FSDP a collective (every rank must call it): the shards are gathered into CPU memory on rank 0.
        """
        if not self.fsdp:
            return model.state_dict() if self.rank == 0 else {}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return {}
        for names in _tied_parameter_names(model):
            # Gathered separately, tied weights no longer share storage; share it again so save_pretrained
            # recognises the tie and writes the tensor once, as it does for an unsharded model.
            first = next((name for name in names if name in state), None)
            for name in names:
                if first is not None and name in state:
                    state[name] = state[first]
        return state

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state, keyed by parameter name, on rank 0 (`{}` elsewhere); a collective under FSDP."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(model, optimizer, options=options)
        return state if self.rank == 0 else {}

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load a full optimizer state (by parameter name, or by position as `optimizer.state_dict()` writes it)
        into `optimizer`, each rank taking its shard under FSDP. Call before the first step."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state = _optimizer_state_by_name(model, state)
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def _tied_parameter_names(model: torch.nn.Module) -> list[list[str]]:
    """Groups of names that are one parameter (tied input and output embeddings)."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _optimizer_state_by_name(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` keyed by parameter name: an `optimizer.state_dict()` (keys are positions in `model.parameters()`,
    the order `build_optimizer` was given them) is translated; one keyed by name is returned as it is."""
    groups = state.get("param_groups") or []
    if not groups or not groups[0].get("params") or not isinstance(groups[0]["params"][0], int):
        return state
    names = [name for name, _ in model.named_parameters()]
    if max(index for group in groups for index in group["params"]) >= len(names):
        raise ValueError(
            f"the optimizer state holds more parameters than the model's {len(names)}; it belongs to another "
            "model: pass --no-load-optim or load a matching checkpoint"
        )
    return {
        "state": {names[index]: value for index, value in state.get("state", {}).items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in groups],
    }
