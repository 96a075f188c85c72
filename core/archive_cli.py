"""`slime-run archive show PATH [--export OUT.pt]`: inspect a `*.straw.json` debug archive.

`show` prints what the archive holds (rollout id, pool, run id, sample count, sample and task keys,
sizes) without reading any Sample; `--export` also writes a self-contained legacy `.pt` dump.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

#: How many sample/task keys `show` lists before summarising the rest.
SHOWN_KEYS = 20


def add_archive_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `archive` command (with its `show` subcommand) to a `slime-run` subparser set."""
    parser = subparsers.add_parser("archive", help="inspect a *.straw.json debug rollout archive")
    actions = parser.add_subparsers(dest="archive_action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print what an archive holds; optionally export it as a .pt dump")
    show.add_argument("path", metavar="PATH", help="the archive index (*.straw.json)")
    show.add_argument("--export", metavar="OUT.pt", default=None, help="also write a self-contained .pt dump")
    show.add_argument("--root", default=None, help="the archive's pool, when mounted at another path")
    return parser


def _keys_line(label: str, keys: list, total: int) -> str:
    shown = ", ".join("-" if key is None else str(key) for key in keys[:SHOWN_KEYS])
    more = f" ... (+{total - SHOWN_KEYS} more)" if total > SHOWN_KEYS else ""
    return f"{label} ({total}): {shown}{more}"


def show_archive(path: str, *, export: str | None = None, root: str | None = None) -> None:
    """Print the archive summary to stdout (and export it when asked)."""
    from slime.data.archive import RolloutArchive

    with RolloutArchive(path, root=root) as archive:
        keys = archive.keys()
        sample_keys = [sample_key for sample_key, _ in keys]
        task_keys = list(dict.fromkeys(task_key for _, task_key in keys if task_key is not None))
        refs = archive.sample_refs()
        print(f"archive:    {archive.path}")
        print(f"rollout id: {archive.rollout_id}{' (evaluation)' if archive.index.get('evaluation') else ''}")
        print(f"pool:       {archive.store.backend.root}")
        print(f"run id:     {archive.manifest.manifest.segment.run_id}")
        print(f"owner:      {archive.index['storage_owner']}")
        print(f"samples:    {len(keys)}")
        print(_keys_line("sample keys", sample_keys, len(sample_keys)))
        untasked = sum(task_key is None for _, task_key in keys)
        suffix = f"; {untasked} samples without a task" if untasked else ""
        print(_keys_line("task keys", task_keys, len(task_keys)) + suffix)
        layout = f"{len(refs)} chunks" if archive.mode == "chunks" else "reference to an existing batch"
        print(f"layout:     {layout}")
        print(f"index file: {Path(archive.path).stat().st_size} bytes")
        print(f"stored:     {archive.manifest.payload_bytes} bytes (contents and every record it references)")
        if archive.mode == "chunks":
            sizes = [ref.manifest.payload_bytes for ref in refs]
            print(f"chunk bytes: {', '.join(map(str, sizes[:SHOWN_KEYS]))}{' ...' if len(sizes) > SHOWN_KEYS else ''}")
        if export is not None:
            written = archive.export_pt(export)
            print(f"exported {len(keys)} samples to {written}")


def run_archive_command(ns: argparse.Namespace) -> int:
    """Run a parsed `archive` command; errors are printed, not raised (exit status 1)."""
    from straw.errors import QueueError

    try:
        show_archive(ns.path, export=ns.export, root=ns.root)
    except (OSError, ValueError, QueueError) as exc:
        print(f"slime-run archive: error: {exc}", file=sys.stderr)
        return 1
    return 0


def run_archive_cli(argv: Sequence[str]) -> int:
    """`slime-run archive ...` with `argv` the words after `archive`."""
    parser = argparse.ArgumentParser(prog="slime-run")
    add_archive_parser(parser.add_subparsers(dest="command", required=True))
    return run_archive_command(parser.parse_args(["archive", *argv]))
