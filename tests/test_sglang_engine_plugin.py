"""The SGLang engine plugin's parts that need no SGLang: the server command line, the `--sglang-*` mirror,
the host check, the CPU stand-ins, and the errors when SGLang is missing. Real servers: tests/sglang_engine/."""

from __future__ import annotations

import argparse
import subprocess
import sys
from types import SimpleNamespace

import pytest

from slime.plugins.sglang_engine import server_args
from slime.plugins.sglang_engine.launcher import (
    EngineStartError,
    check_host,
    launch_sglang_engines,
    server_command,
)
from slime.plugins.sglang_engine.settings import SGLangEngineSettings

#: A few entries of the shape SGLang's option table has (see server_args.option_table).
TABLE = [
    {"option_strings": ["--model-path", "--model"], "nargs": None, "help": "The model.", "metavar": None},
    {"option_strings": ["--tp-size", "--tensor-parallel-size"], "nargs": None, "help": "TP size.", "metavar": None},
    {"option_strings": ["--disable-radix-cache"], "nargs": 0, "help": "No radix cache (100% off).", "metavar": None},
    {"option_strings": ["--cuda-graph-bs"], "nargs": "+", "help": "Batch sizes.", "metavar": None},
    {"option_strings": ["--port"], "nargs": None, "help": "The port.", "metavar": None},
]


def _settings(**values) -> SGLangEngineSettings:
    return SGLangEngineSettings.from_args(SimpleNamespace(**values))


def test_the_command_line_sets_slimes_options_then_the_users():
    settings = _settings(rollout_num_gpus_per_engine=2, sglang_server_args=["--log-level", "debug"])
    command = server_command(settings, "/models/m", 31000, seed=9, on_cpu=False)
    assert command[:3] == [sys.executable, "-m", "sglang.launch_server"]
    text = " ".join(command)
    assert "--model-path /models/m --host 127.0.0.1 --port 31000 --random-seed 9 --tp-size 2" in text
    assert command[-2:] == ["--log-level", "debug"]
    assert "--device" not in command  # a GPU machine keeps SGLang's defaults


def test_on_cpu_the_command_adds_cpu_settings_the_user_did_not_override():
    command = server_command(_settings(), "/m", 1, seed=0, on_cpu=True)
    pairs = dict(zip(command, command[1:], strict=False))
    assert pairs["--device"] == "cpu" and pairs["--cuda-graph-backend-decode"] == "disabled"
    assert "--skip-server-warmup" in command and pairs["--mem-fraction-static"] == "0.05"
    mine = server_command(
        _settings(sglang_server_args=["--mem-fraction-static", "0.3", "--tensor-parallel-size", "1"]), "/m", 1, 0, True
    )
    assert mine.count("--mem-fraction-static") == 1 and mine[-4:] == [
        "--mem-fraction-static",
        "0.3",
        "--tensor-parallel-size",
        "1",
    ]
    assert "--tp-size" not in mine  # the alias counts as given


def test_only_loopback_hosts_are_accepted():
    check_host(_settings(sglang_server_args=["--host", "127.0.0.1"]))
    with pytest.raises(ValueError, match="--sglang-host 0.0.0.0: SGLang engines listen on 127.0.0.1 only"):
        check_host(_settings(sglang_server_args=["--log-level", "info", "--host", "0.0.0.0"]))


def test_sglang_options_are_mirrored_and_collected_in_sglangs_spelling(monkeypatch):
    monkeypatch.setattr(server_args, "option_table", lambda: TABLE)
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group("sglang engine")
    assert server_args.add_server_options(group) == 4  # --model-path, --model and --port are slime's to set
    args = parser.parse_args(
        ["--sglang-tensor-parallel-size", "2", "--sglang-disable-radix-cache", "--sglang-cuda-graph-bs", "1", "4"]
    )
    assert args.sglang_server_args == [
        "--tensor-parallel-size",
        "2",
        "--disable-radix-cache",
        "--cuda-graph-bs",
        "1",
        "4",
    ]
    assert parser.parse_args([]).sglang_server_args is None
    for reserved in ("--sglang-port", "--sglang-model-path"):
        with pytest.raises(SystemExit):
            parser.parse_args([reserved, "1"])
    help_text = parser.format_help()
    assert "--sglang-disable-radix-cache" in help_text and "100% off" in help_text
    assert "alias of --sglang-tp-size" in help_text


def test_without_sglang_the_run_is_refused_naming_how_to_install_it(monkeypatch, capsys):
    from slime.utils.arguments import parse_args

    monkeypatch.setattr(server_args, "installed_version", lambda: None)
    with pytest.raises(SystemExit):
        parse_args(["--rollout-engine", "sglang"])
    error = capsys.readouterr().err
    assert "slime-run: error:" in error and "SGLang, which is not installed" in error
    assert "requirements/sglang-cpu.txt" in error and "slime-rl[sglang]" in error
    with pytest.raises(EngineStartError, match="requirements/sglang-cpu-constraints.txt"):
        launch_sglang_engines(SimpleNamespace(), 1)


def test_the_help_names_the_group_even_without_sglang(monkeypatch):
    from slime.plugin_manager import PluginSelection, build_plugin_manager
    from slime.utils.arguments import build_parser

    monkeypatch.setattr(server_args, "installed_version", lambda: None)
    help_text = build_parser(build_plugin_manager(PluginSelection())).format_help()
    assert "sglang engine:" in help_text and "SGLang not installed" in help_text
    assert "--rollout-num-gpus-per-engine" in help_text and "--sglang-engine-startup-timeout" in help_text


def test_the_cpu_standins_import_and_refuse_every_use():
    code = (
        "import transformers.image_utils\n"
        "from torchvision.io import decode_jpeg\n"
        "from torchvision.transforms import InterpolationMode\n"
        "from vllm._custom_ops import rotary_embedding\n"
        "table = {InterpolationMode.BICUBIC: 1}\n"
        "try:\n    import vllm.logger\nexcept ImportError:\n    print('no vllm.logger')\n"
        "try:\n    decode_jpeg(b'')\nexcept RuntimeError as exc:\n    print(exc)\n"
    )
    env = server_args.sglang_environment()
    env["PYTHONPATH"] = f"{server_args.STANDINS_DIR}:{env.get('PYTHONPATH', '')}"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no vllm.logger" in done.stdout
    assert "torchvision.io.decode_jpeg was used, but torchvision is not installed" in done.stdout
