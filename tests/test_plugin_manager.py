"""The plugin core: manager construction, selection, registry validation and the contract's docs."""

from __future__ import annotations

import inspect
import pickle
import re
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import pytest

from slime import hookimpl, hookspecs
from slime.plugin_manager import (
    PluginError,
    PluginSelection,
    build_plugin_manager,
    collect_registry,
    named_plugin_defaults,
    registry_for,
)
from slime.specs import RewardFunctionSpec, TransportSpec
from slime.utils.arguments import parse_args
from slime.utils.misc import load_function

ROOT = Path(__file__).resolve().parents[1]


def _module(name: str, **functions) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in functions.items():
        setattr(module, key, value)
    sys.modules[name] = module
    return module


@pytest.fixture
def clean_modules():
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("fake_slime_plugin"):
            del sys.modules[name]


def test_builtins_provide_the_three_transports():
    registry = registry_for(None)
    assert set(registry.kinds["transports"]) >= {"object-store", "nixl", "straw"}
    assert registry.get("transports", "straw").checkpoint_policy == "joint"
    assert registry.get("transports", "object-store").checkpoint_policy == "plain"
    assert registry.providers[("transports", "straw")] == "straw"


def test_unknown_spec_name_lists_what_exists():
    with pytest.raises(PluginError, match="No transport named 'carrier-pigeon'; available: .*straw"):
        registry_for(None).get("transports", "carrier-pigeon")


def test_dotted_module_plugin_and_duplicate_names_name_both(clean_modules):
    @hookimpl
    def slime_transports():
        return [TransportSpec("straw", None)]

    _module("fake_slime_plugin_dup", slime_transports=slime_transports)
    pm = build_plugin_manager(PluginSelection(plugins=("fake_slime_plugin_dup",)))
    with pytest.raises(PluginError, match="provided by both plugins 'straw' and 'fake_slime_plugin_dup'"):
        collect_registry(pm)


def test_blocking_a_builtin_removes_what_it_provides(clean_modules):
    @hookimpl
    def slime_transports():
        return [TransportSpec("straw", None, checkpoint_policy="joint")]

    _module("fake_slime_plugin_replacement", slime_transports=slime_transports)
    selection = PluginSelection(plugins=("fake_slime_plugin_replacement",), blocked=("straw",))
    registry = collect_registry(build_plugin_manager(selection))
    assert registry.providers[("transports", "straw")] == "fake_slime_plugin_replacement"


def test_wrong_spec_type_is_rejected(clean_modules):
    @hookimpl
    def slime_transports():
        return [{"name": "dict-transport"}]

    _module("fake_slime_plugin_badtype", slime_transports=slime_transports)
    pm = build_plugin_manager(PluginSelection(plugins=("fake_slime_plugin_badtype",)))
    with pytest.raises(PluginError, match="must yield TransportSpec, got dict"):
        collect_registry(pm)


def test_misspelled_hook_fails_at_startup(clean_modules):
    @hookimpl
    def slime_transport():  # missing "s"
        return []

    _module("fake_slime_plugin_typo", slime_transport=slime_transport)
    with pytest.raises(Exception, match="slime_transport"):
        build_plugin_manager(PluginSelection(plugins=("fake_slime_plugin_typo",)))


def test_unknown_plugin_name_says_how_to_fix():
    with pytest.raises(PluginError, match="Unknown plugin 'no_such_plugin_xyz'.*pip install"):
        build_plugin_manager(PluginSelection(plugins=("no_such_plugin_xyz",)))


def test_plugin_whose_import_fails_is_reported_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "fake_slime_plugin_broken.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "fake_slime_plugin_raises.py").write_text("raise RuntimeError('bad config')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match="'fake_slime_plugin_broken' failed to import: No module named 'no_such_dep"):
        build_plugin_manager(PluginSelection(plugins=("fake_slime_plugin_broken",)))
    with pytest.raises(PluginError, match="'fake_slime_plugin_raises' failed to import: RuntimeError: bad config"):
        build_plugin_manager(PluginSelection(plugins=("fake_slime_plugin_raises",)))


def test_blocking_an_essential_builtin_is_refused():
    with pytest.raises(PluginError, match="Cannot block built-in plugin 'checkpoint_policies'"):
        PluginSelection.from_cli(["no:checkpoint_policies"])


