"""Data-parallel schedule of a training batch: which samples each rank trains on, in which micro batches.

A rollout batch holds `len(total_lengths)` samples and is trained in steps of `global_batch_size` samples.
Each step's samples are split across the `dp_size` ranks (balanced by token count when
`--balance-data` is set, otherwise contiguous and equal in count), then each rank's share is cut into micro
batches: `micro_batch_size` samples each, or - with `--use-dynamic-batch-size` - packs of at most
`max_tokens_per_gpu` tokens. All ranks run the same number of micro batches per step (collectives must
line up), so ranks with fewer packs split their largest ones.
"""

from __future__ import annotations

import heapq
from typing import Any


def _balanced_partition(indices: list[int], lengths: list[int], parts: int) -> list[list[int]]:
    """Equal-count partition of `indices` minimising the largest token sum (greedy longest first)."""
    capacity = -(-len(indices) // parts)
    heap = [(0, rank) for rank in range(parts)]
    result: list[list[int]] = [[] for _ in range(parts)]
    for index in sorted(indices, key=lambda i: -lengths[i]):
        skipped = []
        while True:
            load, rank = heapq.heappop(heap)
            if len(result[rank]) < capacity:
                break
            skipped.append((load, rank))
        result[rank].append(index)
        heapq.heappush(heap, (load + lengths[index], rank))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return [sorted(part) for part in result]


def _contiguous_partition(indices: list[int], parts: int) -> list[list[int]]:
    size, extra = divmod(len(indices), parts)
    result, start = [], 0
    for rank in range(parts):
        stop = start + size + (1 if rank < extra else 0)
        result.append(indices[start:stop])
        start = stop
    return result


def _token_packs(local: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit packs of local positions whose token sums stay within `max_tokens` (one long sample alone)."""
    packs: list[list[int]] = []
    sums: list[int] = []
    for position in local:
        length = lengths[position]
        for pack, total in enumerate(sums):
            if total + length <= max_tokens:
                packs[pack].append(position)
                sums[pack] += length
                break
        else:
            packs.append([position])
            sums.append(length)
    return packs


def _split_to(packs: list[list[int]], count: int, lengths: list[int]) -> list[list[int]]:
    packs = [list(pack) for pack in packs]
    while len(packs) < count:
        largest = max(range(len(packs)), key=lambda i: (len(packs[i]) > 1, sum(lengths[p] for p in packs[i])))
        pack = packs[largest]
        if len(pack) < 2:
            raise ValueError(
                f"Cannot give every data-parallel rank {count} micro batches: a rank has only "
                f"{sum(len(p) for p in packs)} samples in this step; lower --max-tokens-per-gpu or raise "
                "--global-batch-size"
            )
        half = len(pack) // 2
        packs[largest : largest + 1] = [pack[:half], pack[half:]]
    return packs


def build_dp_schedule(
    args: Any,
    train_parallel_config: dict,
    total_lengths: list[int],
    *,
    global_batch_size: int,
    rollout_indices: list[int] | None = None,
) -> tuple[list[list[int]], list[list[list[int]]], list[int], list[int]]:
    """Return `(partitions, micro_batch_indices, num_microbatches, global_batch_sizes)`.

    `partitions[rank]` lists global sample indices for `rank` (step by step); `micro_batch_indices[rank]`
    lists that rank's micro batches as positions into its partition; `num_microbatches[step]` and
    `global_batch_sizes[step]` describe each step. `rollout_indices` (the samples' rollout ids) only has to
    match the sample count; steps never reorder samples across rollouts.
    """
    dp_size = int(train_parallel_config["dp_size"])
    count = len(total_lengths)
    if rollout_indices is not None and len(rollout_indices) != count:
        raise ValueError(f"rollout_ids has {len(rollout_indices)} entries for {count} samples")
    if dp_size < 1 or global_batch_size < 1:
        raise ValueError(f"dp_size ({dp_size}) and global_batch_size ({global_batch_size}) must be positive")
    lengths = [int(length) for length in total_lengths]
    dynamic = bool(getattr(args, "use_dynamic_batch_size", False))
    max_tokens = getattr(args, "max_tokens_per_gpu", None)
    if dynamic and not max_tokens:
        raise ValueError("--use-dynamic-batch-size requires --max-tokens-per-gpu")
    micro_batch_size = int(getattr(args, "micro_batch_size", None) or 1)
    balance = bool(getattr(args, "balance_data", False))

    partitions: list[list[int]] = [[] for _ in range(dp_size)]
    micro_batches: list[list[list[int]]] = [[] for _ in range(dp_size)]
    num_microbatches: list[int] = []
    global_batch_sizes: list[int] = []
    for start in range(0, count, global_batch_size):
        step = list(range(start, min(start + global_batch_size, count)))
        if len(step) < dp_size:
            raise ValueError(f"A training step has {len(step)} samples for {dp_size} data-parallel ranks")
        shares = _balanced_partition(step, lengths, dp_size) if balance else _contiguous_partition(step, dp_size)
        step_packs = []
        for rank, share in enumerate(shares):
            offset = len(partitions[rank])
            local = list(range(offset, offset + len(share)))
            local_lengths = {position: lengths[index] for position, index in zip(local, share, strict=True)}
            if dynamic:
                packs = _token_packs(local, local_lengths, int(max_tokens))
            else:
                packs = [local[i : i + micro_batch_size] for i in range(0, len(local), micro_batch_size)]
            partitions[rank].extend(share)
            step_packs.append((packs, local_lengths))
        steps = max(len(packs) for packs, _ in step_packs)
        for rank, (packs, local_lengths) in enumerate(step_packs):
            micro_batches[rank].extend(_split_to(packs, steps, local_lengths))
        num_microbatches.append(steps)
        global_batch_sizes.append(len(step))
    return partitions, micro_batches, num_microbatches, global_batch_sizes
