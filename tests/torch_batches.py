"""A rollout shard for driving the torch backend in-process (`TorchTrainRayActor.train_from_data`) in tests."""

from __future__ import annotations

import torch

RESPONSE_LEN = 3


def tiny_model_batch() -> dict:
    """Two prompts, two responses each (token ids inside the tiny model's vocabulary), the first one rewarded."""
    tokens = [[5, 6, 7, 8, 10 + i, 11 + i, 12 + i] for i in range(4)]
    return {
        "tokens": [torch.tensor(t) for t in tokens],
        "response_lengths": [RESPONSE_LEN] * 4,
        "loss_masks": [torch.ones(RESPONSE_LEN, dtype=torch.int32) for _ in range(4)],
        "rewards": [1.0, 0.0, 1.0, 0.0],
        "total_lengths": [len(t) for t in tokens],
    }
