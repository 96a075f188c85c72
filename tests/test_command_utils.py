"""The local launcher: commands it issues, verbatim options, probes that tolerate missing programs."""

from __future__ import annotations

import json
import shlex
import subprocess
from types import SimpleNamespace

import pytest

from slime.utils.external_utils import command_utils


@pytest.fixture
def launcher(monkeypatch):
    commands: list[str] = []
    probes: list[list[str]] = []

    def fake_run(command, *args, **kwargs):
        probes.append(command)
        return SimpleNamespace(returncode=1, stdout="")

    monkeypatch.setattr(command_utils, "exec_command", commands.append)
    monkeypatch.setattr(command_utils.subprocess, "run", fake_run)
    monkeypatch.setenv("SLIME_SCRIPT_EXTERNAL_RAY", "0")
    monkeypatch.setenv("SLIME_SCRIPT_ENABLE_RAY_SUBMIT", "1")
    return SimpleNamespace(commands=commands, probes=probes)


@pytest.mark.parametrize(
    "options",
    ["", "--rollout-data-transport straw", "--save /x/ckpt --rollout-data-dir /x/pool --load /x/ckpt"],
)
def test_options_pass_verbatim_and_no_storage_path_is_added(launcher, options):
    command_utils.execute_train(options, num_gpus_per_node=0, megatron_model_type=None)
    last = launcher.commands[-1]
    assert last.startswith("ray job submit ")
    assert last.endswith(f"-- python3 train.py {options}")
    for flag in ("--save", "--rollout-data-dir", "--load", "--update-weight-disk-dir"):
        assert last.count(flag) == options.count(flag)
    # A local head is started (no cluster was running, so nothing is stopped first).
    assert [c.split()[:3] for c in launcher.commands[:-1]] == [["ray", "start", "--head"]]


def test_running_cluster_is_stopped_before_a_fresh_head(launcher, monkeypatch):
    monkeypatch.setattr(command_utils.subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=0, stdout=""))
    command_utils.execute_train("--num-rollout 2", num_gpus_per_node=0, megatron_model_type=None)
    assert launcher.commands[0] == "ray stop --force"
    assert launcher.commands[1].startswith("ray start --head")


def test_external_ray_is_used_as_is(launcher, monkeypatch):
    monkeypatch.setenv("SLIME_SCRIPT_EXTERNAL_RAY", "true")
    command_utils.execute_train("--num-rollout 2", num_gpus_per_node=0, megatron_model_type=None)
    assert len(launcher.commands) == 1 and launcher.commands[0].startswith("ray job submit")
    assert launcher.probes == []


def test_runtime_env_carries_gpu_settings_and_extra_variables(launcher, monkeypatch):
    monkeypatch.setattr(command_utils, "check_has_nvlink", lambda: True)
    command_utils.execute_train("", num_gpus_per_node=8, megatron_model_type=None, extra_env_vars={"FOO": "a b"})
    tokens = shlex.split(launcher.commands[-1])
    runtime_env = json.loads(next(t for t in tokens if t.startswith("--runtime-env-json=")).split("=", 1)[1])
    assert runtime_env["env_vars"]["NCCL_NVLS_ENABLE"] == "1"
    assert runtime_env["env_vars"]["FOO"] == "a b"
    assert "--num-gpus 8" in launcher.commands[0]


def test_direct_run_without_ray_submit(launcher, monkeypatch):
    monkeypatch.setenv("SLIME_SCRIPT_ENABLE_RAY_SUBMIT", "0")
    called = []
    command_utils.execute_train(
        "--save /x", num_gpus_per_node=0, megatron_model_type=None, before_ray_job_submit=lambda: called.append(1)
    )
    assert called == [1]
    assert launcher.commands[-1].startswith("env PYTHONUNBUFFERED=1 python3 train.py --save /x")


def test_model_script_is_sourced_or_missing_one_is_named(launcher, tmp_path):
    config = command_utils.LaunchConfig(model_scripts_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="qwen.sh"):
        command_utils.execute_train("", 0, "qwen", config=config)
    assert not any("job submit" in c for c in launcher.commands)
    (tmp_path / "qwen.sh").write_text("MODEL_ARGS=(--num-layers 2)\n")
    command_utils.execute_train("--x 1", 0, "qwen", config=config)
    assert launcher.commands[-1].startswith(f"source {tmp_path / 'qwen.sh'} && ray job submit")
    assert launcher.commands[-1].endswith('python3 train.py "${MODEL_ARGS[@]}" --x 1')


def test_probes_treat_failures_and_missing_programs_as_absent(monkeypatch):
    monkeypatch.setattr(
        command_utils.subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=0, stdout="GPU0 X NV12\n")
    )
    assert command_utils.check_has_nvlink()
    monkeypatch.setattr(
        command_utils.subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=0, stdout="GPU0 X PIX\n")
    )
    assert not command_utils.check_has_nvlink()

    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(command_utils.subprocess, "run", missing)
    assert not command_utils.check_has_nvlink()
    assert not command_utils.ray_is_running()


def test_exec_command_fails_loudly_and_captures_output():
    assert command_utils.exec_command("echo hello", capture_output=True) == "hello\n"
    with pytest.raises(subprocess.CalledProcessError):
        command_utils.exec_command("exit 3")
