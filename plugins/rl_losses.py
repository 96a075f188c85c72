"""The RL loss every training backend uses: pure tensor functions, no model, no process group, and
`LossSettings`, the options that shape the loss.

`rl_loss` is the one place the per-token GRPO/PPO-style objective is put together (clipped policy loss, KL
to the reference, entropy bonus), and `kl_shaped_advantages` the one place a KL penalty enters the reward
(`--kl-coef`); the torch and the Megatron backends both call them on their log-probs, so they optimise the same
thing and report the same `METRIC_NAMES`.

Shapes: token-level tensors are `[batch, response_len]` (padded on the right); `mask` is 1 on tokens that
count and 0 on padding and on tokens the loss mask excludes (tool output, prompt). Per-sample values
(rewards, scalar advantages) are `[batch]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slime.specs import RATIO_LEVELS
from slime.utils.settings import Settings, option, options_from_args

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
#: How `--use-tis` treats an importance weight outside [--tis-clip-low, --tis-clip]: clamp it to the bound
#: (truncated importance sampling) or give the token weight 0 (masked importance sampling).
TIS_MODES = ("truncate", "mask")
#: How token losses become a batch's loss (`--loss-agg-mode`; see `LossSettings.loss_agg_mode` and `rl_loss`).
LOSS_AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
#: What `rl_loss` reports per sample, in this order (each the sample's masked mean over its response tokens).
METRIC_NAMES = ("loss", "pg_loss", "kl", "clipfrac", "ppo_ratio", "entropy", "tis_weight", "tis_clipfrac")
#: Reported only with `--use-tis` (without it every weight is 1 and nothing is clipped).
TIS_METRIC_NAMES = ("tis_weight", "tis_clipfrac")


@dataclass(frozen=True)
class LossSettings(Settings):
    """What shapes the per-token loss: `policy_loss` clipping, the KL to the reference (as a loss term, or as a
    penalty in the reward), the entropy bonus, importance weights and how token losses are aggregated."""

    eps_clip: float = option("eps_clip", 0.2, convert=float, minimum=0.0)
    #: The upper clip range; None: `eps_clip`.
    eps_clip_high: float | None = option("eps_clip_high", None, convert=float, minimum=0.0)
    #: The KL loss's weight (`--use-kl-loss --kl-loss-coef`; 0 without `--use-kl-loss`, as upstream slime).
    kl_loss_coef: float = option("kl_loss_coef", 0.0, convert=float, minimum=0.0)
    #: `--kl-coef`: the weight of the KL penalty in the reward (`kl_shaped_advantages`), upstream slime's meaning.
    kl_reward_coef: float = option("kl_coef", 0.0, convert=float, minimum=0.0)
    #: The KL estimator of both the loss term and the reward penalty.
    kl_loss_type: str = option("kl_loss_type", "k3", choices=KL_ESTIMATORS)
    entropy_coef: float = option("entropy_coef", 0.0, convert=float)
    #: Truncated importance sampling: weight each token's policy loss by `exp(old - rollout)`, the old policy's
    #: probability of the token over the engine's, bounded to [tis_clip_low, tis_clip] (see `importance_weights`).
    use_tis: bool = option("use_tis", False)
    tis_clip: float = option("tis_clip", 2.0, convert=float, above=0.0)
    tis_clip_low: float = option("tis_clip_low", 0.0, convert=float, minimum=0.0)
    tis_mode: str = option("tis_mode", "truncate", choices=TIS_MODES)
    #: seq-mean-token-mean: each sample's token mean, averaged over samples (every sample weighs the same);
    #: token-mean: every token of the global batch weighs the same (long answers weigh more);
    #: seq-mean-token-sum: each sample's token sum, averaged over samples;
    #: seq-mean-token-sum-norm: the token sum over a constant (`--rollout-max-response-len`), averaged over
    #: samples (Dr. GRPO: no length bias from dividing by each answer's own length).
    loss_agg_mode: str = option("loss_agg_mode", "seq-mean-token-mean", choices=LOSS_AGG_MODES)
    #: The constant of `seq-mean-token-sum-norm`.
    rollout_max_response_len: int = option("rollout_max_response_len", 16, convert=int, minimum=1)
    #: "token": PPO's ratio per token; "sequence": one ratio per sample, `exp(mean over its tokens of (lp -
    #: old))`, shared by its tokens (GSPO). Set from the advantage estimator unless `--importance-ratio-level`.
    importance_ratio_level: str = option("importance_ratio_level", "token", choices=RATIO_LEVELS)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tis_clip_low >= self.tis_clip:
            raise ValueError(f"--tis-clip-low ({self.tis_clip_low}) must be below --tis-clip ({self.tis_clip})")

    @classmethod
    def from_args(cls, args: Any) -> LossSettings:
        """The settings of `args`; `--calculate-per-token-loss` (upstream's spelling) selects token-mean, and
        `--kl-loss-coef` weighs nothing without `--use-kl-loss` (as upstream)."""
        values = options_from_args(cls, args)
        if not getattr(args, "use_kl_loss", False):
            values.pop("kl_loss_coef", None)
        if getattr(args, "calculate_per_token_loss", False):
            if values.get("loss_agg_mode", "seq-mean-token-mean") not in ("seq-mean-token-mean", "token-mean"):
                raise ValueError(
                    f"--calculate-per-token-loss means --loss-agg-mode token-mean; it contradicts "
                    f"--loss-agg-mode {values['loss_agg_mode']}"
                )
            values["loss_agg_mode"] = "token-mean"
        return cls(**values)

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads the reference model's log-probs (a KL loss or a KL penalty in the reward)."""
        return bool(self.kl_loss_coef or self.kl_reward_coef)

    @property
    def per_token_denominator(self) -> bool:
        """Whether a global batch's loss divides by its token count (token-mean) rather than its sample count."""
        return self.loss_agg_mode == "token-mean"

    def reduce_tokens(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each sample's share of the batch loss from its `[batch, len]` token losses: the masked mean, or sum, or
        sum over the constant, per `loss_agg_mode`; the backend then divides the batch's total by its sample
        count, or by its token count when `per_token_denominator`."""
        if self.loss_agg_mode == "seq-mean-token-mean":
            return masked_mean(per_token, mask)
        total = (per_token * mask.to(per_token.dtype)).sum(-1)
        if self.loss_agg_mode == "seq-mean-token-sum-norm":
            return total / float(self.rollout_max_response_len)
        return total

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The `METRIC_NAMES` a backend reports for this loss (the TIS ones only with `--use-tis`)."""
        return tuple(name for name in METRIC_NAMES if self.use_tis or name not in TIS_METRIC_NAMES)

    @property
    def needs_advantages(self) -> bool:
        """Whether the loss's gradient is zero when every advantage the batch builder gave is: true unless a KL
        term (in the loss or in the reward) or an entropy bonus acts on the policy regardless of them. The
        backends skip an optimizer step without signal only then: skipping it with an entropy bonus would leave
        a policy that has stopped exploring (every group answering alike) stuck, with nothing left to push it
        back."""
        return not (self.needs_reference or self.entropy_coef)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Mean of `values` over `dim` counting only masked-in tokens; 0 for a row with no token in the mask."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def token_log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token under `logits` (`[..., vocab]` against `[...]`) and the entropy of
    each position's distribution, from one log-softmax, in float32."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token: `max(-A * r, -A * clip(r, 1 - eps, 1 + eps_high))`, `r = exp(lp - old)`.

    Returns `(loss, clipped)`: both token-level; `clipped` is 1.0 where the clipped branch was taken (it
    changed the value), so `masked_mean(clipped, mask)` is the clip fraction. `advantages` broadcasts:
    `[batch, 1]` for one advantage per sample, `[batch, len]` for per-token advantages.
    """
    if eps_clip < 0 or (eps_clip_high is not None and eps_clip_high < 0):
        raise ValueError(f"--eps-clip must be non-negative, got {eps_clip} (high {eps_clip_high})")
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).to(log_probs.dtype)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens.

    k1: `lp - ref` (unbiased, high variance, can be negative); k2: `(lp - ref)^2 / 2`; k3 (also
    "low_var_kl"): `exp(ref - lp) - (ref - lp) - 1` (unbiased, always >= 0). All are exactly 0 where the
    policy equals the reference.
    """
    delta = log_probs - ref_log_probs
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator in ("k3", "low_var_kl"):
        # Clamped as in common practice: exp of a large positive log-ratio would overflow float32.
        neg = (-delta).clamp(-20.0, 20.0)
        return torch.exp(neg) - neg - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; use one of {', '.join(KL_ESTIMATORS)} (--kl-loss-type)")


def importance_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, settings: LossSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights correcting for the engine sampling from a slightly different policy than the trainer's.

    The engine (its kernels, precision, or weights a version behind) drew each token with probability `mu`; the
    loss assumes the old policy `pi_old`. The ratio `w = pi_old / mu = exp(old - rollout)` reweights the policy
    loss so its expectation is under `pi_old`; an unbounded `w` has unbounded variance, so `truncate` clamps it
    to `[tis_clip_low, tis_clip]` and `mask` sets tokens outside that range to 0 (drops them). Returns
    `(weights, out_of_range)`, both `[batch, len]` and free of gradient; `out_of_range` is 1.0 where the bound
    acted, so its masked mean is the clipped fraction.
    """
    with torch.no_grad():
        ratio = torch.exp((old_log_probs - rollout_log_probs).clamp(-20.0, 20.0))
        out_of_range = (ratio > settings.tis_clip) | (ratio < settings.tis_clip_low)
        if settings.tis_mode == "truncate":
            weights = ratio.clamp(settings.tis_clip_low, settings.tis_clip)
        else:
            weights = torch.where(out_of_range, torch.zeros_like(ratio), ratio)
    return weights, out_of_range.to(ratio.dtype)


def rl_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    entropy: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-sample loss of a micro batch and its metrics.

    Token-level inputs are `[batch, len]`: the policy's `log_probs` (differentiable), the old policy's,
    per-token `advantages`, the loss `mask`, the policy's `entropy` (needed when `settings.entropy_coef` is
    not 0), the reference's log-probs (needed when `settings.kl_loss_coef` is not 0) and the engine's log-probs of
    the sampled tokens (needed with `settings.use_tis`). Returns `(sample_loss, metrics)`: `sample_loss[b]` is
    sample b's `settings.reduce_tokens` (by default the masked mean) of `w * pg + kl_loss_coef * kl - entropy_coef *
    entropy` (differentiable; `w` the `importance_weights`, 1 without `--use-tis`); `metrics[k, b]` is its
    masked mean of `METRIC_NAMES[k]` (detached).
    """
    if settings.kl_loss_coef and ref_log_probs is None:
        raise ValueError(
            "--use-kl-loss --kl-loss-coef > 0 needs the reference model's log-probs; the backend passed none"
        )
    if settings.entropy_coef and entropy is None:
        raise ValueError("--entropy-coef needs the policy's entropy; the backend passed none")
    if settings.use_tis and rollout_log_probs is None:
        raise ValueError(
            "--use-tis needs the engines' log-probs of the sampled tokens (rollout_log_probs); this batch has "
            "none: use an engine and rollout function that return them, or drop --use-tis"
        )
    policy_log_probs = log_probs
    if settings.importance_ratio_level == "sequence":
        # GSPO: every token of a sample takes the sample's length-normalised log-ratio, so the ratio (and its clip)
        # is one per sequence; the gradient still flows to every token through the mean.
        sequence_log_ratio = masked_mean(log_probs - old_log_probs, mask)
        policy_log_probs = old_log_probs + sequence_log_ratio.unsqueeze(-1)
    pg_tok, clipped = policy_loss(
        policy_log_probs, old_log_probs, advantages, settings.eps_clip, settings.eps_clip_high
    )
    tis_weight, tis_clipped = torch.ones_like(pg_tok), torch.zeros_like(pg_tok)
    if settings.use_tis:
        tis_weight, tis_clipped = importance_weights(old_log_probs, rollout_log_probs, settings)
        pg_tok = tis_weight * pg_tok
    per_token = pg_tok
    kl_tok = torch.zeros_like(pg_tok)
    if ref_log_probs is not None:
        kl_tok = kl_penalty(log_probs, ref_log_probs, settings.kl_loss_type)
        per_token = per_token + settings.kl_loss_coef * kl_tok
    if settings.entropy_coef:
        # An entropy bonus keeps sampling diverse: a policy that answers a prompt the same way eight times
        # gives GRPO a zero-variance group and nothing to learn from.
        per_token = per_token - settings.entropy_coef * entropy
    sample_loss = settings.reduce_tokens(per_token, mask)
    with torch.no_grad():
        ratio = torch.exp(policy_log_probs - old_log_probs)
        shown_entropy = entropy if entropy is not None else torch.zeros_like(pg_tok)
        terms = (per_token, pg_tok, kl_tok, clipped, ratio, shown_entropy, tis_weight, tis_clipped)
        metrics = torch.stack([masked_mean(values.detach().float(), mask) for values in terms])
    return sample_loss, metrics


def kl_shaped_advantages(
    advantages: Sequence[torch.Tensor],
    old_log_probs: Sequence[torch.Tensor],
    ref_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    settings: LossSettings,
) -> tuple[list[torch.Tensor], list[float]]:
    """`--kl-coef`: the per-token advantages with a KL penalty in the reward, and each sample's total penalty.

    Every response token t the loss counts earns the reward `-kl_coef * kl_t`, `kl_t` the `--kl-loss-type`
    estimate of KL(old policy || reference) at that token; with no discount, the return from token t on gains
    the penalties of t and every later counted token. So token t's advantage becomes
    `A_t - kl_coef * sum_{s >= t} mask_s * kl_s`: the estimator's advantage (from the sequence reward, e.g.
    GRPO's group-normalised one) minus the KL still to come. The old policy, not the one being trained, is
    what drew the tokens, so the penalty is fixed for the step and carries no gradient. Inputs are one 1-D
    tensor per sample, of its response length; returns `(advantages, penalties)`, `penalties[i]` being
    `kl_coef * sum_t mask_t * kl_t` of sample i (what its reward lost).
    """
    coef = settings.kl_reward_coef
    shaped, penalties = [], []
    with torch.no_grad():
        for advantage, old, ref, mask in zip(advantages, old_log_probs, ref_log_probs, loss_masks, strict=True):
            old, ref, mask = old.float().cpu(), ref.float().cpu(), mask.float().cpu()
            token_penalty = coef * kl_penalty(old, ref, settings.kl_loss_type) * mask
            to_go = token_penalty.flip(0).cumsum(0).flip(0)
            shaped.append(advantage.float().cpu() - to_go)
            penalties.append(float(token_penalty.sum()))
    return shaped, penalties


def pad_right(rows: Sequence[torch.Tensor], value: float = 0.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stack 1-D tensors of different lengths into `[len(rows), max_len]`, padding on the right."""
    width = max((int(row.numel()) for row in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=dtype or (rows[0].dtype if rows else torch.float32))
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out
