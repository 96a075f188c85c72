"""Where prompts come from: `--prompt-data` (and `--eval-prompt-data`) locations, read into rows, and weighted mixtures.

A location is a JSONL or Parquet file, a directory written by `datasets` (`Dataset.save_to_disk`, or a
`DatasetDict`'s, whose `--prompt-data-split` is read), or a Hugging Face Hub dataset id (`owner/name`, read with
`datasets.load_dataset`, found in the local cache when the Hub is unreachable). `--prompt-data` takes several
locations, each `LOCATION:WEIGHT`, to train on a mixture: `mixture_epoch` lays out one epoch of it.

Rows are checked as they are read: every row must have the fields the run names (`--input-key`, `--label-key`),
and errors name the flag, the location, the row and the fix.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_JSONL_FIX = 'each non-empty line of a JSONL prompt file must be one JSON object, e.g. {"input": "...", "label": "..."}'
#: `LOCATION:WEIGHT`: a positive number after the last colon.
_WEIGHTED = re.compile(r"^(?P<location>.+):(?P<weight>(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)$")
#: What `datasets.save_to_disk` writes into a directory (a `Dataset`, a `DatasetDict`).
_SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")
#: Suffixes of prompt files: a missing `data/prompts.jsonl` is a missing file, never a Hub dataset id.
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
#: The split read, when a `datasets` directory or Hub dataset has several and no split is named: training
#: prompts read `train`, evaluation prompts `test` (either way, a dataset with one split gives that one).
TRAIN_SPLIT, EVAL_SPLIT = "train", "test"


@dataclass(frozen=True)
class PromptSource:
    """One `--prompt-data` location and its mixture weight (None: the only source, or equal weights)."""

    location: str
    weight: float | None = None

    def __str__(self) -> str:
        return self.location if self.weight is None else f"{self.location}:{self.weight:g}"


def parse_prompt_data(value: str | Sequence[str] | None) -> tuple[PromptSource, ...]:
    """`--prompt-data` values as sources: one location, or several `LOCATION:WEIGHT` (all weighted, or none:
    equal weights). ValueError naming the flag and the value otherwise."""
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else list(value)
    sources = []
    for text in values:
        if isinstance(text, PromptSource):
            sources.append(text)
            continue
        match = _WEIGHTED.match(str(text))
        if match and not Path(text).expanduser().exists():
            weight = float(match["weight"])
            if weight <= 0:
                raise ValueError(f"--prompt-data {text}: a mixture weight must be positive")
            sources.append(PromptSource(match["location"], weight))
        else:
            sources.append(PromptSource(str(text)))
    if not sources:
        raise ValueError("--prompt-data needs a location: a JSONL or Parquet file, a datasets directory or a Hub id")
    if len(sources) > 1:
        unweighted = [str(source) for source in sources if source.weight is None]
        if unweighted and len(unweighted) < len(sources):
            raise ValueError(
                f"--prompt-data {' '.join(values)}: give every location of a mixture a weight "
                f"(LOCATION:WEIGHT), or none for equal weights; without one: {', '.join(unweighted)}"
            )
        locations = [source.location for source in sources]
        if len(set(locations)) < len(locations):
            raise ValueError(f"--prompt-data {' '.join(values)}: a location is named twice")
    return tuple(sources)


def prompt_data_text(value: str | Sequence[str] | None) -> str | None:
    """`--prompt-data` as one string (its values joined by spaces), as a run's recorded configuration keeps it."""
    if value is None or isinstance(value, str):
        return value
    return " ".join(str(part) for part in value)


