"""Start-up check of a `--hf-checkpoint` (or `--ref-load`) directory: a run on an incomplete model fails before Ray
starts.

`validate_hf_checkpoint_dir(path)` looks for what `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` need from a local directory, without importing either: a readable
`config.json`, the weights under a name transformers loads (`model.safetensors`, `pytorch_model.bin`, or a
sharded `*.index.json` with every shard it names), and tokenizer files. Safetensors files are checked against
their own header, so a truncated download is caught here rather than in an engine. Every problem found is
reported at once, naming the directory and the flag.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

FLAG = "--hf-checkpoint"
SINGLE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHARD_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Any one of these (or both halves of a pair) is a tokenizer AutoTokenizer can build.
TOKENIZER_FILES = (
    ("tokenizer.json",),
    ("tokenizer.model",),
    ("spiece.model",),
    ("sentencepiece.bpe.model",),
    ("vocab.json", "merges.txt"),
    ("vocab.txt",),
)
_FIX = (
    "point {flag} at a complete Hugging Face model directory (what `save_pretrained` writes for the "
    "model{and_tokenizer}), or finish copying/downloading it"
)
# Safetensors headers are JSON of at most 100 MB (the format's own limit).
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


def _listing(directory: Path) -> str:
    names = sorted(entry.name for entry in directory.iterdir())
    shown = ", ".join(names[:12]) + (f", ... ({len(names)} entries)" if len(names) > 12 else "")
    return shown or "nothing"


# A problem is (exception type, text): FileNotFoundError for something missing, ValueError for bad content.
Problem = tuple[type[Exception], str]


def _safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a complete safetensors file (None when its size matches its header)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                return f"{path.name} is {size} bytes, too short for a safetensors file"
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_SAFETENSORS_HEADER or 8 + header_len > size:
                return f"{path.name} is truncated or not safetensors ({size} bytes; header claims {header_len})"
            header = json.loads(handle.read(header_len))
    except (OSError, ValueError) as exc:
        return f"{path.name} has an unreadable safetensors header ({exc})"
    if not isinstance(header, dict):
        return f"{path.name} has an unreadable safetensors header (not a JSON object)"
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets") or ()) == 2
    ]
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        return f"{path.name} is truncated: {size} bytes, its header describes {expected}"
    return None


def _weight_problems(directory: Path) -> list[Problem]:
    """Problems with the weights; an empty list when transformers will find complete weights."""
    for index_name in SHARD_INDEX_FILES:
        index_path = directory / index_name
        if not index_path.is_file():
            continue
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            return [(ValueError, f"{index_name} is not a shard index with a 'weight_map' ({reason})")]
        missing = [shard for shard in shards if not (directory / shard).is_file()]
        if missing:
            listed = ", ".join(missing)
            return [(FileNotFoundError, f"{index_name} names {len(shards)} shards; {len(missing)} missing: {listed}")]
        bad = [_safetensors_problem(directory / shard) for shard in shards if shard.endswith(".safetensors")]
        return [(ValueError, problem) for problem in bad if problem]
    for name in SINGLE_WEIGHT_FILES:
        path = directory / name
        if path.is_file():
            if name.endswith(".safetensors"):
                problem = _safetensors_problem(path)
                return [(ValueError, problem)] if problem else []
            return [] if path.stat().st_size > 0 else [(ValueError, f"{name} is empty")]
    others = sorted(p.name for p in directory.glob("*.safetensors")) + sorted(p.name for p in directory.glob("*.bin"))
    hint = f" ({', '.join(others)} found, but transformers loads only those names)" if others else ""
    return [
        (
            FileNotFoundError,
            "no model weights: expected model.safetensors, pytorch_model.bin, or a sharded "
            f"model.safetensors.index.json / pytorch_model.bin.index.json with its shards{hint}",
        )
    ]


def _tokenizer_problems(directory: Path) -> list[Problem]:
    if any(all((directory / name).is_file() for name in group) for group in TOKENIZER_FILES):
        return []
    if (directory / "vocab.json").is_file():
        return [(FileNotFoundError, "incomplete tokenizer: vocab.json without merges.txt (or tokenizer.json)")]
    expected = ", ".join(" + ".join(group) for group in TOKENIZER_FILES)
    return [(FileNotFoundError, f"no tokenizer files: expected one of {expected}")]


def _config_problems(directory: Path) -> list[Problem]:
    path = directory / "config.json"
    if not path.is_file():
        return [(FileNotFoundError, "no config.json: this is not a Hugging Face model directory")]
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return [(ValueError, f"config.json is not valid JSON ({exc})")]
    if not isinstance(config, dict):
        return [(ValueError, f"config.json holds a JSON {type(config).__name__}, not an object")]
    return []


def validate_hf_checkpoint_dir(path: str | os.PathLike, *, flag: str = FLAG, tokenizer: bool = True) -> Path:
    """Check that `path` is a complete local Hugging Face causal-LM directory; returns it resolved.

    Raises FileNotFoundError when the directory or any required file is missing, ValueError when files are
    present but unreadable (invalid config.json, truncated safetensors). The message lists every problem and names
    `flag`. `tokenizer=False`: a model that only scores tokens (a reference model) needs no tokenizer files.
    """
    directory = Path(path).expanduser()
    if not directory.is_dir():
        what = "a file" if directory.exists() else "does not exist"
        raise FileNotFoundError(
            f"{flag} {directory} is not a Hugging Face model directory ({what}); {flag} takes a local directory "
            "holding config.json, the weights" + (" and the tokenizer files" if tokenizer else "")
        )
    problems = _config_problems(directory) + _weight_problems(directory)
    if tokenizer:
        problems += _tokenizer_problems(directory)
    if not problems:
        return directory.resolve()
    missing = any(kind is FileNotFoundError for kind, _ in problems)
    fix = _FIX.format(flag=flag, and_tokenizer=" and its tokenizer" if tokenizer else "")
    message = (
        f"{flag} {directory} is not a usable Hugging Face model directory:\n"
        + "".join(f"  - {text}\n" for _, text in problems)
        + f"  (it holds: {_listing(directory)})\nFix: {fix}."
    )
    raise (FileNotFoundError if missing else ValueError)(message)


def check_reference_vocabulary(policy_vocab_size: int, reference_config: Any, reference_dir: str) -> None:
    """`--ref-load`: the reference model must score the policy's tokens, so both must have one vocabulary size."""
    reference_vocab_size = getattr(reference_config, "vocab_size", None)
    if reference_vocab_size != policy_vocab_size:
        raise ValueError(
            f"--ref-load {reference_dir} has a vocabulary of {reference_vocab_size} tokens but the policy has "
            f"{policy_vocab_size}: the reference model scores the policy's tokens, so it must share its tokenizer "
            "(a checkpoint of the same base model)"
        )
