"""Every attribute product code reads from a run's arguments is a flag of `slime-run` or one the framework sets.

The run's `argparse.Namespace` reaches every component; an attribute that no parser defines can only ever
hold its fallback, so the code behind it is dead or the user cannot reach it. This scans core/, plugins/ and
transports/ with `ast` for reads from the names that hold a run's arguments (`args`, `<anything>.args`,
`config`):

- `args.name` and `getattr(args, "name", ...)` / `hasattr(args, "name")`;
- `getattr(args, name)` in a loop over a literal table of names (inline, or a module-level constant);
- the first argument of `option("name", ...)` (`slime.utils.settings` fields) and of the `pick("name", ...)`
  readers inside settings classes' `from_args`;

and checks each name against the destinations of `build_parser(pm)` with every built-in and installed plugin
loaded, or `FRAMEWORK_ATTRIBUTES`. It also checks that the settings classes built from a namespace that holds
nothing equal those built from the parser's defaults (no drift between a flag's default and its fallback).
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime.plugin_manager import PluginSelection, build_plugin_manager
from slime.utils.arguments import build_parser

ROOT = Path(__file__).resolve().parents[1]

#: Attributes the framework itself sets on a run's args (no flag: a user cannot pass them), with who sets them.
FRAMEWORK_ATTRIBUTES = {
    "explicit_options": "slime.utils.arguments.parse_args: the destinations given on the command line",
    "plugin_selection": "parse_args: the -p/--plugin selection, so Ray actors rebuild the run's plugin manager",
    "rollout_engine_urls": "the rollout manager (published engine URLs) and RayTrainGroup (register_training_actors)",
    "rollout_router_url": "slime.ray.serving: the sglang-router in front of the engines",
    "update_weight_start_version": "checkpoint restore and RayTrainGroup.create: the weight version engines serve",
    "start_rollout_id": "checkpoint restore and create_training_models: the first step of the run",
    "demo_run": "the demo plugin's slime_configure: this run is the built-in demo",
}

#: Receivers named like a run's arguments that hold something else, by file.
OTHER_NAMESPACES = {
    ("core/testing/pytest_plugin.py", "config"): "pytest.Config",
    ("core/utils/external_utils/command_utils.py", "config"): "LaunchConfig",
    ("plugins/cpu_engine_core.py", "config"): "the model's transformers config",
}

#: Functions whose first argument, a string literal, names the attribute of the run's args they read.
READER_CALLS = {"option", "pick"}


def _is_receiver(node: ast.AST, path: str) -> bool:
    if isinstance(node, ast.Name) and node.id in ("args", "config"):
        return (path, node.id) not in OTHER_NAMESPACES
    return isinstance(node, ast.Attribute) and node.attr == "args"


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _table(node: ast.AST, constants: dict[str, ast.AST]) -> list[str]:
    """The names a loop over `node` binds: a literal tuple/list/set of strings, a module-level constant holding
    one (a dict: its keys), or that constant's `.items()` / `.keys()`; [] for anything else."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("items", "keys"):
        node = node.func.value
    if isinstance(node, ast.Name) and node.id in constants:
        node = constants[node.id]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = node.elts
    elif isinstance(node, ast.Dict):
        items = node.keys
    else:
        return []
    names = [_literal(item) for item in items]
    return names if all(names) else []  # type: ignore[return-value]


def _module_constants(tree: ast.Module) -> dict[str, ast.AST]:
    constants = {}
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, value = statement.target, statement.value
        else:
            continue
        if isinstance(target, ast.Name):
            constants[target.id] = value
    return constants


def _table_reads(tree: ast.Module, path: str) -> list[tuple[str, int]]:
    """`getattr(args, name)` inside a loop or comprehension whose variable `name` runs over a literal table."""
    constants = _module_constants(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.For):
            loops, scope = [node], node.body
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            loops = node.generators
            scope = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        else:
            continue
        tables = {}
        for loop in loops:
            target = loop.target.elts[0] if isinstance(loop.target, ast.Tuple) else loop.target
            if isinstance(target, ast.Name):
                tables[target.id] = _table(loop.iter, constants)
        for call in (inner for part in scope for inner in ast.walk(part)):
            if (
                isinstance(call, ast.Call)
                and getattr(call.func, "id", None) in ("getattr", "hasattr")
                and len(call.args) >= 2
                and _is_receiver(call.args[0], path)
                and isinstance(call.args[1], ast.Name)
            ):
                found += [(name, call.lineno) for name in tables.get(call.args[1].id, [])]
    return found


def _product_files() -> list[tuple[str, ast.Module]]:
    files = [path for top in ("core", "plugins", "transports") for path in sorted((ROOT / top).rglob("*.py"))]
    return [(str(path.relative_to(ROOT)), ast.parse(path.read_text())) for path in files]


