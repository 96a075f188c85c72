"""Atomic writes: readers see the old file or the whole new one; a failed write leaves no trace."""

from __future__ import annotations

import pytest

from slime.utils.atomic_files import fsync_path, write_atomically


def test_replaces_whole_file_and_leaves_no_partial(tmp_path):
    path = write_atomically(tmp_path / "sub" / "state.bin", lambda handle: handle.write(b"one"))
    write_atomically(path, lambda handle: handle.write(b"two"))
    assert path.read_bytes() == b"two"
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.bin"]
    fsync_path(path)
    fsync_path(path.parent)


def test_failed_write_keeps_the_old_file(tmp_path):
    path = write_atomically(tmp_path / "state.txt", lambda handle: handle.write("old"), binary=False)

    def explode(handle):
        handle.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomically(path, explode, binary=False)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.txt"]
