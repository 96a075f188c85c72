"""Rollout data helpers for training and debugging: tensorization, replay validation, debug dumps.

Debug dumps come in two forms, chosen by the path template's suffix:
- `*.straw.json`: a `slime.data.archive.RolloutArchive` index over durable straw records (tensors stay
  lazy references into the pool; nothing is copied when the run itself uses straw);
- anything else (`*.pt`): a self-contained `torch.save` of `{"rollout_id", "samples": [Sample.to_dict()]}`
  with every tensor reference materialized, readable after the pool is gone and loadable with
  `weights_only=True`.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from slime.data.tensor import is_tensor_ref, materialize_tensor_refs
from slime.rollout.base_types import iter_samples
from slime.utils.types import Sample

ARCHIVE_SUFFIX = ".straw.json"

#: Per-sample training columns and the dtype each becomes (None: keep the value's own dtype).
TRAINING_DTYPES: dict[str, torch.dtype | None] = {
    "tokens": torch.int64,
    "loss_masks": torch.int32,
    "rollout_log_probs": torch.float32,
    "rollout_topk_token_ids": torch.int32,
    "rollout_topk_log_probs": torch.float32,
    "rollout_top_p_token_ids": torch.int32,
    "rollout_top_p_token_offsets": torch.int32,
    "rollout_top_p_log_probs": torch.float32,
    "teacher_log_probs": torch.float32,
    "rollout_routed_experts": None,
}


def _to_tensor(value: Any, dtype: torch.dtype | None) -> Any:
    if value is None or is_tensor_ref(value):
        return value
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
    else:
        tensor = torch.as_tensor(value)
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor.contiguous()


def _multimodal_tensors(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    import numpy as np

    return {
        key: _to_tensor(item, None) if isinstance(item, (torch.Tensor, np.ndarray)) else item
        for key, item in value.items()
    }


def tensorize_rollout_data_for_training(data: dict) -> dict:
    """Turn per-sample list columns into contiguous CPU tensors, in place; returns `data`.

    Stored `TensorRef`s are left as they are (a training backend loads only the rows it needs).
    """
    for key, dtype in TRAINING_DTYPES.items():
        if data.get(key) is not None:
            data[key] = [_to_tensor(value, dtype) for value in data[key]]
    if data.get("multimodal_train_inputs") is not None:
        data["multimodal_train_inputs"] = [_multimodal_tensors(value) for value in data["multimodal_train_inputs"]]
    if data.get("rollout_mask_sums") is not None:
        data["rollout_mask_sums"] = torch.as_tensor(data["rollout_mask_sums"], dtype=torch.float32)
    return data


def validate_rollout_routed_experts_for_replay(
    value: Any, *, num_layers: int | None, moe_router_topk: int | None, expected_rows: int
) -> Any:
    """Check a routed-experts capture (tensor or `TensorRef`) is `[expected_rows, num_layers, topk]` integers."""
    shape = tuple(value.shape)
    dtype = value.dtype if isinstance(value, torch.Tensor) else getattr(torch, str(value.dtype))
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"Routed experts must hold integer expert ids, got dtype {dtype}")
    expected = (expected_rows, num_layers, moe_router_topk)
    if len(shape) != 3 or any(want is not None and have != want for have, want in zip(shape, expected, strict=True)):
        raise ValueError(
            f"Routed experts have shape {shape}; routing replay expects (len(tokens) - 1, args.num_layers, "
            f"args.moe_router_topk) = {expected}"
        )
    return value


def validate_rollout_id_annotated(samples: Any) -> Any:
    """Check every leaf is a Sample whose `rollout_id` is None or a non-negative int; returns `samples`.

    Accepts flat lists and nested groups; `None` means "not annotated" (e.g. data loaded from a dump).
    """
    if not isinstance(samples, (list, tuple)):
        raise TypeError(f"Expected a list of Samples or groups, got {type(samples).__name__}")
    stack = list(samples)
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
            continue
        if not isinstance(item, Sample):
            raise TypeError(f"Expected Sample leaves in rollout data, got {type(item).__name__}")
        rollout_id = item.rollout_id
        if rollout_id is not None and (type(rollout_id) is not int or rollout_id < 0):
            raise ValueError(f"Sample.rollout_id must be None or a non-negative int, got {rollout_id!r}")
    return samples


def _debug_samples(data: Any, evaluation: bool) -> list[Sample]:
    if evaluation and isinstance(data, dict):
        return [sample for entry in data.values() for sample in iter_samples(entry["samples"])]
    return list(iter_samples(data))


def save_debug_rollout_data(
    path_template: str | None,
    data: Any,
    *,
    rollout_id: int,
    evaluation: bool,
    args: Any = None,
    reference: Any = None,
) -> Path | None:
    """Write the rollout's Samples to `path_template` (formatted with `rollout_id`); None template: no-op."""
    if path_template is None:
        return None
    path = Path(path_template.format(rollout_id=("eval_" if evaluation else "") + str(rollout_id)))
    path.parent.mkdir(parents=True, exist_ok=True)
    samples = _debug_samples(data, evaluation)
    if path.name.endswith(ARCHIVE_SUFFIX):
        from slime.data.archive import RolloutArchive

        RolloutArchive.save(path, samples, rollout_id=rollout_id, evaluation=evaluation, args=args, reference=reference)
        return path
    dump = materialize_tensor_refs({"rollout_id": rollout_id, "samples": [sample.to_dict() for sample in samples]})
    torch.save(dump, path)
    return path


def _subsample(samples: list, ratio: float | None) -> list:
    """Keep about `ratio` of the samples, half from the head and half from the tail."""
    if ratio is None:
        return samples
    if not 0 < ratio <= 1:
        raise ValueError(f"--load-debug-rollout-data-subsample must be in (0, 1], got {ratio}")
    half = int(len(samples) * ratio) // 2
    return samples[:half] + samples[len(samples) - half :] if half else []


def load_debug_rollout_data(path_template: str, *, rollout_id: Any, subsample_ratio: float | None = None) -> list:
    """Read the Samples of a debug dump written by `save_debug_rollout_data`."""
    path = Path(path_template.format(rollout_id=rollout_id))
    if path.name.endswith(ARCHIVE_SUFFIX):
        from slime.data.archive import RolloutArchive

        with RolloutArchive(path) as archive:
            samples = archive.load_samples()
        return _subsample(samples, subsample_ratio)
    try:
        dump = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"Debug rollout dump {path} holds objects other than tensors and plain values; "
            f"re-save it with save_debug_rollout_data or convert it to a .straw.json archive"
        ) from exc
    if not isinstance(dump, dict) or not isinstance(dump.get("samples"), list):
        raise ValueError(f"Debug rollout dump {path} must hold a dict with a 'samples' list")
    return _subsample([Sample.from_dict(entry) for entry in dump["samples"]], subsample_ratio)
