"""A training rank's shard of one rollout step as tensors, checked: what every train backend trains on.

`TrainBatch.from_data(data)` takes the dict `slime.utils.data.process_rollout_data` returns and checks it at
the boundary (every sample has a prompt and a response, loss masks and advantages fit the response), so the
backends' training loops can trust it. `planned_schedule` reads the batch builder's plan of optimizer steps
and micro batches.
"""

from __future__ import annotations

import os
from typing import Any

import torch


class TrainBatch:
    """This rank's samples as tensors: tokens, response lengths, total lengths, response loss masks."""

    def __init__(self, tokens: list[torch.Tensor], response_lengths: list[int], loss_masks: list[torch.Tensor]):
        self.tokens = tokens
        self.response_lengths = response_lengths
        self.total_lengths = [int(t.numel()) for t in tokens]
        self.loss_masks = loss_masks

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> TrainBatch:
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

    def advantages(self, data: dict[str, Any]) -> list[torch.Tensor]:
        """Per-token advantages (one 1-D tensor per sample, of its response length).

        `rewards` are used as they come: the batch builder has already centred (and, with
        `--grpo-std-normalization`, scaled) them per prompt group when `--rewards-normalization` is on.
        """
        for key in ("advantages", "returns", "rewards"):
            if key in data:
                return [self.broadcast(i, value) for i, value in enumerate(data[key])]
        raise ValueError("training data has none of 'advantages', 'returns', 'rewards'; nothing to learn from")

    def rollout_log_probs(self, data: dict[str, Any]) -> list[torch.Tensor]:
        """The engines' log-probs of each response token, one float32 tensor per sample, checked against its
        length."""
        values = [torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in data["rollout_log_probs"]]
        for i, value in enumerate(values):
            if value.numel() != self.response_lengths[i]:
                raise ValueError(
                    f"sample {i}: {value.numel()} rollout log-probs for {self.response_lengths[i]} response tokens"
                )
        return values

    def has_signal(self, advantages: list[torch.Tensor], micro_batches: list[list[int]]) -> bool:
        """Whether any sample of `micro_batches` has a non-zero advantage on a token the loss counts."""
        return any(bool((advantages[i] * self.loss_masks[i]).ne(0).any()) for mb in micro_batches for i in mb)


def rank_and_world(
    world_size: int | None, rank: int | None, master_addr: str | None, master_port: int | None
) -> tuple[int, int]:
    """A training rank's `(world_size, rank)`: the explicit values when given, else `WORLD_SIZE` / `RANK` from the
    environment; an explicit `master_addr` / `master_port` is put into the environment for the process group."""
    world = int(world_size if world_size is not None else os.environ.get("WORLD_SIZE", "1"))
    own = int(rank if rank is not None else os.environ.get("RANK", "0"))
    if master_addr is not None:
        os.environ["MASTER_ADDR"] = master_addr
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)
    if not 0 <= own < world:
        raise ValueError(f"rank {own} is outside world size {world} (RANK / WORLD_SIZE)")
    return world, own


def planned_schedule(data: dict[str, Any]) -> list[tuple[int, list[list[int]]]] | None:
    """`[(global_batch_size, [micro batch indices, ...]), ...]`, one entry per optimizer step, as the batch
    builder planned it (`global_batch_sizes`, `num_microbatches`, `micro_batch_indices`); None when it planned
    none."""
    if "num_microbatches" not in data:
        return None
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
