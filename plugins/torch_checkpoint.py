"""Durable files of the torch training backend: checkpoint directories, the tracker, RNG state.

A checkpoint of step N is `<save>/iter_<N:07d>/` holding `config.json` + `model.safetensors` (a Hugging
Face directory any `from_pretrained` loads, float32), `optimizer.pt` (the full AdamW state keyed by parameter
name, whatever the world size and with or without `--fsdp`: see `slime.plugins.torch_parallel`),
`opt_param_scheduler.pt` and one `rng_state_rank<R>.pt` per data-parallel rank. It is assembled in
`<save>/.iter_<N:07d>.partial/`, every file and the directory are fsynced, then it is renamed into place and
`<save>` is fsynced; only after that does `<save>/latest_checkpointed_iteration.txt` (written the same way)
name it. A crash at any point leaves either the previous checkpoint or the new one, never a half directory
under the final name.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slime.utils.atomic_files import fsync_path, fsync_tree

TRACKER_FILE = "latest_checkpointed_iteration.txt"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "opt_param_scheduler.pt"


def iter_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def partial_dir(root: str | os.PathLike, step: int) -> Path:
    """Where step `step` is assembled before it becomes visible (a hidden sibling of the final directory)."""
    return Path(root) / f".iter_{step:07d}.partial"


def rng_file(rank: int) -> str:
    return f"rng_state_rank{rank}.pt"


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary sibling, fsync it, rename it over `path`, fsync the parent."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def publish_dir(staging: Path, final: Path) -> None:
    """Make the fully written, fsynced `staging` directory visible as `final` (replacing an older one)."""
    fsync_tree(staging)
    old = final.with_name(f".{final.name}.replaced")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.rename(final, old)
    os.rename(staging, final)
    fsync_path(final.parent)
    if old.exists():
        shutil.rmtree(old)


def read_tracker(root: str | os.PathLike) -> int | None:
    """The step `<root>/latest_checkpointed_iteration.txt` names, or None when there is no tracker."""
    path = Path(root) / TRACKER_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    try:
        return int(text)
    except ValueError as exc:
        raise ValueError(f"{path} must hold one integer step, got {text!r}; fix or remove the file") from exc


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states as tensors and plain values (loadable with `weights_only=True`)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_state_file(path: Path) -> Any:
    """`torch.load(path, weights_only=True)` with an error that names the file when it is missing or corrupt."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"checkpoint file {path} is missing; pass --no-load-optim / --no-load-rng to skip that state, "
            "or load another step with --ckpt-step"
        ) from exc
    except Exception as exc:
        raise ValueError(f"checkpoint file {path} cannot be read ({exc}); it is corrupt or not ours") from exc
