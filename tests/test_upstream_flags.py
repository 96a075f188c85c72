"""Upstream slime's spellings of flags this project has under other names: each lands where this project reads it,
and a combination that would mean two things is refused at parse time, naming both flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime.plugins.rl_losses import LossSettings
from slime.utils.arguments import parse_args
from slime.utils.upstream_flags import NOT_IMPLEMENTED


def _parse(tmp_path, *flags: str):
    base = ["--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(tmp_path / "p.jsonl")]
    return parse_args([*base, "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", *flags])


def _refused(tmp_path, capsys, *flags: str) -> str:
    with pytest.raises(SystemExit):
        _parse(tmp_path, *flags)
    return capsys.readouterr().err


def test_a_flag_set_in_upstreams_spelling_lands_where_this_project_reads_it(tmp_path):
    args = _parse(
        tmp_path,
        *("--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl"),
        *("--disable-rewards-normalization", "--disable-grpo-std-normalization"),
        *("--num-steps-per-rollout", "4", "--calculate-per-token-loss", "--balance-data"),
        *("--use-tis", "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--entropy-coef", "0.0"),
    )
    assert args.rewards_normalization is False and args.grpo_std_normalization is False
    assert args.global_batch_size == 8 * 4 // 4
    loss = LossSettings.from_args(args)
    assert (loss.kl_loss_coef, loss.kl_reward_coef, loss.kl_loss_type, loss.loss_agg_mode, loss.use_tis) == (
        0.01,
        0.0,
        "low_var_kl",
        "token-mean",
        True,
    )
    assert (loss.eps_clip, loss.eps_clip_high) == (0.2, 0.28)
    assert args.balance_data is True


def test_ref_load_names_the_kl_reference_and_is_checked_only_when_a_kl_loss_reads_it(tmp_path, capsys, caplog):
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "config.json").write_text('{"model_type": "qwen2"}')
    kl_loss = ("--use-kl-loss", "--kl-loss-coef", "0.01")
    # An upstream script passes its Megatron checkpoint with a KL weight of 0: nothing reads it, so it stays a note.
    with caplog.at_level("INFO"):
        args = _parse(tmp_path, "--ref-load", str(tmp_path / "ref_torch_dist"))
    assert args.ref_load == str(tmp_path / "ref_torch_dist")
    assert "is not loaded: the run has no KL term" in caplog.text
    error = _refused(tmp_path, capsys, "--ref-load", str(tmp_path / "ref_torch_dist"), *kl_loss)
    assert f"slime-run: error: --ref-load {tmp_path / 'ref_torch_dist'} is not a Hugging Face model directory" in error
    error = _refused(tmp_path, capsys, "--ref-load", str(reference), *kl_loss)
    assert f"--ref-load {reference} is not a usable Hugging Face model directory" in error
    assert "no model weights" in error and "tokenizer" not in error.split("Fix:")[0]  # a reference needs no tokenizer
    (reference / "model.safetensors").write_bytes(_EMPTY_SAFETENSORS)
    assert _parse(tmp_path, "--ref-load", str(reference), *kl_loss).ref_load == str(reference)
    # A KL penalty in the reward reads the reference too.
    error = _refused(tmp_path, capsys, "--ref-load", str(tmp_path / "ref_torch_dist"), "--kl-coef", "0.01")
    assert "is not a Hugging Face model directory" in error


#: A valid safetensors file holding no tensors: an 8-byte header length, then the header `{}` padded to 8 bytes.
_EMPTY_SAFETENSORS = (8).to_bytes(8, "little") + b"{}      "


def test_this_projects_own_spellings_still_work(tmp_path):
    args = _parse(tmp_path, "--no-rewards-normalization", "--kl-coef", "0.05", "--global-batch-size", "16")
    assert args.rewards_normalization is False and args.grpo_std_normalization is True
    assert args.global_batch_size == 16


def test_kl_coef_is_the_reward_penalty_and_kl_loss_coef_the_loss_term_as_upstream(tmp_path):
    loss = LossSettings.from_args(_parse(tmp_path, "--kl-coef", "0.05"))
    assert (loss.kl_reward_coef, loss.kl_loss_coef, loss.needs_reference, loss.needs_advantages) == (
        0.05,
        0.0,
        True,
        False,
    )
    # --kl-loss-coef weighs nothing without --use-kl-loss, as upstream.
    loss = LossSettings.from_args(_parse(tmp_path, "--kl-loss-coef", "0.3"))
    assert (loss.kl_loss_coef, loss.needs_reference) == (0.0, False)
    # Both at once, as upstream allows: each keeps its own weight.
    loss = LossSettings.from_args(_parse(tmp_path, "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-coef", "0.1"))
    assert (loss.kl_loss_coef, loss.kl_reward_coef) == (0.01, 0.1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--kl-coef", "-0.1"), "--kl-coef must be >= 0.0, got -0.1"),
        (("--num-steps-per-rollout", "3"), "--num-steps-per-rollout 3 does not divide a rollout's 32 samples"),
        (
            ("--num-steps-per-rollout", "2", "--global-batch-size", "8"),
            "--num-steps-per-rollout 2 means --global-batch-size 16, not 8: give one of them",
        ),
        (("--num-steps-per-rollout", "0"), "--num-steps-per-rollout"),
    ],
)
def test_spellings_that_disagree_are_refused_naming_both(tmp_path, capsys, flags, message):
    assert message in _refused(tmp_path, capsys, *flags)


@pytest.mark.parametrize("flag", sorted(NOT_IMPLEMENTED))
def test_an_upstream_flag_not_implemented_here_is_refused_saying_why(tmp_path, capsys, flag):
    error = _refused(tmp_path, capsys, flag, "x")
    assert f"slime-run: error: {flag} (upstream slime): {NOT_IMPLEMENTED[flag]}" in error
    assert "Traceback" not in error


def test_the_docs_list_every_refused_flag_with_its_reason():
    text = (Path(__file__).resolve().parents[1] / "docs" / "upstream.md").read_text()
    for flag, why in NOT_IMPLEMENTED.items():
        assert f"| `{flag}` | {why.replace('--release-train', '`--release-train`')}" in text.replace(
            "(`--hf-checkpoint`)", "(--hf-checkpoint)"
        ), flag
