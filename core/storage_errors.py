"""Storage faults: a save directory or straw pool whose filesystem is full, over quota or read-only.

Such a fault is not a bug of the run but the end of it, and the user's to fix: `storage_fault` recognises one in
whatever exception reached the driver (an `OSError` with errno ENOSPC, EDQUOT or EROFS, also when a Ray task error
wraps it or when a component re-raised it as another exception, whose chain or remote traceback then shows it) and
`fault_message` says in one line what failed where and how to go on; the driver raises it as `RunInterrupted`.

Where a component knows better than the OS error what it was writing (the checkpoint it saved, say), it re-raises
the fault with `with_context` as a `StorageWriteError` naming the operation and the path. Where a writer hides the
errno (torch's C++ stream writer raises a bare `RuntimeError`), `with_context` asks the filesystem instead
(`probe_filesystem`: read-only, or no space left), and so does `storage_fault` as a last resort.
"""

from __future__ import annotations

import errno as errno_codes
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

#: The errnos that mean "the storage refuses writes", with how the message names each.
STORAGE_ERRNOS: dict[int, str] = {
    errno_codes.ENOSPC: "no space left on device",
    errno_codes.EDQUOT: "disk quota exceeded",
    errno_codes.EROFS: "read-only file system",
}

_REMEDIES: dict[int, str] = {
    errno_codes.ENOSPC: "free space on that filesystem",
    errno_codes.EDQUOT: "free space within your quota on that filesystem (or have it raised)",
    errno_codes.EROFS: "make that filesystem writable again (remount it read-write)",
}

#: A filesystem with less than this much space available to the run counts as full when a write failed on it.
LOW_SPACE_BYTES = 1 << 20

#: What the run was writing, by the function of the run that wrote it (the innermost one named here wins).
_FUNCTION_OPERATIONS: dict[str, str] = {
    "commit_checkpoint": "committing the joint checkpoint",
    "_advance_logical_root": "committing the joint checkpoint",
    "_write_rank0_checkpoint": "saving the model checkpoint",
    "_export_weights": "exporting the new weights for the engines",
    "_reload_rollout_weights_from_disk": "handing the new weights to the engines",
    "log_metrics": "writing the run's metrics",
    "save_state": "saving the rollout queue and batch-builder state",
    "publish_rollout_async": "storing a rollout in the straw pool",
}

#: Else by the Ray actor method the driver called (`RayTaskError.function_name` or the remote traceback's title).
_METHOD_OPERATIONS: dict[str, str] = {
    "save_model": "saving the model checkpoint",
    "update_weights": "exporting the new weights for the engines",
    "save": "saving the rollout queue and batch-builder state",
    "generate": "storing a rollout in the straw pool",
    "training_completed": "recording a trained step in the straw pool",
    "dispose": "closing the straw pool",
}

#: Else by the Ray actor class.
_ACTOR_OPERATIONS: dict[str, str] = {"RolloutQueueController": "recording the rollout queue in the straw pool"}

#: Operations that write the straw pool: without a file named, the message names the pool's filesystem.
_POOL_OPERATIONS = frozenset(
    {
        "storing a rollout in the straw pool",
        "recording a trained step in the straw pool",
        "closing the straw pool",
        "recording the rollout queue in the straw pool",
    }
)

# How the texts of exceptions spell these errnos: Python's OSError ("[Errno 28] No space left on device: 'x'"),
# Rust's io::Error ("No space left on device (os error 28)"), and the bare strerror of C and C++ libraries.
_PYTHON_ERRNO = re.compile(r"\[Errno (\d+)\] [^\n:]*(?:: '([^'\n]+)')?")
_RUST_ERRNO = re.compile(r"\(os error (\d+)\)")
_STRERRORS = {os.strerror(number): number for number in STORAGE_ERRNOS}
# How Ray titles an actor method in a remote traceback: `ray::Class.method()` (in colour codes on a terminal).
_PROCTITLE = re.compile(r"ray::([A-Za-z_]\w*)\.([A-Za-z_]\w*)\(\)")
# A frame of a traceback as text (a Ray task error's remote one): `  File "path", line N, in function`.
_FRAME = re.compile(r'File "[^"\n]*", line \d+, in ([A-Za-z_]\w*)')


