"""Prompt data sources: the dataset of prompts a run samples groups from, with a resumable cursor.

`RolloutDataSource` reads `--prompt-data` once (JSONL, Parquet, a `datasets` directory or Hub id, or a weighted
mixture of them: `slime.data.prompt_sources`), yields groups of `--n-samples-per-prompt` Samples per prompt in
order (shuffled per epoch with `--rollout-seed` when `--rollout-shuffle`; a mixture's epochs laid out by
`mixture_epoch`), wraps around epochs, and saves its cursor with each checkpoint as
`<save>/rollout/global_dataset_state_dict_<id>.pt`. `RolloutDataSourceWithBuffer` adds a buffer of groups
handed back (`add_samples`, e.g. aborted generations) that is served before new prompts. Each source reads
one `PromptSettings` built from the arguments it is constructed with.
"""

from __future__ import annotations

import copy
import json
import os
import random
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from slime.data.prompt_settings import PromptSettings
from slime.data.prompt_sources import mixture_epoch, read_prompt_records
from slime.utils.atomic_files import write_atomically
from slime.utils.types import Sample

STATE_VERSION = 1


class DataSource(ABC):
    """What a rollout function samples prompt groups from."""

    @abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """`num_samples` groups (each a list of `n_samples_per_prompt` Samples)."""

    @abstractmethod
    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Hand groups back (unfinished generations) to be served again."""

    @abstractmethod
    def save(self, rollout_id: int) -> None:
        """Persist the cursor with checkpoint `rollout_id`."""

    @abstractmethod
    def load(self, rollout_id: int | None = None) -> None:
        """Restore the cursor saved with checkpoint `rollout_id`."""


def record_to_sample(record: dict, settings: PromptSettings) -> Sample:
    """The Sample of one prompt row (prompt, label, metadata and, with `--tool-key`, the tools its chat template
    is rendered with, kept as `metadata["tools"]`), read with the run's field flags."""
    prompt = record[settings.input_key]
    if settings.apply_chat_template and isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    metadata = record.get(settings.metadata_key) or {}
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    metadata = dict(metadata)
    if settings.tool_key:
        tools = record.get(settings.tool_key)
        if isinstance(tools, str):
            tools = json.loads(tools) if tools.strip() else None
        if tools:
            if not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
                raise ValueError(
                    f"--tool-key {settings.tool_key}: a row's tools must be a list of JSON objects (function "
                    f"schemas), got {type(tools).__name__}"
                )
            if isinstance(prompt, str):
                raise ValueError(
                    f"--tool-key {settings.tool_key}: tools are rendered by the chat template, but the prompt is "
                    "plain text; add --apply-chat-template (or give prompts as chat messages)"
                )
            metadata["tools"] = tools
    label = record.get(settings.label_key) if settings.label_key else None
    return Sample(prompt=prompt, label=None if label is None else str(label), metadata=metadata)


