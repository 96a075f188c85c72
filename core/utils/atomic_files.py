"""Durable-before-visible file writes: write a temporary sibling, fsync it, rename it, fsync the directory."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries, e.g. a rename, durable)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0)
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file under `root`, then every directory, deepest first, then `root` itself."""
    root = Path(root)
    for path in sorted(root.rglob("*")):
        if path.is_file():
            fsync_path(path)
    for path in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        fsync_path(path)
    fsync_path(root)


def write_atomically(path: str | os.PathLike, write: Callable[[IO[Any]], None], *, binary: bool = True) -> Path:
    """Create or replace `path` with what `write(handle)` writes; readers see the old file or the whole new one.

    A failure leaves the previous file (if any) untouched and removes the temporary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path
