"""Helpers for the long-lived child processes a run starts (engine servers, the router).

`die_with_parent` is a `subprocess.Popen(preexec_fn=...)` that asks the kernel to SIGKILL the child when the
thread that started it dies (`PR_SET_PDEATHSIG`, Linux). A run killed at any moment (its Ray workers SIGKILLed)
then leaves no server or router behind, whatever process group the child runs in. Start such children from a
thread that lives as long as they should: a Ray actor's main thread, not a short-lived worker thread.
"""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when its parent thread dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