class StorageWriteError(OSError):
    """A storage fault re-raised with what was being written (`operation`, e.g. "saving the model checkpoint") and
    where (`filename`); pickles across Ray like any OSError, its `operation` included."""

    def __init__(self, errno: int, strerror: str, filename: str | None = None, operation: str | None = None) -> None:
        super().__init__(errno, strerror, filename)
        self.operation = operation

    def __reduce__(self):  # type: ignore[override]
        return (type(self), (self.errno, self.strerror, self.filename, self.operation))


@dataclass(frozen=True)
class StorageFault:
    """A recognised storage fault: the errno, the file the OS or the writer named (None when unknown), what was
    being written, and the Ray actor method that wrote it (None outside Ray)."""

    errno: int
    filename: str | None = None
    operation: str | None = None
    component: str | None = None

    @property
    def reason(self) -> str:
        return STORAGE_ERRNOS[self.errno]


def _links(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and every exception it chains: `__cause__`, `__context__` and a Ray task error's `cause`."""
    pending, seen = [exc], set()
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [getattr(current, "cause", None), current.__cause__, current.__context__]


def _texts(link: BaseException) -> Iterator[str]:
    traceback_str = getattr(link, "traceback_str", None)  # a Ray task error: the remote traceback, chain included
    if isinstance(traceback_str, str):
        yield traceback_str
    yield str(link)


def _from_text(text: str) -> tuple[int, str | None] | None:
    for match in _PYTHON_ERRNO.finditer(text):
        if int(match.group(1)) in STORAGE_ERRNOS:
            filename = match.group(2)
            return int(match.group(1)), filename if filename and os.path.isabs(filename) else None
    for match in _RUST_ERRNO.finditer(text):
        if int(match.group(1)) in STORAGE_ERRNOS:
            return int(match.group(1)), None
    for strerror, number in _STRERRORS.items():
        if strerror in text:
            return number, None
    return None


def _components(exc: BaseException) -> list[str]:
    """`Class.method` of the Ray actor methods the chain passed through, outermost first: a Ray task error's
    `function_name` (a dual-class wrapper drops it) and the `ray::Class.method()` titles of its remote traceback."""
    found: list[str] = []
    for link in _links(exc):
        name = getattr(link, "function_name", None)
        if isinstance(name, str) and "." in name:
            found.append(".".join(name.rsplit(".", 2)[-2:]))
        for text in _texts(link):
            found += [f"{match.group(1)}.{match.group(2)}" for match in _PROCTITLE.finditer(text)]
    return list(dict.fromkeys(found))


def _functions(exc: BaseException) -> list[str]:
    """The functions the chain's tracebacks passed through, local (`__traceback__`) and remote (as text)."""
    names: list[str] = []
    for link in _links(exc):
        traceback = link.__traceback__
        while traceback is not None:
            names.append(traceback.tb_frame.f_code.co_name)
            traceback = traceback.tb_next
        for text in _texts(link):
            names += _FRAME.findall(text)
    return names


def _component(exc: BaseException) -> tuple[str | None, str | None]:
    """(the innermost actor method of the chain, what the run was writing where a function or method says so)."""
    components = _components(exc)
    operations = [_FUNCTION_OPERATIONS[name] for name in _functions(exc) if name in _FUNCTION_OPERATIONS]
    methods = [name.rsplit(".", 1)[-1] for name in components]
    operations = operations or [_METHOD_OPERATIONS[name] for name in methods if name in _METHOD_OPERATIONS]
    actors = [name.rsplit(".", 1)[0] for name in components]
    operations = operations or [_ACTOR_OPERATIONS[name] for name in actors if name in _ACTOR_OPERATIONS]
    return (components[-1] if components else None), (operations[-1] if operations else None)


def _filename(error: OSError) -> str | None:
    """The absolute path an OSError names (a relative one, e.g. from `shutil.rmtree`'s directory descriptors, names
    no place the user could find)."""
    if error.filename is None:
        return None
    filename = os.fsdecode(error.filename)
    return filename if os.path.isabs(filename) else None


def find_storage_fault(exc: BaseException) -> StorageFault | None:
    """The storage fault `exc` reports, directly or anywhere in its chain; None when it reports none.

    An `OSError` with a storage errno wins (a `StorageWriteError` first, then one naming an absolute path, outermost
    first); otherwise the texts of the chain (a Ray task error's remote traceback shows exceptions lost in transit).
    """
    component, operation = _component(exc)
    found = [link for link in _links(exc) if isinstance(link, OSError) and link.errno in STORAGE_ERRNOS]
    if found:
        explicit = [link for link in found if getattr(link, "operation", None)]
        best = (explicit or [link for link in found if _filename(link)] or found)[0]
        return StorageFault(best.errno, _filename(best), getattr(best, "operation", None) or operation, component)
    for link in _links(exc):
        for text in _texts(link):
            parsed = _from_text(text)
            if parsed is not None:
                return StorageFault(parsed[0], parsed[1], operation, component)
    return None


def probe_filesystem(path: str | os.PathLike) -> int | None:
    """EROFS when the filesystem holding `path` (or its nearest existing parent) is mounted read-only, ENOSPC when
    it has less than `LOW_SPACE_BYTES` available, else None (also when it cannot be examined)."""
    current = Path(path)
    while not current.exists() and current != current.parent:
        current = current.parent
    try:
        stats = os.statvfs(current)
    except OSError:
        return None
    if stats.f_flag & os.ST_RDONLY:
        return errno_codes.EROFS
    if stats.f_bavail * stats.f_frsize < LOW_SPACE_BYTES:
        return errno_codes.ENOSPC
    return None


def storage_fault(exc: BaseException, paths: Iterable[str | os.PathLike | None] = ()) -> StorageFault | None:
    """`find_storage_fault(exc)`, else, when a filesystem of `paths` (the run's save dir and straw pool) is now
    read-only or full, that fault (its filename None: the writer did not say which file); None otherwise."""
    fault = find_storage_fault(exc)
    if fault is not None:
        return fault
    for path in paths:
        if path is not None and (number := probe_filesystem(path)) is not None:
            component, operation = _component(exc)
            return StorageFault(number, None, operation, component)
    return None


def with_context(
    exc: BaseException, filename: str | os.PathLike, operation: str, *, probe: bool = True
) -> StorageWriteError | None:
    """A `StorageWriteError` naming `operation` and `filename` when `exc` is a storage fault (by its chain, or with
    `probe` by the state of `filename`'s filesystem now: call it before cleaning up what the failed write left);
    None otherwise. Raise it `from exc`."""
    fault = find_storage_fault(exc)
    number = fault.errno if fault is not None else (probe_filesystem(filename) if probe else None)
    if number is None:
        return None
    return StorageWriteError(number, os.strerror(number), os.fspath(filename), operation)


def _filesystem_of(paths: list[str]) -> str | None:
    """The first of `paths` whose filesystem is read-only or full now, else the first of them."""
    for path in paths:
        if probe_filesystem(path) is not None:
            return path
    return paths[0] if paths else None


def fault_message(
    fault: StorageFault, *, save: str | None, pool: str | None = None, resume_root: str | None = None
) -> str:
    """One line for `slime-run: error: ...`: the fault, the operation and component where known, the path (the
    file, else the filesystem of the save dir or pool), the remedy, and how to resume (the same command, from the
    last joint commit of `resume_root`, the logical save dir, default `save`)."""
    ordered = (pool, save) if fault.operation in _POOL_OPERATIONS else (save, pool)
    paths = [str(path) for path in ordered if path]
    if fault.filename:
        place = fault.filename
    else:
        filesystem = _filesystem_of(paths)
        place = f"on the filesystem holding {filesystem}" if filesystem else "on the run's storage"
    if fault.operation:
        detail = f" ({fault.component})" if fault.component else ""
        what = f"{fault.operation}{detail}, " + (f"writing {place}" if fault.filename else place)
    else:
        what = f"writing {place}" + (f" (in {fault.component})" if fault.component else "")
    root = resume_root or save
    if root:
        resume = (
            "rerun the same command: it resumes from its last joint commit "
            f"(`slime-run runs {root}` shows which step that is)"
        )
    else:
        resume = "rerun the same command (this run saves no checkpoints: it starts over)"
    return f"{fault.reason} while {what}; {_REMEDIES[fault.errno]} and {resume}"
