"""Errors `slime-run` prints as `slime-run: error: ...` without a traceback: the user's to fix (a bad path, a busy
save directory; exit status 2) and a run stopped by the death of one of its processes (exit status 1). Everything
else is our bug and shows in full."""

from __future__ import annotations


class UsageError(RuntimeError):
    """A user's mistake, with a message that names the file or flag and the fix."""


class RunInterrupted(RuntimeError):
    """A process of the run died (killed, out of memory, its node lost); the message says how to resume."""
