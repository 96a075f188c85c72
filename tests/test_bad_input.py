"""Bad input fails clearly and leaves no checkpoint a rerun could take for good (issue #8).

(a) a model directory without weights, tokenizer or config; (b) a malformed prompt file; (c) a port in use;
(d) an engine that fails to start; (e) after each failure `--save` holds no `latest_checkpointed_iteration.txt`,
`iter_*` or joint commit marker. The command-line tests run the real `slime-run` in its own process group.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime.plugins.tiny_model import ensure_tiny_model
from slime.train import check_run_inputs
from slime.utils.arguments import parse_args
from slime.utils.hf_checkpoint import validate_hf_checkpoint_dir

GOOD_ROWS = [{"input": "copy: ab =", "label": "ab"}, {"input": "copy: cd =", "label": "cd"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _copy_model(model_dir: Path, destination: Path, *, drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(model_dir, destination)
    for name in drop:
        (destination / name).unlink()
    return destination


def _prompts(path: Path, text: str | None = None) -> Path:
    path.write_text(text if text is not None else "".join(json.dumps(row) + "\n" for row in GOOD_ROWS))
    return path


def _run_args(model: Path, prompts: Path, save: Path, *extra: str) -> list[str]:
    return [
        "--plugin",
        "straw",
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(prompts),
        "--rm-type",
        "copy",
        "--label-key",
        "label",
        "--save",
        str(save),
        *extra,
    ]


def _slime_run(argv: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "slime.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)
    return subprocess.CompletedProcess(process.args, process.returncode, output, "")


def _assert_no_checkpoint(save: Path) -> None:
    """Nothing under `save` that a rerun's checkpoint resolution would restore from."""
    found = [
        str(path.relative_to(save))
        for pattern in ("latest_checkpointed_iteration.txt", "iter_*", "committed_*.json")
        for path in save.rglob(pattern)
    ]
    assert found == []
    _, plan = parse_args(_run_args(save / "unused-model", save / "unused.jsonl", save), return_restore_plan=True)
    assert plan.mode == "new"


# ------------------------------------------------------------------------------------ (a) model directory


def test_complete_model_directory_passes(model_dir):
    assert validate_hf_checkpoint_dir(model_dir) == model_dir.resolve()


@pytest.mark.parametrize(
    ("drop", "expected"),
    [
        (("model.safetensors",), "no model weights: expected model.safetensors, pytorch_model.bin"),
        (("tokenizer.json",), "no tokenizer files: expected one of tokenizer.json"),
        (("config.json",), "no config.json"),
        (("model.safetensors", "tokenizer.json"), "no tokenizer files"),
    ],
)
def test_missing_model_files_are_named_with_the_directory_and_flag(model_dir, tmp_path, drop, expected):
    broken = _copy_model(model_dir, tmp_path / "broken", drop=drop)
    with pytest.raises(FileNotFoundError) as failure:
        validate_hf_checkpoint_dir(broken)
    message = str(failure.value)
    assert f"--hf-checkpoint {broken} is not a usable Hugging Face model directory" in message
    assert expected in message and "Fix: point --hf-checkpoint at a complete" in message
    if len(drop) == 2:
        assert "no model weights" in message  # every problem is reported at once