def test_selection_from_cli_and_environment(monkeypatch):
    monkeypatch.setenv("SLIME_PLUGINS", "alpha, beta")
    monkeypatch.delenv("SLIME_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    selection = PluginSelection.from_cli(["straw", "no:nixl"], disable_autoload=True)
    assert selection == PluginSelection(plugins=("alpha", "beta", "straw"), blocked=("nixl",), autoload=False)
    assert pickle.loads(pickle.dumps(selection)) == selection
    with pytest.raises(PluginError, match="both requested and blocked: straw"):
        PluginSelection.from_cli(["straw", "no:straw"])


def test_named_plugin_sets_defaults_and_only_when_named():
    pm = build_plugin_manager(PluginSelection())
    assert named_plugin_defaults(pm, PluginSelection()) == {}
    named = PluginSelection(plugins=("straw",))
    assert named_plugin_defaults(build_plugin_manager(named), named) == {"rollout_data_transport": ("straw", "straw")}


def test_parse_args_applies_plugin_defaults_and_explicit_flags_win(monkeypatch, caplog):
    monkeypatch.delenv("SLIME_PLUGINS", raising=False)
    caplog.set_level("INFO")
    args = parse_args(["--plugin", "straw"])
    assert args.rollout_data_transport == "straw"
    assert args.plugin_selection.plugins == ("straw",)
    assert "plugin straw sets default --rollout-data-transport='straw'" in caplog.text
    assert (
        parse_args(["-p", "straw", "--rollout-data-transport", "object-store"]).rollout_data_transport == "object-store"
    )
    assert parse_args([]).rollout_data_transport == "object-store"


def test_parse_args_rejects_unknown_transport(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--rollout-data-transport", "telegraph"])
    assert "not provided by any plugin" in capsys.readouterr().err


def test_plugin_options_and_configure_hook(clean_modules):
    seen = []

    @hookimpl
    def slime_addoption(parser):
        parser.add_argument("--fake-knob", type=int, default=3)

    @hookimpl
    def slime_configure(args):
        seen.append(args.fake_knob)

    _module("fake_slime_plugin_opts", slime_addoption=slime_addoption, slime_configure=slime_configure)
    args = parse_args(["-p", "fake_slime_plugin_opts", "--fake-knob", "5"])
    assert args.fake_knob == 5 and seen == [5]


def test_load_function_resolves_registered_names_and_dotted_paths(clean_modules):
    @hookimpl
    def slime_reward_functions():
        return [RewardFunctionSpec("fake-reward", len)]

    _module("fake_slime_plugin_reward", slime_reward_functions=slime_reward_functions)
    args = types.SimpleNamespace(plugin_selection=PluginSelection(plugins=("fake_slime_plugin_reward",)))
    assert load_function("fake-reward", args) is len
    assert load_function("os.path.join") is __import__("os").path.join
    assert load_function(None) is None
    with pytest.raises(ValueError, match="neither a registered plugin name nor a dotted path"):
        load_function("fake-reward")
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        load_function("os.path.nope")


def _source_packages() -> list[str]:
    packages = []
    for top, package in (("core", "slime"), ("plugins", "slime.plugins"), ("transports", "slime.transports")):
        for init in sorted((ROOT / top).rglob("__init__.py")):
            relative = init.parent.relative_to(ROOT / top)
            if "cpu_standins" in relative.parts:
                continue  # package data: top-level stand-in packages put on SGLang servers' PYTHONPATH
            packages.append(".".join([package, *relative.parts]))
    return packages


def test_installed_distribution_imports_every_package_from_a_subprocess():
    code = "import importlib, sys; [importlib.import_module(name) for name in sys.argv[1:]]"
    subprocess.run([sys.executable, "-c", code, *_source_packages()], check=True, cwd="/", timeout=120)


@pytest.mark.slow
def test_wheel_contains_every_package_directory(tmp_path):
    import zipfile

    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("slime_rl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in _source_packages():
        assert package.replace(".", "/") + "/__init__.py" in names, (
            f"{package} is missing from the wheel: add it to [tool.setuptools] packages in pyproject.toml"
        )


def test_every_hook_is_documented_with_its_arguments():
    docs = (ROOT / "docs" / "plugins.md").read_text()
    for name, function in inspect.getmembers(hookspecs, inspect.isfunction):
        if not name.startswith("slime_"):
            continue
        assert function.__doc__, f"{name} has no docstring"
        params = ", ".join(inspect.signature(function).parameters)
        assert re.search(rf"`{name}\({re.escape(params)}\)`", docs), f"docs/plugins.md lacks `{name}({params})`"


@pytest.mark.slow
def _venv_seeing_this_environment(venv: Path) -> Path:
    """A new virtualenv whose interpreter sees every package this test process sees: this environment's
    site-packages come before the system's, with their `.pth` files processed (editable installs), so the plugin is
    built with this environment's setuptools and wheel and loads against the slime under test, not whatever the
    base interpreter happens to have installed. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    query = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site_packages = subprocess.run([str(python), "-c", query], check=True, capture_output=True, text=True).stdout
    here = sysconfig.get_paths()["purelib"]
    (Path(site_packages.strip()) / "_test_environment.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    return python


def test_third_party_plugin_installs_with_pip_and_loads(tmp_path):
    python = _venv_seeing_this_environment(tmp_path / "venv")
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(ROOT / "contrib" / "slime-example"),
        ],
        check=True,
    )
    listing = subprocess.run(
        [str(python), "-m", "slime.cli", "plugins"], check=True, capture_output=True, text=True
    ).stdout
    assert "example  [slime-example 0.1.0]" in listing
    assert "reward_functions: length-target" in listing
    disabled = subprocess.run(
        [str(python), "-m", "slime.cli", "plugins", "--disable-plugin-autoload"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "example" not in disabled and "straw" in disabled
    code = (
        "from slime.utils.arguments import parse_args;"
        "from slime.utils.misc import load_function;"
        "a = parse_args(['--example-length-target', '3']);"
        "f = load_function('length-target', a);"
        "from slime.utils.types import Sample;"
        "print(a.example_length_target, f(a, Sample(response='abc')))"
    )
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.split() == ["3", "1.0"]


def test_data_source_defaults_to_the_transports_own(monkeypatch):
    monkeypatch.delenv("SLIME_PLUGINS", raising=False)
    assert (
        parse_args(["--rollout-data-transport", "straw", "--hf-checkpoint", "m", "--prompt-data", "p"]).data_source_path
        == "queue"
    )
    assert parse_args(["--hf-checkpoint", "m", "--prompt-data", "p"]).data_source_path == "prompts"
    from slime.data.queue_data_source import QueueDataSource

    dotted = "slime.data.queue_data_source.QueueDataSource"
    given = parse_args(["-p", "straw", "--data-source-path", dotted, "--hf-checkpoint", "m", "--prompt-data", "p"])
    assert given.data_source_path == dotted

    assert load_function("queue") is QueueDataSource
