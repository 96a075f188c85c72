"""Launching a training job on a local Ray cluster, for test scripts and examples.

`execute_train(train_args, ...)` (re)starts a single-node Ray head (unless `SLIME_SCRIPT_EXTERNAL_RAY` says a
cluster is already there) and submits `python3 train.py <train_args>` as a Ray job. The launcher passes
`train_args` through verbatim: it never adds storage paths (`--save`, `--rollout-data-dir`, ...); where a
run's data and checkpoints live is the caller's decision, made explicitly.

Every shell command goes through `exec_command`; probes of the machine (`ray status`, `nvidia-smi`) go
through `subprocess.run` and treat a non-zero exit status as "not there".
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

TRUE_VALUES = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class LaunchConfig:
    """Where the launcher finds things: the Ray dashboard (job server) and the `<model type>.sh` scripts."""

    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = 8265
    model_scripts_dir: str = "scripts/models"


def exec_command(cmd: str, capture_output: bool = False) -> str | None:
    """Run `cmd` in bash; raise `subprocess.CalledProcessError` when it fails; optionally return its stdout."""
    logger.info("exec: %s", cmd)
    result = subprocess.run(["bash", "-c", cmd], check=True, capture_output=capture_output, text=True)
    return result.stdout if capture_output else None


def _env_flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() in TRUE_VALUES


def _probe(command: list[str]) -> subprocess.CompletedProcess | None:
    """Run a probe; None when the program is missing or exits non-zero."""
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except (FileNotFoundError, PermissionError):
        return None
    return result if result.returncode == 0 else None


def check_has_nvlink() -> bool:
    """True when `nvidia-smi topo -m` shows NVLink connections between GPUs."""
    result = _probe(["nvidia-smi", "topo", "-m"])
    return result is not None and re.search(r"\bNV\d+\b", result.stdout or "") is not None


def ray_is_running() -> bool:
    """True when `ray status` finds a running cluster on this machine."""
    return _probe(["ray", "status"]) is not None


def execute_train(
    train_args: str,
    num_gpus_per_node: int,
    megatron_model_type: str | None,
    train_script: str = "train.py",
    before_ray_job_submit: Callable[[], None] | None = None,
    extra_env_vars: Mapping[str, str] | None = None,
    config: LaunchConfig | None = None,
) -> None:
    """Start (or reuse) Ray and run `python3 <train_script> <train_args>` on it.

    `megatron_model_type` names `<config.model_scripts_dir>/<type>.sh`, which defines the bash array
    `MODEL_ARGS` placed before `train_args`. `SLIME_SCRIPT_EXTERNAL_RAY=1` uses the running cluster as is;
    `SLIME_SCRIPT_ENABLE_RAY_SUBMIT=0` runs the script directly instead of as a Ray job.
    """
    config = config or LaunchConfig()
    if not _env_flag("SLIME_SCRIPT_EXTERNAL_RAY", "0"):
        if ray_is_running():
            exec_command("ray stop --force")
        exec_command(
            f"ray start --head --node-ip-address {config.dashboard_host} --num-gpus {int(num_gpus_per_node)} "
            f"--dashboard-host {config.dashboard_host} --dashboard-port {config.dashboard_port} "
            "--disable-usage-stats"
        )
    env_vars = {"PYTHONUNBUFFERED": "1"}
    if num_gpus_per_node > 0:
        env_vars["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        env_vars["NCCL_NVLS_ENABLE"] = str(int(check_has_nvlink()))
    env_vars.update(extra_env_vars or {})

    prefix, model_args = "", ""
    if megatron_model_type:
        script = Path(config.model_scripts_dir) / f"{megatron_model_type}.sh"
        if not script.is_file():
            raise FileNotFoundError(
                f"model script {script} not found; pass an existing megatron_model_type or set "
                "LaunchConfig.model_scripts_dir"
            )
        prefix, model_args = f"source {shlex.quote(str(script))} && ", '"${MODEL_ARGS[@]}" '
    if before_ray_job_submit is not None:
        before_ray_job_submit()

    script_command = f"python3 {shlex.quote(train_script)} {model_args}{train_args}"
    if _env_flag("SLIME_SCRIPT_ENABLE_RAY_SUBMIT", "1"):
        runtime_env = shlex.quote(json.dumps({"env_vars": env_vars}))
        address = f"http://{config.dashboard_host}:{config.dashboard_port}"
        exec_command(f"{prefix}ray job submit --address={address} --runtime-env-json={runtime_env} -- {script_command}")
    else:
        exports = " ".join(f"{key}={shlex.quote(value)}" for key, value in env_vars.items())
        exec_command(f"{prefix}env {exports} {script_command}")