def test_missing_directory_and_unloadable_weight_names(model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory .does not exist."):
        validate_hf_checkpoint_dir(tmp_path / "nowhere")
    renamed = _copy_model(model_dir, tmp_path / "renamed")
    (renamed / "model.safetensors").rename(renamed / "weights.safetensors")
    with pytest.raises(FileNotFoundError, match=r"weights.safetensors found, but transformers loads only those names"):
        validate_hf_checkpoint_dir(renamed)


def test_truncated_or_corrupt_files_are_value_errors(model_dir, tmp_path):
    truncated = _copy_model(model_dir, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate(size - 100)
    with pytest.raises(
        ValueError, match=rf"model.safetensors is truncated: {size - 100} bytes, its header describes {size}"
    ):
        validate_hf_checkpoint_dir(truncated)
    garbage = _copy_model(model_dir, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    (garbage / "config.json").write_text('{"model_type": ')
    with pytest.raises(ValueError) as failure:
        validate_hf_checkpoint_dir(garbage)
    assert "config.json is not valid JSON" in str(failure.value)
    assert "model.safetensors is truncated or not safetensors" in str(failure.value)


def test_sharded_checkpoint_needs_every_shard(model_dir, tmp_path):
    sharded = _copy_model(model_dir, tmp_path / "sharded")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="names 2 shards; 1 missing: model-00002-of-00002.safetensors"):
        validate_hf_checkpoint_dir(sharded)
    shutil.copy(sharded / "model-00001-of-00002.safetensors", sharded / "model-00002-of-00002.safetensors")
    assert validate_hf_checkpoint_dir(sharded) == sharded.resolve()


@pytest.mark.parametrize(
    ("drop", "expected"), [("model.safetensors", "no model weights"), ("tokenizer.json", "no tokenizer")]
)
def test_slime_run_refuses_an_incomplete_model_before_ray_starts(model_dir, tmp_path, drop, expected):
    broken = _copy_model(model_dir, tmp_path / "user-model", drop=(drop,))
    save = tmp_path / "save"
    result = _slime_run(_run_args(broken, _prompts(tmp_path / "prompts.jsonl"), save), cwd=tmp_path)
    assert result.returncode != 0
    assert f"--hf-checkpoint {broken} is not a usable Hugging Face model directory" in result.stdout
    assert expected in result.stdout
    assert "Started a local Ray instance" not in result.stdout and "ray.init" not in result.stdout
    assert not save.exists()


# ------------------------------------------------------------------------------------- (b) prompt file


@pytest.mark.parametrize(
    ("text", "extra", "expected"),
    [
        (
            '{"input": "a", "label": "b"}\n{"input": "x", oops}\n',
            (),
            r"prompts.jsonl:2: not valid JSON \(Expecting property name .* at column 16\); each non-empty line",
        ),
        ('{"input": "a", "label": "b"}\n\n[1, 2]\n', (), r"prompts.jsonl:3: the row is a JSON list, not an object"),
        (
            '{"input": "a", "label": "b"}\n{"prompt": "a", "label": "b"}\n',
            (),
            r"prompts.jsonl:2: the row has no 'input' field \(--input-key input\); its fields are \['label', 'prompt'\]"
            r". Add the field to every row, or pass --input-key",
        ),
        (
            '{"q": "a", "label": "b"}\n{"q": "c"}\n',
            ("--input-key", "q"),
            r"prompts.jsonl:2: the row has no 'label' field \(--label-key label\).*or pass --label-key",
        ),
    ],
)
def test_malformed_prompt_lines_name_file_line_and_fix(model_dir, tmp_path, text, extra, expected):
    prompts = _prompts(tmp_path / "prompts.jsonl", text)
    args = parse_args(_run_args(model_dir, prompts, tmp_path / "save", *extra))
    with pytest.raises((ValueError, KeyError), match=expected) as failure:
        check_run_inputs(args)
    assert str(prompts) in str(failure.value)
    assert not (tmp_path / "save").exists()


def test_prompt_check_applies_to_the_object_store_run_and_parquet(model_dir, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    prompts = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{"input": "a", "label": "b"}, {"input": "c", "label": None}]), prompts)
    argv = _run_args(model_dir, prompts, tmp_path / "save", "--label-key", "answer")[2:]  # no --plugin straw
    args = parse_args(argv)
    assert args.data_source_path == "prompts"
    with pytest.raises(KeyError, match=r"prompts.parquet row 1: the row has no 'answer' field \(--label-key answer\)"):
        check_run_inputs(args)


def test_slime_run_refuses_a_malformed_prompt_file_before_ray_starts(model_dir, tmp_path):
    prompts = _prompts(tmp_path / "prompts.jsonl", '{"input": "a", "label": "b"}\nnot json\n')
    save = tmp_path / "save"
    result = _slime_run(_run_args(model_dir, prompts, save), cwd=tmp_path)
    assert result.returncode != 0
    assert f"{prompts}:2: not valid JSON" in result.stdout
    assert "Started a local Ray instance" not in result.stdout
    assert not save.exists()