class RolloutDataSource(DataSource):
    """Prompt groups from `--prompt-data` with a resumable cursor (epoch, offset, group and sample counters)."""

    def __init__(self, args: Any) -> None:
        self.args = args
        settings = self.settings = PromptSettings.from_args(args)
        if not settings.prompt_data:
            raise ValueError("RolloutDataSource needs --prompt-data (a JSONL or Parquet file, a datasets directory...)")
        #: Rows of every source laid end to end; `source_sizes` tells where each source's rows are.
        self.dataset: list[Sample] = []
        self.source_sizes: list[int] = []
        for source in settings.prompt_data:
            records = read_prompt_records(
                source.location, required_keys=settings.record_keys(), split=settings.prompt_data_split
            )
            self.dataset += [record_to_sample(record, settings) for record in records]
            self.source_sizes.append(len(records))
        self.epoch_id = 0
        self.sample_offset = 0
        self.sample_group_index = 0
        self.sample_index = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.dataset)

    def _epoch_order(self, epoch: int) -> list[int]:
        settings = self.settings
        if len(settings.prompt_data) > 1:
            weights = [source.weight or 1.0 for source in settings.prompt_data]
            return mixture_epoch(self.source_sizes, weights, epoch, settings.shuffle, settings.seed)
        order = list(range(len(self.dataset)))
        if settings.shuffle:
            random.Random(settings.seed + epoch).shuffle(order)
        return order

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = []
        for _ in range(int(num_samples)):
            if self.sample_offset >= len(self._order):
                self.epoch_id += 1
                self.sample_offset = 0
                self._order = self._epoch_order(self.epoch_id)
            prompt = self.dataset[self._order[self.sample_offset]]
            self.sample_offset += 1
            group = []
            for _ in range(self.settings.n_samples_per_prompt):
                sample = copy.deepcopy(prompt)
                sample.group_index = self.sample_group_index
                sample.index = self.sample_index
                self.sample_index += 1
                group.append(sample)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        raise RuntimeError(f"{type(self).__name__} cannot take groups back; use RolloutDataSourceWithBuffer")

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "epoch_id": self.epoch_id,
            "sample_offset": self.sample_offset,
            "sample_group_index": self.sample_group_index,
            "sample_index": self.sample_index,
            "dataset_size": len(self.dataset),
            "prompt_data": [str(source) for source in self.settings.prompt_data],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"Unsupported data source state version {state.get('version')!r}")
        if state.get("dataset_size") != len(self.dataset):
            raise ValueError(
                f"The saved data source cursor is for {state.get('dataset_size')} prompts but --prompt-data has "
                f"{len(self.dataset)}; resume with the same prompt file"
            )
        saved_sources = state.get("prompt_data")  # absent from cursors saved before mixtures existed
        sources = [str(source) for source in self.settings.prompt_data]
        if saved_sources is not None and saved_sources != sources:
            raise ValueError(
                f"The saved data source cursor is for --prompt-data {' '.join(saved_sources)} but this run has "
                f"--prompt-data {' '.join(sources)}; resume with the same locations and weights"
            )
        self.epoch_id = int(state["epoch_id"])
        self.sample_offset = int(state["sample_offset"])
        self.sample_group_index = int(state["sample_group_index"])
        self.sample_index = int(state["sample_index"])
        self._order = self._epoch_order(self.epoch_id)

    @staticmethod
    def state_path(directory: str | os.PathLike, rollout_id: int) -> Path:
        return Path(directory).expanduser() / "rollout" / f"global_dataset_state_dict_{rollout_id}.pt"

    def save(self, rollout_id: int) -> None:
        """Write the cursor durably (temporary file, fsync, rename, directory fsync); no-op without --save."""
        import torch

        if not self.settings.save:
            return
        path = self.state_path(self.settings.save, rollout_id)
        write_atomically(path, lambda handle: torch.save(self.state_dict(), handle))

    def load(self, rollout_id: int | None = None) -> None:
        """Restore the cursor saved under `--load` with `rollout_id` (nothing to do without either)."""
        import torch

        if not self.settings.load or rollout_id is None:
            return
        path = self.state_path(self.settings.load, rollout_id)
        if not path.is_file():
            raise FileNotFoundError(f"No data source state {path}: was checkpoint {rollout_id} saved with --save?")
        self.load_state_dict(torch.load(path, weights_only=True))


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """`RolloutDataSource` that serves handed-back groups first (in the order they came back)."""

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.buffer: list[list[Sample]] = []

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        taken, self.buffer = self.buffer[:num_samples], self.buffer[num_samples:]
        return taken + (super().get_samples(num_samples - len(taken)) if len(taken) < num_samples else [])

    def add_samples(self, samples: list[list[Sample]]) -> None:
        for group in samples:
            if not isinstance(group, list) or not all(isinstance(s, Sample) for s in group):
                raise TypeError("add_samples takes a list of groups, each a list of Samples")
            self.buffer.append(group)
