"""Registered names resolve per kind, with the run's plugin selection, and wrong ones fail at parse time."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest

from slime.plugin_manager import KIND_NAMES, PluginError, PluginSelection, _registry, registry_of
from slime.utils.arguments import parse_args
from slime.utils.misc import PluginName, load_function, plugin_name

ROOT = Path(__file__).resolve().parents[1]
#: Keeps the demo plugin out of parse-time tests (it only turns runs without model and prompts into the demo).
MODEL_AND_PROMPTS = ["--hf-checkpoint", "model", "--prompt-data", "prompts.jsonl"]
PLUGIN_SOURCE = """
from slime import hookimpl
from slime.specs import BatchFilterSpec, RewardFunctionSpec


def shared(args, value):
    return "shared"


def fake_length(args, sample):
    return 0.5


@hookimpl
def slime_reward_functions():
    return [RewardFunctionSpec("fake-length", fake_length), RewardFunctionSpec("fake-shared", shared)]


@hookimpl
def slime_batch_filters():
    return [BatchFilterSpec("fake-shared", shared)]
"""


@pytest.fixture
def fake_plugin(tmp_path, monkeypatch):
    """An importable third-party plugin module `fake_slime_plugin_names` (also for subprocesses)."""
    (tmp_path / "fake_slime_plugin_names.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    yield PluginSelection(plugins=("fake_slime_plugin_names",), autoload=False)
    sys.modules.pop("fake_slime_plugin_names", None)
    _registry.cache_clear()


@pytest.fixture
def example_plugin(tmp_path, monkeypatch):
    """contrib/slime-example discoverable as the entry point `example`, whether or not pip installed it."""
    dist_info = tmp_path / "slime_example-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: slime-example\nVersion: 0.1.0\n")
    (dist_info / "entry_points.txt").write_text("[slime]\nexample = slime_example\n")
    monkeypatch.syspath_prepend(str(ROOT / "contrib" / "slime-example"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("SLIME_PLUGINS", raising=False)
    monkeypatch.delenv("SLIME_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    yield
    _registry.cache_clear()


# ------------------------------------------------------------------ Registry.resolve


def test_a_name_resolves_in_its_own_kind():
    registry = registry_of(None)
    assert registry.resolve("reward_functions", "math") is registry.kinds["reward_functions"]["math"].target
    assert registry.resolve("batch_filters", "nonzero-std") is registry.kinds["batch_filters"]["nonzero-std"].target


def test_a_name_of_another_kind_is_refused_naming_what_it_is_and_its_plugin():
    with pytest.raises(PluginError) as refused:
        registry_of(None).resolve("batch_filters", "math")
    message = str(refused.value)
    assert message.startswith("'math' is a reward function, not a batch filter (provided by plugin 'math_rewards')")
    assert "registered batch filters: nonzero-std" in message
    with pytest.raises(PluginError, match="^'nonzero-std' is a batch filter, not a checkpoint policy"):
        registry_of(None).resolve("checkpoint_policies", "nonzero-std")


def test_an_unknown_name_lists_the_names_of_its_kind():
    registry = registry_of(None)
    filters = ", ".join(sorted(registry.kinds["batch_filters"]))
    with pytest.raises(PluginError) as unknown:
        registry.resolve("batch_filters", "no-such-filter")
    assert str(unknown.value) == (
        f"No batch filter named 'no-such-filter'; registered batch filters: {filters} "
        "(or give a dotted path package.module.name)"
    )
    with pytest.raises(PluginError, match="registered checkpoint policies: joint, plain"):
        registry.resolve("checkpoint_policies", "hourly")


def test_dotted_paths_are_imported_with_clear_errors():
    registry = registry_of(None)
    assert registry.resolve("reward_functions", "os.path.join") is os.path.join
    with pytest.raises(AttributeError, match="Module 'os.path' has no attribute 'nope' \\(from 'os.path.nope'\\)"):
        registry.resolve("reward_functions", "os.path.nope")
    with pytest.raises(ModuleNotFoundError, match="Cannot import 'no_such_pkg_xyz' to load 'no_such_pkg_xyz.f'"):
        registry.resolve("batch_filters", "no_such_pkg_xyz.f")


def test_every_registry_kind_has_a_human_name():
    assert set(KIND_NAMES) == set(registry_of(None).kinds)
    with pytest.raises(ValueError, match="Unknown registry kind 'filters'"):
        registry_of(None).resolve("filters", "math")


# ------------------------------------------------------------------ PluginName and load_function


def test_plugin_name_is_the_users_text():
    name = PluginName("user.CustomSource", "data_sources")
    assert name == "user.CustomSource" and hash(name) == hash("user.CustomSource")
    assert str(name) == f"{name}" == "user.CustomSource" and repr(name) == "'user.CustomSource'"
    assert {name: 1}["user.CustomSource"] == 1
    with pytest.raises(ValueError, match="Unknown registry kind"):
        PluginName("math", "rewards")


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_plugin_name_pickles_with_its_kind_and_selection(protocol):
    selection = PluginSelection(plugins=("straw",), blocked=("nixl",))
    name = PluginName("nonzero-std", "batch_filters", selection)
    for again in (pickle.loads(pickle.dumps(name, protocol)), copy.deepcopy(name), copy.copy(name)):
        assert type(again) is PluginName and again == name
        assert (again.kind, again.selection) == ("batch_filters", selection)


def test_plugin_name_survives_ray_serialization():
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    name = PluginName("math", "reward_functions", PluginSelection())
    again = cloudpickle.loads(cloudpickle.dumps(name))
    assert (type(again), again, again.kind, again.selection) == (PluginName, "math", "reward_functions", name.selection)


def test_plugin_name_helper_wraps_strings_only():
    args = types.SimpleNamespace(plugin_selection=PluginSelection(plugins=("straw",)))
    assert plugin_name("batch_filters", None, args) is None
    assert plugin_name("batch_filters", len, args) is len
    wrapped = plugin_name("batch_filters", "nonzero-std", args)
    assert (type(wrapped), wrapped.kind, wrapped.selection) == (PluginName, "batch_filters", args.plugin_selection)
    assert plugin_name("batch_filters", "nonzero-std").selection is None
    with pytest.raises(TypeError, match="got 3"):
        plugin_name("batch_filters", 3, args)


def test_load_function_resolves_a_plugin_name_only_in_its_kind():
    math = registry_of(None).resolve("reward_functions", "math")
    assert load_function(plugin_name("reward_functions", "math")) is math
    with pytest.raises(PluginError, match="^'math' is a reward function, not a batch filter"):
        load_function(plugin_name("batch_filters", "math"))
    assert load_function(plugin_name("data_sources", "os.path.join")) is os.path.join


def test_a_one_argument_resolver_sees_the_plain_text():
    """Rollout code may be given `lambda path: ...` resolvers (the acceptance spec does): they compare text."""
    from slime.rollout.filter_hub.base_types import dynamic_filter_verdict

    seen = []

    def resolver(path):
        seen.append(path)
        return (lambda args, group: len(group) > 1) if path == "user.keep_pairs" else None

    args = types.SimpleNamespace(dynamic_sampling_filter_path="user.keep_pairs", plugin_selection=None)
    assert dynamic_filter_verdict(args, [1, 2], resolver).keep
    assert not dynamic_filter_verdict(args, [1], resolver).keep
    assert seen == ["user.keep_pairs"] * 2 and all(p.kind == "batch_filters" for p in seen)


def test_dynamic_filter_of_another_kind_is_refused():
    from slime.rollout.filter_hub.base_types import dynamic_filter_verdict

    args = types.SimpleNamespace(dynamic_sampling_filter_path="math", plugin_selection=None)
    with pytest.raises(PluginError, match="'math' is a reward function, not a batch filter"):
        dynamic_filter_verdict(args, [1], load_function)


def test_reward_flags_resolve_as_reward_functions():
    from slime.rollout.rm_hub import resolve_reward_function

    math = registry_of(None).resolve("reward_functions", "math")
    assert resolve_reward_function(types.SimpleNamespace(custom_rm_path=None, rm_type="math")) is math
    assert resolve_reward_function(types.SimpleNamespace(custom_rm_path="math", rm_type=None)) is math
    with pytest.raises(PluginError, match="'nonzero-std' is a batch filter, not a reward function"):
        resolve_reward_function(types.SimpleNamespace(custom_rm_path=None, rm_type="nonzero-std"))


def test_a_third_party_name_resolves_only_with_a_selection_that_loads_its_plugin(fake_plugin):
    with_plugin = types.SimpleNamespace(plugin_selection=fake_plugin)
    fake_length = load_function(plugin_name("reward_functions", "fake-length", with_plugin))
    assert fake_length.__module__ == "fake_slime_plugin_names"
    with pytest.raises(PluginError, match="No reward function named 'fake-length'; registered reward functions: "):
        load_function(plugin_name("reward_functions", "fake-length"))
    with pytest.raises(PluginError, match="No reward function named 'fake-length'"):
        load_function(plugin_name("reward_functions", "fake-length", types.SimpleNamespace(plugin_selection=None)))


def test_a_pickled_plugin_name_resolves_with_its_selection_in_another_process(fake_plugin):
    name = plugin_name("reward_functions", "fake-length", types.SimpleNamespace(plugin_selection=fake_plugin))
    code = (
        "import pickle, sys; from slime.utils.misc import load_function;"
        "print(load_function(pickle.loads(sys.stdin.buffer.read())).__module__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps(name), capture_output=True, timeout=120, check=True
    )
    assert result.stdout.decode().strip() == "fake_slime_plugin_names"


def test_a_plain_string_registered_as_several_kinds_is_ambiguous(fake_plugin):
    args = types.SimpleNamespace(plugin_selection=fake_plugin)
    with pytest.raises(PluginError, match="'fake-shared' is registered as several kinds \\(batch filter, reward"):
        load_function("fake-shared", args)
    assert load_function(plugin_name("batch_filters", "fake-shared", args)).__name__ == "shared"
    assert load_function("fake-length", args).__name__ == "fake_length"


# ------------------------------------------------------------------ parse time, before Ray


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--dynamic-sampling-filter-path", "math"],
            "slime-run: error: --dynamic-sampling-filter-path: 'math' is a reward function, not a batch filter",
        ),
        (
            ["--rollout-sample-filter-path", "copy"],
            "slime-run: error: --rollout-sample-filter-path: 'copy' is a reward function, not a batch filter",
        ),
        (["--rm-type", "nonzero-std"], "--rm-type: 'nonzero-std' is a batch filter, not a reward function"),
        (["--custom-rm-path", "no-such-reward"], "--custom-rm-path: No reward function named 'no-such-reward'"),
        (["--custom-rm-path", "os.path.nope"], "--custom-rm-path: Module 'os.path' has no attribute 'nope'"),
        (["--data-source-path", "no_such_pkg_xyz.Source"], "--data-source-path: Cannot import 'no_such_pkg_xyz'"),
        (["--rollout-function-path", "math"], "--rollout-function-path: 'math' is a reward function, not a rollout"),
        (["--eval-function-path", "prompts"], "--eval-function-path: 'prompts' is a data source, not a rollout func"),
        (["--checkpoint-policy", "hourly"], "--checkpoint-policy: No checkpoint policy named 'hourly'"),
        (["--rollout-engine", "fully-async"], "--rollout-engine: 'fully-async' is a rollout function, not a rollout"),
        (["--train-backend", "deepspeed"], "--train-backend: No train backend named 'deepspeed'"),
    ],
)
def test_wrong_names_are_refused_at_parse_time(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args([*argv, *MODEL_AND_PROMPTS])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_valid_names_and_dotted_paths_parse():
    args = parse_args(
        [
            *MODEL_AND_PROMPTS,
            "--dynamic-sampling-filter-path",
            "nonzero-std",
            "--custom-rm-path",
            "slime.plugins.demo_task.copy_reward",
            "--rm-type",
            "math",
            "--checkpoint-policy",
            "joint",
        ]
    )
    assert args.custom_rm_path == "slime.plugins.demo_task.copy_reward"


def test_slime_run_refuses_a_wrong_name_without_a_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "slime.cli", "--dynamic-sampling-filter-path", "math", *MODEL_AND_PROMPTS],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "slime-run: error: --dynamic-sampling-filter-path: 'math' is a reward function, not a batch filter" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------ flags of plugins that are not loaded


def test_a_flag_of_an_installed_but_unloaded_plugin_names_the_plugin(example_plugin, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--disable-plugin-autoload", "--example-length-target", "3", *MODEL_AND_PROMPTS])
    assert (
        "slime-run: error: --example-length-target belongs to plugin 'example', which is not loaded "
        "(add --plugin example)" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        parse_args(["-p", "no:example", "--example-length-target=3", *MODEL_AND_PROMPTS])
    assert "--example-length-target belongs to plugin 'example', which is not loaded (remove -p no:example)" in (
        capsys.readouterr().err
    )


def test_the_flag_parses_once_its_plugin_is_loaded(example_plugin):
    args = parse_args(
        ["--disable-plugin-autoload", "-p", "example", "--example-length-target", "3", "--rm-type", "length-target"]
        + MODEL_AND_PROMPTS
    )
    assert args.example_length_target == 3


def test_a_flag_no_plugin_defines_is_unrecognized(example_plugin, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--disable-plugin-autoload", "--no-such-flag-xyz", "1", *MODEL_AND_PROMPTS])
    assert "slime-run: error: unrecognized arguments: --no-such-flag-xyz 1" in capsys.readouterr().err
