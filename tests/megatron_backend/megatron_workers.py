"""A pool of spawned worker processes joined in one gloo process group, for the Megatron tests.

Starting a process that imports torch, transformers and megatron-core costs seconds, so the pool starts its ranks
once per test session and runs many jobs on them: `Workers.run(fn, *args)` calls `fn(rank, *args)` on every rank
and returns the ranks' results in rank order. Jobs set up and tear down Megatron's parallel state themselves (see
`megatron_parallel`), so consecutive jobs may use different layouts. Megatron's CPU fixes are only ever applied
inside the workers, never in the pytest process.

`fn` must be importable by name from the workers (a module-level function of a test module or of this one);
arguments and results travel by pickle. A job that fails on any rank raises `WorkerError` with the tracebacks;
a job that does not finish within its timeout (or within `ERROR_GRACE_S` of another rank's failure) kills the
pool, since a hung collective cannot be recovered, and later jobs fail at once.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from typing import Any

DEFAULT_TIMEOUT_S = 120.0
#: How long the other ranks may still take once one rank has failed.
ERROR_GRACE_S = 10.0


class WorkerError(AssertionError):
    """A job raised on at least one rank (the message carries every failing rank's traceback)."""


def _worker_main(rank: int, world_size: int, store: str, connection: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # megatron-core's import-time notices about optional CUDA packages (TransformerEngine, Apex) it falls back from.
    warnings.filterwarnings("ignore", message=r".*(is|are) not installed\. Falling back")
    warnings.filterwarnings("ignore", message="full scope is deprecated")
    os.setpgid(0, 0)  # a group of its own: killing the pool also ends helper processes a job started
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        while True:
            message = connection.recv()
            if message is None:
                return
            fn, args = message
            try:
                connection.send(("ok", fn(rank, *args)))
            except BaseException:  # noqa: BLE001 - reported to the test process verbatim
                connection.send(("error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class Workers:
    """`world_size` spawned ranks in one gloo group (see the module docstring)."""

    def __init__(self, world_size: int = 2) -> None:
        context = multiprocessing.get_context("spawn")
        self._store_dir = tempfile.mkdtemp(prefix="megatron-test-store-")  # a file rendezvous: no port to race for
        store = os.path.join(self._store_dir, "store")
        self.world_size = world_size
        self._connections = []
        self._processes = []
        for rank in range(world_size):
            parent, child = context.Pipe()
            # Not daemonic: Megatron's checkpointing starts helper processes, which daemons may not have.
            process = context.Process(target=_worker_main, args=(rank, world_size, store, child))
            process.start()
            child.close()
            self._connections.append(parent)
            self._processes.append(process)
        atexit.register(self.close, kill=True)  # before multiprocessing's exit handler joins the ranks

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S) -> list[Any]:
        """`fn(rank, *args)` on every rank; the results in rank order."""
        if not self._connections:
            raise WorkerError(f"cannot run {fn.__name__}: the worker pool was stopped by an earlier failure")
        for connection in self._connections:
            connection.send((fn, args))
        replies: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.world_size:
            waiting = {self._connections[rank]: rank for rank in range(self.world_size) if rank not in replies}
            if any(status != "ok" for status, _ in replies.values()):
                # A rank failed: the others may wait forever in a collective it never joins.
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
            ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close(kill=True)
                stuck = sorted(waiting.values())
                replies.update({rank: ("error", f"did not finish within {timeout:.0f} s") for rank in stuck})
                break
            for connection in ready:
                rank = waiting[connection]
                try:
                    replies[rank] = connection.recv()
                except EOFError:
                    replies[rank] = ("error", "the process died")
        errors = [f"rank {rank}: {value}" for rank, (status, value) in sorted(replies.items()) if status != "ok"]
        if errors:
            if not all(process.is_alive() for process in self._processes):
                self.close(kill=True)
            raise WorkerError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return [replies[rank][1] for rank in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (politely unless `kill`)."""
        for connection in self._connections:
            if not kill:
                with contextlib.suppress(OSError):
                    connection.send(None)
            connection.close()
        for process in self._processes:
            process.join(timeout=0 if kill else 30)
            if kill or process.is_alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.join(timeout=10)
        self._connections, self._processes = [], []
        shutil.rmtree(self._store_dir, ignore_errors=True)


@contextlib.contextmanager
def megatron_parallel(layout: Any, seed: int = 1234) -> Iterator[None]:
    """Megatron's parallel state for one job on a worker (torch.distributed is already up)."""
    from slime.plugins.megatron_backend.model import destroy_parallel, initialize_parallel

    initialize_parallel(layout, seed=seed)
    try:
        yield
    finally:
        destroy_parallel()
