"""The Megatron backend's checkpoints: `dist_checkpointing` (torch_dist) saves inside the joint commit.

Step N is `<save>/iter_<N:07d>/` (the directory the joint commit lists as the model's payload):

- `dist/`: one `dist_checkpointing` checkpoint of `{"model": ..., "optimizer": ...}` (optimizer unless
  `--no-save-optim`), written by every rank; tensors carry their global shapes, so Megatron can load the model
  at another tensor/pipeline-parallel layout, and so can the plain optimizer's state; the distributed
  optimizer's state resumes at the tensor/pipeline layout it was saved at;
- `train_state.json`: the optimizer-step counter, the layout it was saved at, the megatron-core version and the
  model family;
- `rng_state_rank<R>.pt`: each rank's Python, NumPy, torch and Megatron RNG states (layout-specific).

The directory is assembled in `<save>/.iter_<N:07d>.partial/` and published with the torch backend's durable
helpers (`slime.plugins.torch_checkpoint`: every file fsynced, renamed into place, then the tracker), so a
crash leaves either the previous checkpoint or the new one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from slime.plugins import torch_checkpoint as ckpt

DIST_DIR = "dist"
TRAIN_STATE_FILE = "train_state.json"
#: How the distributed optimizer's state is saved. megatron-core 0.16.1 saves and loads "dp_reshardable" (another
#: data-parallel size, the same tensor/pipeline layout); its "fully_sharded_model_space" fails to save
#: ("flattened_range is not supported") and "fully_reshardable" fails to load, so a distributed optimizer's
#: state resumes at the layout it was saved at only (`check_resumable`).
DISTRIBUTED_OPTIMIZER_SHARDING = "dp_reshardable"


@dataclass(frozen=True)
class TrainState:
    """`train_state.json`: what a resume needs besides the tensors, and what it checks them against."""

    global_step: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    world_size: int
    megatron_core: str
    model_family: str
    optimizer_saved: bool
    use_distributed_optimizer: bool

    @classmethod
    def read(cls, directory: Path) -> TrainState:
        path = directory / TRAIN_STATE_FILE
        try:
            values = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"{path} is missing: {directory} is not a checkpoint of the Megatron backend (a torch backend "
                "checkpoint holds config.json and model.safetensors instead); resume it with the backend that "
                "wrote it, or start fresh from its Hugging Face weights with --hf-checkpoint"
            ) from exc
        except ValueError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); the checkpoint is corrupt") from exc
        try:
            return cls(**values)
        except TypeError as exc:
            raise ValueError(f"{path} does not hold the Megatron backend's training state: {exc}") from exc

    def write(self, directory: Path) -> None:
        path = directory / TRAIN_STATE_FILE
        with open(path, "w") as handle:
            json.dump(asdict(self), handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())


def checkpoint_to_load(load: str | None, ckpt_step: int | None) -> Path | None:
    """The `iter_<N>` directory `--load` / `--ckpt-step` select, or None to start from the Hugging Face weights.

    A `--load` directory without a tracker and without `--ckpt-step` is a fresh start (the first run of a job
    whose `--load` equals its `--save`).
    """
    if not load:
        return None
    step = ckpt_step if ckpt_step is not None else ckpt.read_tracker(load)
    if step is None:
        return None
    directory = ckpt.iter_dir(load, int(step))
    if not (directory / DIST_DIR).is_dir():
        raise FileNotFoundError(
            f"model checkpoint {directory} is missing or incomplete (no {DIST_DIR}/); pick an existing step with "
            "--ckpt-step or fix latest_checkpointed_iteration.txt"
        )
    return directory


def step_of(directory: Path) -> int:
    """N of `.../iter_<N:07d>`."""
    return int(directory.name.removeprefix("iter_"))


def check_resumable(
    state: TrainState, directory: Path, *, tp: int, pp: int, world_size: int, load_optim: bool, load_rng: bool
) -> None:
    """Refuse, with how to proceed, a resume that cannot restore what it is asked to restore at this layout."""
    same_ranks = state.world_size == world_size and (
        state.tensor_model_parallel_size,
        state.pipeline_model_parallel_size,
    ) == (tp, pp)
    if load_rng and not same_ranks:
        raise ValueError(
            f"{directory} was saved by {state.world_size} ranks at TP={state.tensor_model_parallel_size} "
            f"PP={state.pipeline_model_parallel_size}; this run has {world_size} ranks at TP={tp} PP={pp}. The model "
            "and optimizer reshard to the new layout, but each rank's random state does not: resume with "
            "--no-load-rng (or with the saved layout)"
        )
    saved_layout = (state.tensor_model_parallel_size, state.pipeline_model_parallel_size)
    if load_optim and state.use_distributed_optimizer and saved_layout != (tp, pp):
        raise ValueError(
            f"{directory} holds distributed-optimizer state saved at TP={saved_layout[0]} PP={saved_layout[1]}; "
            f"megatron-core {state.megatron_core} cannot reshard it to TP={tp} PP={pp}. Resume at the saved layout, "
            "or with --no-load-optim (the model reshards; the optimizer starts fresh)"
        )
    if load_optim and not state.optimizer_saved:
        raise ValueError(
            f"{directory} holds no optimizer state (saved with --no-save-optim): resume with --no-load-optim"
        )


def prime_adam_state(optimizer: Any) -> None:
    """Give every parameter of a Megatron optimizer that has taken no step yet an Adam state (zeros, step 0), the
    shape a checkpoint's state is loaded into.

    Without TransformerEngine or Apex, megatron-core 0.16.1's `DistributedOptimizer.state_dict()` reads each
    parameter's "step" from the torch Adam state, which torch creates lazily on the first step; building the
    sharded state dict to load a checkpoint into a fresh optimizer then fails (`assert len(steps) == 1`).
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }


def restore_adam_steps(optimizer: Any, global_step: int) -> None:
    """Set every parameter's Adam "step" to `global_step` (the optimizer steps taken: each updates every
    parameter) after a Megatron optimizer loaded a checkpoint.

    megatron-core 0.16.1's `DistributedOptimizer.load_state_dict` (without TransformerEngine or Apex) leaves the
    step wrong: after loading a checkpoint saved at step 4, every parameter's step read 0 (the primed value, see
    `prime_adam_state`), and it puts one shared step tensor in every parameter's state, which torch's Adam would
    advance once per parameter per step. Each parameter gets its own tensor here.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in chained.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(float(global_step))
