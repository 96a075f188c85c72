"""Durable files of the torch training backend: checkpoint directories, the tracker, RNG state.

A checkpoint of step N is `<save>/iter_<N:07d>/` holding `config.json` + `model.safetensors` (float32) and the
tokenizer, chat template and generation files of `--hf-checkpoint` (`HF_SIDE_FILES`): a Hugging Face directory that
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` both load; besides, `optimizer.pt` (the
full AdamW state keyed by parameter name, whatever the world size and with or without `--fsdp`: see
`slime.plugins.torch_parallel`), `opt_param_scheduler.pt` and one `rng_state_rank<R>.pt` per data-parallel rank. It
is assembled in `<save>/.iter_<N:07d>.partial/`, every file and the directory are fsynced, then it is renamed into
place and `<save>` is fsynced; only after that does `<save>/latest_checkpointed_iteration.txt` (written the same
way) name it. A crash at any point leaves either the previous checkpoint or the new one, never a half directory
under the final name. `export_hf_dir` copies the Hugging Face part of a checkpoint (`hf_files`: no optimizer, RNG
or scheduler state) to a directory of its own the same way (`--save-hf`, `slime-run export`).
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slime.plugins.torch_lora import ADAPTER_CONFIG_FILE
from slime.utils.atomic_files import fsync_path, fsync_tree

TRACKER_FILE = "latest_checkpointed_iteration.txt"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "opt_param_scheduler.pt"
#: What a Hugging Face model directory holds besides `config.json` and the weights: the tokenizer (whichever of
#: the fast, sentencepiece and vocab/merges forms the model has), its chat template and the generation defaults.
HF_SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
#: The weights index of a sharded save (its shards are the `*.safetensors` files it names).
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


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


def publish_dir(staging: Path, final: Path, *, replace: bool = True) -> None:
    """Make the fully written `staging` directory durable, then visible as `final`, replacing an older one; with
    `replace=False` an existing `final` is replaced only when it is an empty directory (the rename itself refuses
    anything else, so a directory filled meanwhile is never overwritten: OSError)."""
    fsync_tree(staging)
    if not replace:
        os.rename(staging, final)
        fsync_path(final.parent)
        return
    old = final.with_name(f".{final.name}.replaced")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.rename(final, old)
    os.rename(staging, final)
    fsync_path(final.parent)
    if old.exists():
        shutil.rmtree(old)


def copy_hf_side_files(source_dir: str | os.PathLike, staging_dir: Path) -> list[str]:
    """Copy the `HF_SIDE_FILES` of `source_dir` that `staging_dir` lacks into it; returns the names copied.

    What the model's own `save_pretrained` wrote (`config.json`, `generation_config.json`) is kept. Nothing is
    fsynced here: `staging_dir` is a directory that `publish_dir` makes durable before it becomes visible.
    """
    copied = []
    for name in HF_SIDE_FILES:
        source = Path(source_dir) / name
        if source.is_file() and not (staging_dir / name).exists():
            shutil.copyfile(source, staging_dir / name)
            copied.append(name)
    return copied


def write_hf_model(
    model: Any, state: dict[str, Any], target: Path, side_file_sources: Sequence[str | os.PathLike], *, replace: bool
) -> None:
    """Write `state` through `model.save_pretrained` (config and safetensors weights) and the `HF_SIDE_FILES` of
    `side_file_sources` (the first that has a file wins) to `target`, which appears complete or not at all: assembled
    in the hidden sibling `.<target>.partial`, then published (`publish_dir`; `replace=False` refuses a `target` that
    is not an empty directory)."""
    staging = target.with_name(f".{target.name}.partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        model.save_pretrained(staging, state_dict=state, safe_serialization=True)
        for source in side_file_sources:
            copy_hf_side_files(source, staging)
        publish_dir(staging, target, replace=replace)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def hf_files(directory: Path) -> list[Path]:
    """The Hugging Face part of checkpoint `directory`: `config.json`, the safetensors weights (single or sharded,
    with their index; under LoRA the adapter and its `adapter_config.json`) and the `HF_SIDE_FILES` present; not the
    optimizer, RNG or scheduler state."""
    names = {"config.json", WEIGHTS_INDEX_FILE, ADAPTER_CONFIG_FILE, *HF_SIDE_FILES}
    return sorted(
        path
        for path in directory.iterdir()
        if path.is_file() and (path.name in names or path.name.endswith(".safetensors"))
    )


def export_hf_dir(checkpoint: Path, target: Path, *, replace: bool) -> list[Path]:
    """Copy `hf_files(checkpoint)` to `target`, which appears complete or not at all: they are assembled in the
    hidden sibling `.<target>.partial`, fsynced, then renamed into place (`publish_dir`; `replace=False` refuses a
    `target` that is not an empty directory). Returns the files written under `target`."""
    files = hf_files(checkpoint)
    staging = target.with_name(f".{target.name}.partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
        for path in files:
            shutil.copyfile(path, staging / path.name)
        publish_dir(staging, target, replace=replace)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [target / path.name for path in files]


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
