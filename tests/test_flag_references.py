"""Every `--flag` that product code, docstrings and docs name is an option the user can actually pass.

A message that says "drop --foo" or "set --bar" is only useful when `--foo` and `--bar` exist; this scans
core/, plugins/, transports/ (*.py), docs/*.md and README.md and checks each `--word-word` token against the
options of `slime-run` with every built-in and installed plugin loaded, of `slime-run archive`, of the
benchmark scripts the docs describe and of our pytest plugin.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from slime.archive_cli import add_archive_parser
from slime.export_cli import build_export_parser
from slime.plugin_manager import PluginSelection, build_plugin_manager
from slime.utils.arguments import build_parser

ROOT = Path(__file__).resolve().parents[1]

#: `--a-b`, optionally ending in a brace list: `--rollout-health-check-{interval,timeout}`.
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)(?:\{([a-z0-9,-]+)\})?")

#: Options that are not ours: other programs' that our code runs or our docs quote, and example placeholders.
FOREIGN_FLAGS = {
    # `ray start` / `ray stop` / `ray job submit` (slime.utils.external_utils.command_utils)
    "--address",
    "--dashboard-host",
    "--dashboard-port",
    "--disable-usage-stats",
    "--force",
    "--head",
    "--node-ip-address",
    "--num-gpus",
    "--runtime-env-json",
    # `ray start` of a test cluster's head and worker nodes (slime.testing.ray_head)
    "--block",
    "--include-dashboard",
    "--num-cpus",
    "--resources",
    "--temp-dir",
    # `juicefs format` / `juicefs mount` of a test volume (slime.testing.juicefs)
    "--bucket",
    "--no-update",
    "--no-usage-report",
    "--open-cache",
    "--storage",
    # `sglang-router launch` (slime.ray.router)
    "--host",
    "--log-level",
    "--policy",
    "--port",
    "--prometheus-host",
    "--prometheus-port",
    "--worker-urls",
    # `py-spy record --native` (docs/benchmarks.md)
    "--native",
    # a third-party transport's own option, in the example of slime.testing's docstring
    "--my-transport-dir",
    # `pip install --no-deps` (installing SGLang on CPU: docs/sglang.md, slime.plugins.sglang_engine)
    "--no-deps",
    # the option-table helper subprocess of slime.plugins.sglang_engine.server_args
    "--check",
    "--table",
    # `tensorboard --logdir` and `trackio show --project` (docs/trackers.md)
    "--logdir",
    "--project",
    # `hf download ID --local-dir DIR` (the fix slime.utils.hub_checkpoint suggests when the Hub is unreachable)
    "--local-dir",
    # "--sglang-<name>": the placeholder of every SGLang option
    "--sglang",
}

#: `sglang.launch_server` options our code sets or our docs quote (also valid as `--sglang-<name>` on slime-run);
#: where SGLang is installed, its own option table is checked too.
SGLANG_SERVER_FLAGS = {
    "--context-length",
    "--cuda-graph-backend-decode",
    "--cuda-graph-backend-prefill",
    "--device",
    "--disable-cuda-graph",
    "--host",
    "--max-total-tokens",
    "--mem-fraction-static",
    "--model",
    "--model-path",
    "--random-seed",
    "--skip-server-warmup",
    "--tensor-parallel-size",
    "--tp-size",
}


def _scanned_files() -> list[Path]:
    files = [path for top in ("core", "plugins", "transports") for path in sorted((ROOT / top).rglob("*.py"))]
    return files + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def _referenced_flags() -> dict[str, list[str]]:
    """`{flag: ["file:line", ...]}` for every flag token, brace lists expanded."""
    found: dict[str, list[str]] = {}
    for path in _scanned_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in FLAG.finditer(line):
                stem, braces = match.groups()
                names = [stem + part for part in braces.split(",")] if braces else [stem.rstrip("-")]
                for name in names:
                    found.setdefault(f"--{name}", []).append(f"{path.relative_to(ROOT)}:{number}")
    return found


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its subcommands."""
    options = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= _option_strings(sub)
    return options


def _benchmark_options() -> set[str]:
    """Options of the benchmark scripts (`python -m benchmarks.NAME`), as their parsers declare them."""
    pattern = re.compile(r"add_argument\(\s*f?\"(--[a-z][a-z0-9-]*)\"")
    return {flag for path in (ROOT / "benchmarks").glob("*.py") for flag in pattern.findall(path.read_text())}


def _contrib_options() -> set[str]:
    """Options the plugins under contrib/ add (they are separate packages, installed or not in this environment)."""
    pattern = re.compile(r"add_argument\(\s*f?\"(--[a-z][a-z0-9-]*)\"")
    return {flag for path in (ROOT / "contrib").rglob("*.py") for flag in pattern.findall(path.read_text())}


def _pytest_plugin_options() -> set[str]:
    """Options our pytest plugin (`slime.testing.pytest_plugin`) adds to pytest."""
    pattern = re.compile(r"\.addoption\(\s*\"(--[a-z][a-z0-9-]*)\"")
    return {flag for path in (ROOT / "core").rglob("*.py") for flag in pattern.findall(path.read_text())}


def _known_options() -> set[str]:
    run = build_parser(build_plugin_manager(PluginSelection()))
    archive = argparse.ArgumentParser(prog="slime-run")
    add_archive_parser(archive.add_subparsers())
    commands = _option_strings(run) | _option_strings(archive) | _option_strings(build_export_parser())
    return (
        commands
        | _benchmark_options()
        | _contrib_options()
        | _pytest_plugin_options()
        | FOREIGN_FLAGS
        | _sglang_options()
    )


def _sglang_options() -> set[str]:
    """SGLang's server options, bare and as slime-run's `--sglang-<name>` (installed SGLang's table, if any)."""
    from slime.plugins.sglang_engine.server_args import PREFIX, option_table

    table = {flag for entry in option_table() for flag in entry["option_strings"] if flag.startswith("--")}
    bare = SGLANG_SERVER_FLAGS | table
    return bare | {PREFIX + flag[2:] for flag in bare}


def test_the_scan_finds_flags_in_messages_docstrings_and_docs():
    found = _referenced_flags()
    assert {"--plugin", "--rollout-data-transport", "--rollout-health-check-timeout"} <= set(found)
    assert any(where.startswith("docs/") for where in found["--plugin"])


def test_every_named_flag_exists():
    known = _known_options()
    missing = {flag: where for flag, where in _referenced_flags().items() if flag not in known}
    report = "\n".join(f"  {flag}: {', '.join(where[:3])}" for flag, where in sorted(missing.items()))
    assert not missing, f"flags named in messages, docstrings or docs that slime-run does not have:\n{report}"


def test_foreign_flags_are_not_ours_and_are_still_referenced():
    """The allowlist only holds other programs' options that the scanned files still quote."""
    ours = _option_strings(build_parser(build_plugin_manager(PluginSelection())))
    referenced = set(_referenced_flags())
    assert not FOREIGN_FLAGS & ours
    assert FOREIGN_FLAGS <= referenced, f"no longer referenced: {sorted(FOREIGN_FLAGS - referenced)}"
    bare = referenced | {"--" + flag.removeprefix("--sglang-") for flag in referenced if flag.startswith("--sglang-")}
    assert SGLANG_SERVER_FLAGS <= bare, f"no longer referenced: {sorted(SGLANG_SERVER_FLAGS - bare)}"


def test_brace_lists_expand():
    matches = [m.groups() for m in FLAG.finditer("`--a-{b,c}` and --d-e, not a--b or x-y")]
    assert matches == [("a-", "b,c"), ("d-e", None)]