# ---------------------------------------------------------------------------------------- (c) ports


@pytest.fixture()
def busy_port():
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    yield holder.getsockname()[1]
    holder.close()


def test_engine_port_in_use_names_port_and_component_before_loading(tmp_path, busy_port):
    from slime.plugins.cpu_engine_server import EngineServer, PortInUseError

    # A directory that is no model: the port is taken first, so the port error wins over the load error.
    with pytest.raises(
        PortInUseError, match=rf"CPU engine HTTP server cannot listen on 127.0.0.1:{busy_port}: the port"
    ):
        EngineServer(str(tmp_path), port=busy_port)


@pytest.mark.slow
def test_sglang_router_port_in_use_names_port(busy_port):
    import errno

    from slime.ray.router import SGLangRouter, sglang_router_available

    if not sglang_router_available():
        pytest.skip("sglang-router is not installed (pip install 'slime-rl[router]')")
    with pytest.raises(OSError, match=rf"sglang-router cannot listen on 127.0.0.1:{busy_port}: the port is") as error:
        SGLangRouter(["http://127.0.0.1:1"], port=busy_port)
    assert error.value.errno == errno.EADDRINUSE


# ------------------------------------------------------------------------------ (d) engine start failures


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _unknown_architecture(model_dir: Path, destination: Path) -> Path:
    """A complete-looking directory whose config names an architecture transformers does not know."""
    broken = _copy_model(model_dir, destination)
    config = json.loads((broken / "config.json").read_text())
    config["model_type"] = "no-such-architecture"
    (broken / "config.json").write_text(json.dumps(config))
    return broken


@pytest.mark.slow
def test_engine_that_cannot_load_its_model_reports_address_and_log(ray_session, model_dir, tmp_path):
    from slime.plugins.cpu_engine import EngineStartError, launch_cpu_engines

    broken = _unknown_architecture(model_dir, tmp_path / "broken")
    logs = tmp_path / "logs"
    with pytest.raises(EngineStartError) as failure:
        launch_cpu_engines(SimpleNamespace(hf_checkpoint=str(broken), cpu_engine_log_dir=str(logs)), 2)
    message = str(failure.value)
    assert re.search(
        rf"CPU engine [12]/2 \(http://127\.0\.0\.1:\d+, pid \d+\) failed to start serving {broken}", message
    )
    assert "no-such-architecture" in message.split("--- last lines of its log")[0]
    log_path = re.search(r"--- last lines of its log (\S+) ---", message).group(1)
    assert Path(log_path).parent == logs and Path(log_path).is_file()
    tail = message.split(" ---\n", 1)[1]
    assert "listening on http://127.0.0.1:" in tail and "Traceback" in tail and "no-such-architecture" in tail


@pytest.mark.slow
def test_engine_process_that_dies_while_loading_reports_address_and_log(ray_session, model_dir, tmp_path):
    from slime.plugins.cpu_engine import EngineStartError, launch_cpu_engines

    logs = tmp_path / "logs"
    outcome: dict = {}

    def launch() -> None:
        try:
            outcome["engines"] = launch_cpu_engines(
                SimpleNamespace(hf_checkpoint=str(model_dir), cpu_engine_log_dir=str(logs)), 1
            )
        except Exception as exc:  # noqa: BLE001 - judged below
            outcome["error"] = exc

    thread = threading.Thread(target=launch)
    thread.start()
    deadline = time.monotonic() + 60
    pid = None
    while pid is None and time.monotonic() < deadline:
        # The engine logs its pid, then its address, before it imports torch and loads the model (seconds).
        for log in logs.glob("*.log"):
            found = re.search(r"pid (\d+), model .*\n.*listening on", log.read_text())
            pid = int(found.group(1)) if found else None
        time.sleep(0.005)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=120)
    if "engines" in outcome:
        outcome["engines"].shutdown()
    message = str(outcome.get("error"))
    assert isinstance(outcome.get("error"), EngineStartError), message
    assert re.search(rf"CPU engine 1/1 \(http://127\.0\.0\.1:\d+, pid {pid}\) failed to start serving", message)
    assert "ActorDiedError" in message and "listening on http://127.0.0.1:" in message.split("its log")[1]


