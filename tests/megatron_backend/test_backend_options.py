"""`--train-backend megatron` checks the model and the layout when the arguments are parsed, before Ray starts,
and names the numbers (megatron-core must be installed: the checks read its layout rules)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from slime.plugins.tiny_model import ensure_tiny_model
from slime.utils.arguments import parse_args

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("options") / "model")


def _refused(capsys: pytest.CaptureFixture, model: Path, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--plugin", "straw", "--train-backend", "megatron", "--hf-checkpoint", str(model), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "slime-run: error:" in err and "Traceback" not in err
    return err


def test_a_valid_layout_parses(model_dir):
    args = parse_args(
        ["--plugin", "straw", "--train-backend", "megatron", "--hf-checkpoint", str(model_dir)]
        + ["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"]
    )
    assert args.tensor_model_parallel_size == 2


def test_an_unsupported_family_names_it_and_the_supported_ones(capsys, model_dir, tmp_path):
    other = tmp_path / "mistral"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "mistral", "architectures": ["X"]}))
    err = _refused(capsys, other)
    assert f"--hf-checkpoint {other}: the Megatron backend does not support model_type" in err
    assert "supported families: qwen2, qwen3, llama" in err


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_names_the_numbers(capsys, model_dir):
    err = _refused(capsys, model_dir, "--actor-num-gpus-per-node", "3", "--tensor-model-parallel-size", "3")
    assert "3" in err and "4" in err and "heads" in err


def test_a_layout_that_does_not_divide_the_ranks_names_them(capsys, model_dir):
    err = _refused(capsys, model_dir, "--tensor-model-parallel-size", "2")
    assert "1 training ranks cannot be split into --tensor-model-parallel-size 2" in err
