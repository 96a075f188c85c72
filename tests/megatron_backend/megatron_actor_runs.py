"""Run `MegatronTrainRayActor` ranks in spawned processes (no Ray) on synthetic GRPO steps, for the tests.

`run_ranks(world_size, options, steps, out)` starts `world_size` processes over gloo; each builds one rank,
trains `steps` (each a full rollout step, sharded here per data-parallel rank the way the batch builder
plans it), optionally saves, exports (`export=DIR`) and sends its weights to an engine (`send=(transport, url,
version)`), and rank 0 writes its per-step metrics to `out/metrics.json`.
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as mp

#: Samples per optimizer step and per micro batch of the synthetic rollout steps.
GLOBAL_BATCH = 8
MICRO_BATCH = 2
GROUP = 4


def synthetic_steps(num_steps: int, vocab_size: int, samples: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    """Rollout steps of `samples` prompt+response rows with GRPO-centred rewards per group of `GROUP`."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(num_steps):
        tokens, responses, rewards = [], [], []
        for _ in range(samples // GROUP):
            prompt_length = int(torch.randint(3, 7, (1,), generator=generator))
            prompt = torch.randint(4, vocab_size, (prompt_length,), generator=generator)
            raw = torch.randint(0, 2, (GROUP,), generator=generator).float()
            centred = raw - raw.mean()
            for k in range(GROUP):
                length = int(torch.randint(2, 6, (1,), generator=generator))
                response = torch.randint(4, vocab_size, (length,), generator=generator)
                tokens.append(torch.cat([prompt, response]).tolist())
                responses.append(length)
                rewards.append(float(centred[k]))
        steps.append({"tokens": tokens, "response_lengths": responses, "rewards": rewards})
    return steps


def shard(data: dict[str, Any], dp_rank: int, dp_size: int) -> dict[str, Any]:
    """Data-parallel rank `dp_rank`'s share of a rollout step, with the batch builder's plan: optimizer steps of
    `GLOBAL_BATCH` samples, each split across ranks, in micro batches of `MICRO_BATCH` local samples."""
    count = len(data["tokens"])
    local: list[int] = []
    sizes, counts, micro = [], [], []
    for start in range(0, count, GLOBAL_BATCH):
        step = list(range(start, min(start + GLOBAL_BATCH, count)))
        mine = [i for position, i in enumerate(step) if position % dp_size == dp_rank]
        first = len(local)
        local.extend(mine)
        indices = list(range(first, len(local)))
        chunks = [indices[i : i + MICRO_BATCH] for i in range(0, len(indices), MICRO_BATCH)]
        sizes.append(len(step))
        counts.append(len(chunks))
        micro.extend(chunks)
    out = {key: [values[i] for i in local] for key, values in data.items()}
    out.update(global_batch_sizes=sizes, num_microbatches=counts, micro_batch_indices=micro)
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, options: dict, steps: list, out: str, actions: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from slime.plugins.megatron_backend.actor import MegatronTrainRayActor
    from slime.weight_sync import WeightUpdate

    try:
        actor = MegatronTrainRayActor(world_size=world_size, rank=rank)
        first = actor.init(SimpleNamespace(**options), "actor")
        metrics = []
        for offset, data in enumerate(steps):
            metrics.append(actor.train_from_data(first + offset, shard(data, actor.dp_rank, actor.dp_size)))
            if actions.get("save_every_step"):
                actor.save_model(first + offset)
        if actions.get("export"):
            actor.update_weights(WeightUpdate(version=1, transport="disk", disk_dir=actions["export"]))
        if actions.get("send"):
            transport, url, version = actions["send"]
            update = WeightUpdate(version, transport, (url,), bucket_bytes=16 * 1024, timeout_s=60)
            actor.update_weights(update)
        if rank == 0:
            Path(out, "metrics.json").write_text(json.dumps({"first": first, "metrics": metrics}))
    except BaseException:
        Path(out, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        from slime.plugins.megatron_backend.model import destroy_parallel

        destroy_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, options: dict, steps: list, out: Path, **actions: Any) -> dict[str, Any]:
    """Run the ranks to completion; rank 0's `{"first": first step, "metrics": [per step]}`. Raises with the
    failing ranks' tracebacks."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    try:
        mp.start_processes(
            _rank_main,
            args=(world_size, port, options, steps, str(out), actions),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
    except Exception as exc:
        errors = "\n".join(path.read_text() for path in sorted(out.glob("error_rank*.txt")))
        raise AssertionError(f"ranks failed:\n{errors or exc}") from exc
    return json.loads((out / "metrics.json").read_text())
