"""`slime-run`: run a training job, list plugins, or inspect a debug archive.

slime-run [--plugin NAME ...] [run options]     train (see `slime-run --help`)
slime-run plugins [--plugin NAME ...]           list loaded plugins, versions, hooks and what each provides
slime-run archive show PATH [--export OUT.pt]   inspect a `*.straw.json` debug archive
slime-run runs [audit] DIR [--json]             inspect a save directory's branches and commits; audit its lineage
slime-run export SAVE_DIR [--step N] OUT        copy a checkpoint to OUT as a Hugging Face model directory
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from slime.errors import RunInterrupted, UsageError
from slime.plugin_manager import PluginError, PluginSelection, build_plugin_manager, collect_registry
from slime.utils.arguments import add_plugin_arguments


def _plugin_origin(pm, name: str, plugin) -> str:
    if name in pm.slime_distributions:
        return pm.slime_distributions[name]
    module = getattr(plugin, "__name__", type(plugin).__name__)
    return f"module {module}"


def list_plugins(argv: Sequence[str]) -> int:
    """Print each loaded plugin with its distribution, hooks and provided names."""
    parser = argparse.ArgumentParser(prog="slime-run plugins", description="List loaded slime plugins.")
    add_plugin_arguments(parser)
    ns = parser.parse_args(argv)
    pm = build_plugin_manager(PluginSelection.from_cli(ns.plugins, disable_autoload=ns.disable_plugin_autoload))
    registry = collect_registry(pm)
    for name, plugin in sorted(pm.list_name_plugin(), key=lambda item: item[0]):
        hooks = sorted(caller.name for caller in pm.get_hookcallers(plugin) or ())
        print(f"{name}  [{_plugin_origin(pm, name, plugin)}]")
        print(f"  hooks: {', '.join(hooks) or '-'}")
        for kind, specs in registry.kinds.items():
            provided = sorted(spec_name for spec_name in specs if registry.providers[(kind, spec_name)] == name)
            if provided:
                print(f"  {kind}: {', '.join(provided)}")
    return 0


def request_ray_token_auth() -> None:
    """Ask Ray for token authentication explicitly (`RAY_AUTH_MODE=token`).

    Ray turns it on by default for a new local cluster and then warns about it at every start; asking for it keeps
    the protection and drops the warning. A driver joining a cluster (`--ray-address`) needs it too: `ray start
    --head` turns token authentication on by default, refuses a driver without the token (read from this user's
    `~/.ray`) and Ray retries that without end; a token-mode driver also joins a cluster started without it.
    Ray reads the variable once, when it is imported, so this runs before the training driver imports Ray, and
    does nothing where the user chose a mode or Ray is already imported (the default then stands).
    """
    if "ray" in sys.modules or "RAY_AUTH_MODE" in os.environ:
        return
    os.environ["RAY_AUTH_MODE"] = "token"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "plugins":
            return list_plugins(argv[1:])
        if argv and argv[0] == "archive":
            from slime.archive_cli import run_archive_cli

            return run_archive_cli(argv[1:])
        if argv and argv[0] == "runs":
            from slime.runs_cli import run_runs_cli

            return run_runs_cli(argv[1:])
        if argv and argv[0] == "export":
            from slime.export_cli import run_export_cli

            return run_export_cli(argv[1:])
        request_ray_token_auth()
        from slime.train import main as train_main

        return train_main(argv) or 0
    except (PluginError, UsageError) as exc:
        print(f"slime-run: error: {exc}", file=sys.stderr)
        return 2
    except RunInterrupted as exc:
        print(f"slime-run: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