def _file_reads(tree: ast.Module, path: str) -> list[tuple[str, int]]:
    """`[(attribute, line), ...]` of the reads from a run's args in one file."""
    found = _table_reads(tree, path)
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _is_receiver(node.value, path):
            name = node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            if node.func.id in READER_CALLS:
                name = _literal(node.args[0])
            elif node.func.id in ("getattr", "hasattr") and _is_receiver(node.args[0], path):
                name = _literal(node.args[1]) if len(node.args) >= 2 else None
        if name is not None:
            found.append((name, node.lineno))
    return found


def _reads() -> dict[str, list[str]]:
    """`{attribute: ["file:line", ...]}` of every attribute product code reads from a run's args."""
    found: dict[str, list[str]] = {}
    for path, tree in _product_files():
        for name, line in _file_reads(tree, path):
            found.setdefault(name, []).append(f"{path}:{line}")
    return found


def _assignments() -> dict[str, list[str]]:
    """`{attribute: ["file:line", ...]}` of `args.name = ...` and `setattr(args, "name", ...)` in product code."""
    found: dict[str, list[str]] = {}
    for path, tree in _product_files():
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_receiver(node.value, path):
                name = node.attr
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) == 3:
                name = _literal(node.args[1]) if _is_receiver(node.args[0], path) else None
            if name is not None:
                found.setdefault(name, []).append(f"{path}:{node.lineno}")
    return found


@pytest.fixture(scope="module")
def parser():
    return build_parser(build_plugin_manager(PluginSelection()))


@pytest.fixture(scope="module")
def destinations(parser) -> set[str]:
    """Every destination the parser sets: its options' and those given a parser-level default (`set_defaults`)."""
    return {action.dest for action in parser._actions} | set(parser._defaults)


SCANNED_EXAMPLE = """
TABLE = ("in_a_table", "in_a_table_too")
NAMES = {"dict_key": 1}


class Settings:
    field: int = option("by_option", 1)

    def read(self, args, config, sample):
        values = {name: getattr(args, name, None) for name in TABLE}
        for dest, _ in NAMES.items():
            values[dest] = getattr(self.args, dest)
        for name in ("inline_table",):
            values[name] = getattr(config, name)
        for name in ("not_read_from_args",):
            values[name] = getattr(sample, name)
        values["more"] = (args.plain, self.args.nested, getattr(args, "by_getattr", 0), pick("by_pick"))
        return values, hasattr(config, "by_hasattr")
"""


def test_the_scan_finds_every_kind_of_read():
    found = {name for name, _ in _file_reads(ast.parse(SCANNED_EXAMPLE), "example.py")}
    assert found == {
        "in_a_table",
        "in_a_table_too",
        "dict_key",
        "inline_table",
        "by_option",
        "plain",
        "nested",
        "by_getattr",
        "by_hasattr",
        "by_pick",
    }
    reads = _reads()
    assert "vocab_size" not in reads and "getoption" not in reads  # a model's config, pytest's config
    assert any(where.startswith("core/utils/arguments.py") for where in reads["train_backend"])  # NAMED_OPTIONS


def test_every_attribute_read_from_args_is_a_flag_or_set_by_the_framework(destinations):
    unknown = {name: where for name, where in _reads().items() if name not in destinations | set(FRAMEWORK_ATTRIBUTES)}
    report = "\n".join(f"  {name}: {', '.join(where[:3])}" for name, where in sorted(unknown.items()))
    assert not unknown, f"attributes read from a run's args that no flag defines nor the framework sets:\n{report}"


def test_framework_attributes_are_set_and_read_and_are_not_flags(destinations):
    reads, assigned = _reads(), _assignments()
    assert not set(FRAMEWORK_ATTRIBUTES) & destinations, "a flag now defines these: drop them from the table"
    assert set(FRAMEWORK_ATTRIBUTES) <= set(assigned), f"never set: {sorted(set(FRAMEWORK_ATTRIBUTES) - set(assigned))}"
    assert set(FRAMEWORK_ATTRIBUTES) <= set(reads), f"never read: {sorted(set(FRAMEWORK_ATTRIBUTES) - set(reads))}"
    written_only = {name: where for name, where in assigned.items() if name not in destinations | set(reads)}
    assert not written_only, f"attributes set on a run's args that nothing reads: {written_only}"


def _settings_classes() -> list:
    from slime.data.straw_settings import StrawSettings
    from slime.plugins.torch_settings import TrainSettings
    from slime.ray.health_monitor import HealthSettings
    from slime.rollout.settings import RolloutSettings

    return [TrainSettings, RolloutSettings, HealthSettings, StrawSettings]


@pytest.mark.parametrize("settings_class", _settings_classes(), ids=lambda cls: cls.__name__)
def test_settings_of_partial_args_equal_settings_of_the_flags_defaults(parser, settings_class):
    """A namespace that lacks every attribute (a test's, a tool's) gets exactly the flags' defaults."""
    assert settings_class.from_args(SimpleNamespace()) == settings_class.from_args(parser.parse_args([]))
