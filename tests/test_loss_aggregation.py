"""`--loss-agg-mode` (and `--calculate-per-token-loss`): how token losses make a batch's loss, by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_torch_backend import hf_dir, make_args, make_batch, start  # noqa: F401  (hf_dir: a fixture)

from slime.plugins.rl_losses import LossSettings, rl_loss
from slime.plugins.train_batch import TrainBatch
from slime.utils.arguments import parse_args

# Two samples: one token of loss 6, and three tokens of loss 1, 2, 3 (a fourth token masked out, loss 100).
PER_TOKEN = torch.tensor([[6.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 100.0]])
MASK = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])


def _batch_loss(mode: str) -> float:
    """The batch's loss as the backends make it: samples' shares summed, over the samples or the tokens."""
    settings = LossSettings(loss_agg_mode=mode, rollout_max_response_len=4)
    shares = settings.reduce_tokens(PER_TOKEN, MASK)
    denominator = MASK.sum().item() if settings.per_token_denominator else len(PER_TOKEN)
    return shares.sum().item() / denominator


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("seq-mean-token-mean", (6 / 1 + 6 / 3) / 2),  # every sample weighs the same: 4.0
        ("token-mean", (6 + 1 + 2 + 3) / 4),  # every token weighs the same: 3.0
        ("seq-mean-token-sum", (6 + 6) / 2),  # 6.0
        ("seq-mean-token-sum-norm", (6 / 4 + 6 / 4) / 2),  # the sums over the constant 4: 1.5
    ],
)
def test_each_mode_aggregates_as_computed_by_hand(mode: str, expected: float) -> None:
    assert _batch_loss(mode) == pytest.approx(expected)


def test_rl_loss_reduces_with_the_mode_but_reports_token_means() -> None:
    # Advantage 1, policy = old policy: every token's policy loss is -1.
    log_probs, advantages = torch.zeros(2, 4), torch.ones(2, 4)
    summed, metrics = rl_loss(log_probs, log_probs, advantages, MASK, LossSettings(loss_agg_mode="seq-mean-token-sum"))
    assert summed.tolist() == [-1.0, -3.0]
    meaned, same_metrics = rl_loss(log_probs, log_probs, advantages, MASK, LossSettings())
    assert meaned.tolist() == [-1.0, -1.0]
    assert torch.equal(metrics, same_metrics)  # the metrics are per-sample token means in every mode


def test_calculate_per_token_loss_is_token_mean_and_a_contradiction_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base = ["--plugin", "straw", "--save", str(tmp_path / "r")]
    assert LossSettings.from_args(parse_args([*base, "--calculate-per-token-loss"])).loss_agg_mode == "token-mean"
    assert LossSettings.from_args(parse_args(base)).loss_agg_mode == "seq-mean-token-mean"
    with pytest.raises(SystemExit) as exited:
        parse_args([*base, "--calculate-per-token-loss", "--loss-agg-mode", "seq-mean-token-sum"])
    assert exited.value.code == 2
    assert "--calculate-per-token-loss means --loss-agg-mode token-mean" in capsys.readouterr().err


def test_the_dr_grpo_constant_is_the_response_length_limit(tmp_path: Path) -> None:
    args = parse_args(["--plugin", "straw", "--save", str(tmp_path / "r"), "--rollout-max-response-len", "7"])
    assert LossSettings.from_args(args).rollout_max_response_len == 7
    with pytest.raises(ValueError, match="--rollout-max-response-len must be >= 1"):
        LossSettings(loss_agg_mode="seq-mean-token-sum-norm", rollout_max_response_len=0)


def test_the_torch_backend_divides_token_mean_by_the_tokens_in_the_loss_mask(hf_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    data = make_batch()
    data["loss_masks"][1] = torch.tensor([1, 0, 0], dtype=torch.int32)  # 3 + 1 + 3 + 3 tokens count
    batch = TrainBatch.from_data(data)
    token_mean, _ = start(make_args(hf_dir, tmp_path / "t", loss_agg_mode="token-mean"))
    assert token_mean._loss_denominator(batch, [[0, 1], [2, 3]], global_size=4) == 10.0
    sample_mean, _ = start(make_args(hf_dir, tmp_path / "s"))
    assert sample_mean._loss_denominator(batch, [[0, 1], [2, 3]], global_size=4) == 4.0
    metrics = token_mean.train_from_data(0, data)
    assert torch.isfinite(torch.tensor(metrics["train/loss"])) and metrics["train/steps"] == 1.0
