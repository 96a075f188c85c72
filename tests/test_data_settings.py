"""Typed settings of checkpoints, prompt data sources, the CPU engine and the demo plugins.

Each is built from partial arguments with the flags' defaults, refuses a bad value naming its flag, and the
plugins refuse bad flags when the run's arguments are parsed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slime.data.checkpoint_settings import CheckpointSettings, InitialConfiguration
from slime.data.prompt_settings import PromptSettings
from slime.plugin_manager import PluginSelection, build_plugin_manager
from slime.plugins.cpu_engine_settings import CPUEngineSettings
from slime.plugins.demo import DemoRunSettings
from slime.plugins.demo_report import ReportSettings
from slime.utils.arguments import build_parser, parse_args

SETTINGS = [
    CheckpointSettings,
    InitialConfiguration,
    PromptSettings,
    CPUEngineSettings,
    ReportSettings,
    DemoRunSettings,
]


@pytest.fixture(scope="module")
def parser():
    return build_parser(build_plugin_manager(PluginSelection()))


@pytest.mark.parametrize("settings_class", SETTINGS, ids=lambda cls: cls.__name__)
def test_settings_of_partial_args_equal_settings_of_the_flags_defaults(parser, settings_class):
    assert settings_class.from_args(SimpleNamespace()) == settings_class.from_args(parser.parse_args([]))


@pytest.mark.parametrize(
    ("settings_class", "values", "message"),
    [
        (CheckpointSettings, {"keep_last_checkpoints": 0}, "--keep-last-checkpoints must be >= 1, got 0"),
        (CheckpointSettings, {"keep_every_checkpoint": 0}, "--keep-every-checkpoint must be >= 1, got 0"),
        (CheckpointSettings, {"ckpt_step": -1}, "--ckpt-step must be >= 0, got -1"),
        (CheckpointSettings, {"ckpt_step": "last"}, "--ckpt-step must be int, got 'last'"),
        (PromptSettings, {"n_samples_per_prompt": 0}, "--n-samples-per-prompt must be >= 1, got 0"),
        (PromptSettings, {"rollout_seed": "x"}, "--rollout-seed must be int, got 'x'"),
        (CPUEngineSettings, {"cpu_engine_max_batch_size": 0}, "--cpu-engine-max-batch-size must be >= 1, got 0"),
        (CPUEngineSettings, {"cpu_engine_batch_wait_ms": -1}, "--cpu-engine-batch-wait-ms must be >= 0.0, got -1.0"),
        (CPUEngineSettings, {"cpu_engine_num_cpus": -0.5}, "--cpu-engine-num-cpus must be >= 0.0, got -0.5"),
        (CPUEngineSettings, {"cpu_engine_num_threads": 0}, "--cpu-engine-num-threads must be >= 1, got 0"),
        (CPUEngineSettings, {"cpu_engine_startup_timeout": 0}, "--cpu-engine-startup-timeout must be > 0.0, got 0.0"),
        (ReportSettings, {"num_rollout": "many"}, "--num-rollout must be int, got 'many'"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(settings_class, values, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        settings_class.from_args(SimpleNamespace(**values))


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (["--keep-last-checkpoints", "0"], "--keep-last-checkpoints must be >= 1, got 0"),
        (["--cpu-engine-num-threads", "0"], "--cpu-engine-num-threads must be >= 1, got 0"),
    ],
)
def test_plugins_refuse_bad_flags_when_the_arguments_are_parsed(tmp_path, capsys, flag, message):
    argv = ["--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(tmp_path / "p.jsonl"), *flag]
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert f"slime-run: error: {message}" in capsys.readouterr().err


def test_initial_configuration_records_the_parsed_values_under_the_flags_names(parser):
    """`rollout/branch.json` of a run interrupted before its first commit, written by any version, still matches."""
    args = parser.parse_args(["--prompt-data", "p.jsonl", "--rollout-seed", "7", "--rollout-shuffle"])
    record = InitialConfiguration.from_args(args).record()
    # --prompt-data takes several values now; a single one is recorded as the string it always was.
    assert record["prompt_data"] == "p.jsonl"
    assert record == {dest: getattr(args, dest) for dest in record if dest != "prompt_data"} | {
        "prompt_data": "p.jsonl"
    }
    assert set(record) == {
        "hf_checkpoint",
        "prompt_data",
        "input_key",
        "label_key",
        "metadata_key",
        "tool_key",
        "apply_chat_template",
        "n_samples_per_prompt",
        "rollout_seed",
        "rollout_shuffle",
        "rollout_function_path",
        "custom_generate_function_path",
        "custom_rm_path",
        "rollout_queue_run_id",
    }
    mixture = parser.parse_args(
        ["--prompt-data", "a.jsonl:0.7", "b.jsonl:0.3", "--apply-chat-template-kwargs", '{"enable_thinking": false}']
    )
    recorded = InitialConfiguration.from_args(mixture).record()
    assert recorded["prompt_data"] == "a.jsonl:0.7 b.jsonl:0.3"
    assert recorded["apply_chat_template_kwargs"] == '{"enable_thinking": false}'


def test_checkpoint_settings_say_what_saves_and_restores_hold():
    assert CheckpointSettings().saves_resumable and CheckpointSettings().loads_full_state
    assert not CheckpointSettings(no_save_rng=True).saves_resumable
    assert not CheckpointSettings(no_save_optim=True).saves_resumable
    assert CheckpointSettings(no_save_optim=True, use_stateless_adam=True).saves_resumable
    assert not CheckpointSettings(no_load_optim=True).loads_full_state
    assert CheckpointSettings(no_load_optim=True, use_stateless_adam=True).loads_full_state
    assert not CheckpointSettings(no_load_rng=True, use_stateless_adam=True).loads_full_state
    assert CheckpointSettings(save="s").restores_joint_commits and not CheckpointSettings().restores_joint_commits
    for debug in ({"debug_train_only": True}, {"debug_rollout_only": True}, {"load_debug_rollout_data": "d/{id}"}):
        assert not CheckpointSettings(save="s", **debug).restores_joint_commits
    assert CheckpointSettings(num_rollout=3).is_last_step(2) and not CheckpointSettings().is_last_step(2)


def test_prompt_settings_name_the_fields_every_row_needs():
    assert PromptSettings().record_keys() == {"input": "--input-key"}
    settings = PromptSettings.from_args(SimpleNamespace(input_key="q", label_key="a"))
    assert settings.record_keys() == {"q": "--input-key", "a": "--label-key"}
    assert PromptSettings(input_key="q", label_key="q").record_keys() == {"q": "--input-key"}
