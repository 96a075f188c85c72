"""`--train-backend megatron` refuses, when the arguments are parsed (before Ray starts), what it cannot run here.

These need no megatron-core: the checks that do (layout against the model) are in tests/megatron_backend.
"""

from __future__ import annotations

import pytest
import torch

from slime.plugins.megatron_backend import cpu_compat
from slime.utils.arguments import parse_args

BASE = ["--train-backend", "megatron", "--plugin", "straw"]


def _refused(capsys: pytest.CaptureFixture, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*BASE, *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "slime-run: error:" in err and "Traceback" not in err
    return err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only refusals")
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--sequence-parallel"], "--sequence-parallel needs a GPU"),
        (["--context-parallel-size", "2"], "--context-parallel-size > 1 needs a GPU"),
    ],
)
def test_what_needs_a_gpu_is_refused_on_cpu_with_the_reason(capsys, argv, expected):
    assert expected in _refused(capsys, *argv)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--expert-model-parallel-size", "2"], "dense Qwen2, Qwen3 and Llama families, which have no experts"),
        (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
        (["--recompute-method", "block"], "--recompute-method applies to --recompute-granularity full only"),
        (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1, got 0"),
    ],
)
def test_inconsistent_options_are_refused(capsys, argv, expected):
    assert expected in _refused(capsys, *argv)


def test_another_megatron_core_version_is_refused_naming_both(capsys, monkeypatch):
    monkeypatch.setattr(cpu_compat, "_installed_megatron_core_version", lambda: "0.15.2")
    err = _refused(capsys)
    assert "needs megatron-core==0.16.1, found 0.15.2" in err and "pip install 'slime-rl[megatron]'" in err


def test_a_missing_megatron_core_is_refused_with_the_install_command(capsys, monkeypatch):
    monkeypatch.setattr(cpu_compat, "_installed_megatron_core_version", lambda: None)
    assert "found not installed" in _refused(capsys)


def test_a_ref_load_of_another_architecture_is_refused_naming_each_difference():
    from types import SimpleNamespace

    from slime.plugins.megatron_backend.settings import check_same_architecture

    policy = SimpleNamespace(model_type="qwen3", vocab_size=151936, hidden_size=1024, num_hidden_layers=28)
    check_same_architecture(policy, SimpleNamespace(**vars(policy)), "/ckpt/same")
    other = SimpleNamespace(**{**vars(policy), "hidden_size": 2048, "num_hidden_layers": 36})
    with pytest.raises(ValueError, match=r"--ref-load /ckpt/4b is not the policy's architecture") as refused:
        check_same_architecture(policy, other, "/ckpt/4b")
    assert "hidden_size 2048 (policy: 1024), num_hidden_layers 36 (policy: 28);" in str(refused.value)