@pytest.mark.slow
def test_engine_startup_timeout_names_the_flag(ray_session, model_dir, tmp_path):
    from slime.plugins.cpu_engine import EngineStartError, launch_cpu_engines

    args = SimpleNamespace(
        hf_checkpoint=str(model_dir), cpu_engine_log_dir=str(tmp_path), cpu_engine_startup_timeout=0.05
    )
    with pytest.raises(EngineStartError, match=r"did not come up within 0.05 s \(raise --cpu-engine-startup-timeout"):
        launch_cpu_engines(args, 1)


@pytest.mark.slow
def test_engine_log_captures_output_and_a_temporary_log_dir_is_removed(ray_session, model_dir):
    from slime.plugins.cpu_engine import launch_cpu_engines

    engines = launch_cpu_engines(SimpleNamespace(hf_checkpoint=str(model_dir)), 1)
    log_dir = Path(engines.temporary_log_dir)
    [log] = log_dir.glob("*.log")
    assert f"serving {model_dir} on {engines[0]}" in log.read_text()
    engines.shutdown()
    assert not log_dir.exists()


# ------------------------------------------------------------------- (d) + (e) through the whole command


@pytest.mark.slow
@pytest.mark.e2e
def test_slime_run_with_an_unloadable_model_reports_the_engine_and_writes_no_checkpoint(model_dir, tmp_path):
    broken = _unknown_architecture(model_dir, tmp_path / "user-model")
    save = tmp_path / "save"
    argv = _run_args(
        broken, _prompts(tmp_path / "prompts.jsonl"), save, "--rollout-num-engines", "1", "--num-rollout", "1"
    )
    result = _slime_run(argv, cwd=tmp_path, timeout=240)
    assert result.returncode != 0
    assert re.search(
        rf"EngineStartError: CPU engine 1/1 \(http://127\.0\.0\.1:\d+, pid \d+\) failed to start serving {broken}",
        result.stdout,
    )
    assert f"--- last lines of its log {save}/logs/cpu-engines/engine-" in result.stdout
    _assert_no_checkpoint(save)


def test_failed_validation_leaves_no_checkpoint(model_dir, tmp_path):
    """(e) for the start-up checks: nothing is written under --save, so a rerun starts fresh."""
    save = tmp_path / "save"
    args = parse_args(
        _run_args(
            _copy_model(model_dir, tmp_path / "m", drop=("tokenizer.json",)), _prompts(tmp_path / "p.jsonl"), save
        )
    )
    with pytest.raises(FileNotFoundError):
        check_run_inputs(args)
    assert not save.exists()
    _assert_no_checkpoint(save)


# ---------------------------------------------------------------------------------------- evaluation data


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--eval-interval", "2"), "--eval-interval evaluates nothing without --eval-prompt-data NAME PATH"),
        (("--eval-only",), "--eval-only evaluates nothing without --eval-prompt-data"),
        (("--eval-prompt-data", "held", "h.jsonl"), "--eval-prompt-data is never evaluated: add --eval-interval N"),
        (("--eval-prompt-data", "held", "--eval-interval", "2"), "--eval-prompt-data got 1 values"),
    ],
)
def test_an_evaluation_that_would_do_nothing_is_refused_at_parse_time(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit):
        parse_args(_run_args(tmp_path / "model", tmp_path / "p.jsonl", tmp_path / "save", *extra))
    assert message in capsys.readouterr().err


def test_slime_run_names_a_missing_eval_file_before_ray_starts(model_dir, tmp_path):
    missing = tmp_path / "held-out.jsonl"
    save = tmp_path / "save"
    argv = _run_args(model_dir, _prompts(tmp_path / "prompts.jsonl"), save)
    result = _slime_run([*argv, "--eval-prompt-data", "held", str(missing), "--eval-interval", "1"], cwd=tmp_path)
    assert result.returncode != 0
    assert f"slime-run: error: --eval-prompt-data held {missing} does not exist" in result.stdout
    assert "Traceback" not in result.stdout and "Started a local Ray instance" not in result.stdout
    _assert_no_checkpoint(save)
