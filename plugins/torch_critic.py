"""PPO's value model in the torch backend: the critic's settings, its model, GAE and the value loss.

With `--advantage-estimator ppo --use-critic` the run trains a second group of ranks, role "critic", beside the
policy. A critic rank holds the policy's architecture with a one-output token head in place of the LM head
(`AutoModelForTokenClassification`, `num_labels=1`), started from `--hf-checkpoint` (a fresh head) or from the
joint checkpoint's `critic/iter_N`. Each step it

1. predicts the value of every response token's state (the prefix before the token: the position whose logits
   predict it), with the weights before the step (`old_values`);
2. turns the sample's reward into per-token advantages and returns with GAE (`gae`, `--gamma`, `--lambd`), over
   the tokens the loss mask counts;
3. whitens the advantages over every counted token of the step, all critic ranks together (`whiten`);
4. fits the values to the returns with the clipped value loss (`value_loss`, `--value-clip`), on the actor's
   optimizer-step schedule, with AdamW at `--critic-lr` (default `--lr`).

It returns the advantages of its shard with its metrics; the actor rank of the same data-parallel index, which
loads the same shard, trains on them (`critic_advantages`). The equations are in docs/ppo.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slime.utils.settings import Settings, option

#: What a critic rank's `train` returns besides its `critic/*` metrics.
PARTITION_KEY, ADVANTAGES_KEY = "partition", "advantages"
#: Added to the standard deviation before whitening.
WHITEN_EPSILON = 1e-8


@dataclass(frozen=True)
class CriticSettings(Settings):
    """PPO's value model (see the flags of the same names in `slime-run --help`)."""

    #: Discount of later token rewards.
    gamma: float = option("gamma", 1.0, convert=float, minimum=0.0)
    #: GAE's lambda: 1 gives Monte-Carlo returns minus the value, 0 the one-step TD error.
    lambd: float = option("lambd", 1.0, convert=float, minimum=0.0)
    #: How far a value may move from the step's old value before the clipped loss takes over.
    value_clip: float = option("value_clip", 0.2, convert=float, above=0.0)
    #: The critic's learning rate; None: `--lr`.
    critic_lr: float | None = option("critic_lr", None, convert=float, above=0.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gamma > 1.0 or self.lambd > 1.0:
            raise ValueError(f"--gamma ({self.gamma}) and --lambd ({self.lambd}) must be in [0, 1]")


def add_options(parser: Any) -> None:
    group = parser.add_argument_group(
        "critic (torch backend, --advantage-estimator ppo --use-critic)",
        "PPO's value model: a second group of training ranks with the policy's architecture and a value head.",
    )
    group.add_argument("--gamma", type=float, default=1.0, help="discount of later token rewards, in [0, 1]")
    group.add_argument(
        "--lambd", type=float, default=1.0, help="GAE's lambda, in [0, 1] (1: Monte-Carlo returns minus the value)"
    )
    group.add_argument(
        "--value-clip",
        type=float,
        default=0.2,
        help="the clipped value loss's range: a value moving further than this from its old value is clipped",
    )
    group.add_argument("--critic-lr", type=float, default=None, help="the critic's learning rate; None: --lr's")


def check_args(args: Any) -> None:
    """Refuse at parse time a critic layout or setting the torch backend cannot train."""
    if getattr(args, "train_backend", "torch") != "torch" or not getattr(args, "use_critic", False):
        return
    CriticSettings.from_args(args)  # a ValueError naming the flag
    from slime.ray.settings import ClusterSettings

    cluster = ClusterSettings.from_args(args)
    if cluster.critic_ranks != cluster.actor_ranks:
        raise ValueError(
            f"--use-critic with {cluster.critic_ranks} critic ranks (--critic-num-nodes x --critic-num-gpus-per-node) "
            f"and {cluster.actor_ranks} actor ranks: each critic rank computes the advantages of the actor rank that "
            "loads the same shard, so give both the same number of ranks"
        )


def load_value_model(source: str) -> Any:
    """The policy architecture of `source` (a Hugging Face directory) with a one-output token head, float32. From
    a causal LM the body's weights load and the head starts fresh; from a critic checkpoint everything loads. The
    head's dropout (0.1 by default in transformers) is off: the old values and the fitted ones must be the same
    function of the weights."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    model_config = AutoConfig.from_pretrained(source, num_labels=1)
    model_config.classifier_dropout = 0.0  # read by the token-classification head's constructor
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the fresh head and the dropped LM head are expected, not news
    try:
        return AutoModelForTokenClassification.from_pretrained(source, config=model_config, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)


def gae(
    reward: float, values: torch.Tensor, mask: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token `(advantages, returns)` of one sample whose reward comes after its last counted token.

    Over the tokens the loss `mask` counts (tool output between them is skipped; it is not the policy's action),
    with `V` the values there and `V = 0` after the last: `delta_t = r_t + gamma * V_{t+1} - V_t`, `r_t = reward`
    on the last counted token and 0 before; `A_t = delta_t + gamma * lambd * A_{t+1}`; `returns_t = A_t + V_t`.
    Tokens outside the mask get 0 for both.
    """
    counted = mask.bool()
    kept = values.double()[counted]
    advantages = torch.zeros_like(kept)
    following_value, running = 0.0, 0.0
    for t in range(kept.numel() - 1, -1, -1):
        token_reward = float(reward) if t == kept.numel() - 1 else 0.0
        delta = token_reward + gamma * following_value - float(kept[t])
        running = delta + gamma * lambd * running
        advantages[t] = running
        following_value = float(kept[t])
    full_advantages = torch.zeros(values.numel(), dtype=torch.float64)
    full_returns = torch.zeros(values.numel(), dtype=torch.float64)
    full_advantages[counted] = advantages
    full_returns[counted] = advantages + kept
    return full_advantages.float(), full_returns.float()


def whiten(
    advantages: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """`advantages` minus their mean, over their std, both over every counted token of every rank (`all_reduce`
    sums a float64 tensor over the critic's ranks); tokens outside the masks stay 0. All equal: zeros."""
    totals = torch.zeros(3, dtype=torch.float64)
    for advantage, mask in zip(advantages, masks, strict=True):
        counted = advantage.double()[mask.bool()]
        totals += torch.stack([counted.sum(), counted.square().sum(), torch.tensor(float(counted.numel()))])
    total, squares, count = all_reduce(totals).tolist()
    if count == 0:
        return [torch.zeros_like(advantage) for advantage in advantages]
    mean = total / count
    std = max(squares / count - mean * mean, 0.0) ** 0.5
    return [
        ((advantage.double() - mean) / (std + WHITEN_EPSILON) * mask.double()).float()
        for advantage, mask in zip(advantages, masks, strict=True)
    ]


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, value_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token, `[batch, len]`: `0.5 * max((V - R)^2, (V_old + clip(V - V_old,
    -value_clip, value_clip) - R)^2)`, and 1.0 where the clipped branch was the larger (its masked mean is the
    clip fraction). Tokens outside `mask` count 0."""
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    unclipped_loss = (values - returns).square()
    clipped_loss = (clipped_values - returns).square()
    weights = mask.to(values.dtype)
    loss = 0.5 * torch.maximum(unclipped_loss, clipped_loss) * weights
    return loss, (clipped_loss > unclipped_loss).to(values.dtype) * weights


def critic_advantages(
    result: Mapping[str, Any], partition: Sequence[int], rank: int
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The per-token advantages and `critic/*` metrics in the `train` result of critic rank `rank`, for the actor
    rank of that index, whose shard is `partition` (the step's global sample positions): the two ranks must have
    loaded the same samples, which is checked."""
    if not isinstance(result, Mapping) or PARTITION_KEY not in result or ADVANTAGES_KEY not in result:
        raise ValueError(
            f"critic rank {rank} returned no advantages (got {type(result).__name__}); with --use-critic the critic "
            "ranks' train results carry them to the actor"
        )
    if [int(i) for i in result[PARTITION_KEY]] != [int(i) for i in partition]:
        raise RuntimeError(
            f"critic rank {rank} trained on samples {list(result[PARTITION_KEY])[:8]}... but actor rank {rank} holds "
            f"{list(partition)[:8]}...: the critic and the actor need the same data-parallel size"
        )
    metrics = {key: float(value) for key, value in result.items() if key.startswith("critic/")}
    return [torch.as_tensor(values, dtype=torch.float32) for values in result[ADVANTAGES_KEY]], metrics