def parse_chat_template_kwargs(value: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`--apply-chat-template-kwargs` (a JSON object, e.g. '{"enable_thinking": false}') as a dict: the keyword
    arguments every chat prompt is rendered with (`tokenizer.apply_chat_template(..., **kwargs)`)."""
    if value is None or isinstance(value, Mapping):
        return None if value is None else dict(value)
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"--apply-chat-template-kwargs {value!r} is not JSON ({exc.msg}); e.g. "
            "--apply-chat-template-kwargs '{\"enable_thinking\": false}'"
        ) from exc
    if not isinstance(parsed, dict):
        raise ValueError(
            f"--apply-chat-template-kwargs {value!r} must be a JSON object of keyword arguments, e.g. "
            "'{\"enable_thinking\": false}'"
        )
    return parsed


def chat_template_kwargs_text(value: str | Mapping[str, Any] | None) -> str | None:
    """`--apply-chat-template-kwargs` as canonical JSON (sorted keys), as a run's recorded configuration keeps it."""
    parsed = parse_chat_template_kwargs(value)
    return None if parsed is None else json.dumps(parsed, sort_keys=True)


def check_record(record: Any, where: str, required_keys: Mapping[str, str]) -> dict:
    """`record` if it is an object with every field of `required_keys` (field -> the flag naming it)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: the row is a JSON {type(record).__name__}, not an object; {_JSONL_FIX}")
    for key, flag in required_keys.items():
        if key not in record:
            raise KeyError(
                f"{where}: the row has no {key!r} field ({flag} {key}); its fields are {sorted(record)}. "
                f"Add the field to every row, or pass {flag} with the field that holds it"
            )
    return record


def read_prompt_records(
    location: str | os.PathLike,
    *,
    required_keys: Mapping[str, str] | None = None,
    source: str = "--prompt-data",
    split: str | None = None,
    preferred_split: str = TRAIN_SPLIT,
) -> list[dict]:
    """The rows of one location: a JSONL or Parquet file, a `datasets` directory, or a Hub dataset id.

    `required_keys` maps each field every row needs to its flag; `split` names the split of a dataset that has
    several (None: `preferred_split` if it has one by that name, else its only split). Errors name `source` (the
    flag that gave the location), the location, the line (JSONL) or row, what is wrong and the fix.
    """
    from slime.utils.hub_checkpoint import looks_like_hub_id

    path = Path(location).expanduser()
    required_keys = dict(required_keys or {})
    choice = (split, preferred_split)
    if path.is_file():
        records = _read_file(path, required_keys)
    elif path.is_dir():
        records = _checked_rows(_load_from_disk(path, source, choice), str(path), required_keys)
    elif looks_like_hub_id(str(location)) and str(location).count("/") == 1 and path.suffix not in _FILE_SUFFIXES:
        records = _checked_rows(_load_from_hub(str(location), source, choice), str(location), required_keys)
    else:
        raise FileNotFoundError(f"{source} {path} does not exist")
    if not records:
        raise ValueError(f"{source} {location} holds no prompts")
    return records


def _read_file(path: Path, required_keys: Mapping[str, str]) -> list[dict]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(f"Reading {path} needs pyarrow: pip install pyarrow", name="pyarrow") from exc
        return _checked_rows(pq.read_table(path).to_pylist(), str(path), required_keys)
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno}); {_JSONL_FIX}"
                ) from exc
            records.append(check_record(record, f"{path}:{number}", required_keys))
    return records


def _checked_rows(rows: Sequence[Any], where: str, required_keys: Mapping[str, str]) -> list[dict]:
    return [check_record(row, f"{where} row {number}", required_keys) for number, row in enumerate(rows, 1)]


def _datasets(source: str, location: str) -> Any:
    try:
        import datasets
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"{source} {location}: reading a datasets directory or a Hub dataset needs the `datasets` library: "
            "pip install 'slime-rl[data]'",
            name="datasets",
        ) from exc
    return datasets


def _pick_split(loaded: Any, source: str, location: str, split: tuple[str | None, str]) -> Any:
    """The chosen split of a `DatasetDict` (a `Dataset` as it is): `split` is (named split or None, preferred)."""
    if not hasattr(loaded, "keys"):
        return loaded
    named, preferred = split
    splits = sorted(loaded)
    choice = named or (preferred if preferred in loaded else splits[0] if len(splits) == 1 else None)
    if choice not in loaded:
        flag = "--eval-prompt-data-split" if source.startswith("--eval-prompt-data") else "--prompt-data-split"
        raise ValueError(
            f"{source} {location} has the splits {', '.join(splits)}"
            + (f", not {named!r}" if named else f" and none is {preferred!r}")
            + f": choose one with {flag}"
        )
    return loaded[choice]


def _load_from_disk(path: Path, source: str, split: tuple[str | None, str]) -> list[dict]:
    if not any((path / name).is_file() for name in _SAVED_DATASET_FILES):
        raise ValueError(
            f"{source} {path} is a directory but not one `datasets` saved (no state.json or dataset_dict.json): "
            "pass a JSONL or Parquet file, or a directory written by Dataset.save_to_disk"
        )
    datasets = _datasets(source, str(path))
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise ValueError(f"{source} {path}: `datasets` could not load it ({type(exc).__name__}: {exc})") from exc
    return _pick_split(loaded, source, str(path), split).to_list()


def _load_from_hub(dataset_id: str, source: str, split: tuple[str | None, str]) -> list[dict]:
    datasets = _datasets(source, dataset_id)
    fix = (
        f"where the Hub is reachable, save it (`datasets.load_dataset({dataset_id!r}).save_to_disk(DIR)`) and pass "
        f"{source} DIR"
    )
    try:
        loaded = datasets.load_dataset(dataset_id)
    except Exception as exc:  # datasets raises ConnectionError, DatasetNotFoundError, FileNotFoundError, ...
        from huggingface_hub import constants

        offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        why = "HF_HUB_OFFLINE is set and it is not in the local cache" if offline else f"{type(exc).__name__}: {exc}"
        raise ValueError(
            f"{source} {dataset_id}: not a local file or directory, and loading it as a Hugging Face Hub dataset "
            f"failed ({why}); {fix}"
        ) from exc
    return _pick_split(loaded, source, dataset_id, split).to_list()


def mixture_counts(sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Prompts each source contributes to one mixture epoch: the epoch has as many prompts as the sources together
    (`sum(sizes)`), split by weight (at least one each); a source smaller than its share repeats its prompts, a
    larger one is visited over several epochs."""
    total, weight_sum = sum(sizes), sum(weights)
    return [max(1, round(total * weight / weight_sum)) for weight in weights]


def mixture_epoch(sizes: Sequence[int], weights: Sequence[float], epoch: int, shuffle: bool, seed: int) -> list[int]:
    """One epoch of a weighted mixture, as indices into the sources' rows laid end to end.

    Each source is read in its own order (shuffled per pass over it with `seed` when `shuffle`), continuing
    where the previous epoch stopped, so every prompt of a source comes up once before any comes up again.
    The sources are interleaved by smooth weighted round robin (every stretch of the epoch holds them in
    proportion), or shuffled with `seed + epoch`. A pure function of its arguments: a resumed run's cursor
    (epoch, offset) finds the same prompts.
    """
    counts = mixture_counts(sizes, weights)
    starts = [sum(sizes[:number]) for number in range(len(sizes))]
    drawn: list[list[int]] = []
    for number, (size, count) in enumerate(zip(sizes, counts, strict=True)):
        picks = []
        for position in range(epoch * count, (epoch + 1) * count):
            passage, offset = divmod(position, size)
            order = list(range(size))
            if shuffle:
                random.Random(f"{seed}:{number}:{passage}").shuffle(order)
            picks.append(starts[number] + order[offset])
        drawn.append(picks)
    if shuffle:
        layout = [index for picks in drawn for index in picks]
        random.Random(seed + epoch).shuffle(layout)
        return layout
    credit = [0] * len(counts)
    taken = [0] * len(counts)
    layout = []
    for _ in range(sum(counts)):
        for number, count in enumerate(counts):
            credit[number] += count
        number = max(range(len(counts)), key=lambda n: (taken[n] < counts[n], credit[n]))
        credit[number] -= sum(counts)
        layout.append(drawn[number][taken[number]])
        taken[number] += 1
    return layout
