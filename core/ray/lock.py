"""The engine lock: one Ray actor that serialises weight updates against the rollout engines."""

from __future__ import annotations

import threading

import ray


@ray.remote
class Lock:
    """A non-reentrant lock shared by the trainers and the rollout manager (acquire/release by any caller)."""

    def __init__(self) -> None:
        self._held = threading.Lock()

    def acquire(self, timeout: float = -1) -> bool:
        """Take the lock; returns False when `timeout` (seconds, -1 = forever) ran out first."""
        return self._held.acquire(timeout=timeout)

    def release(self) -> None:
        """Release the lock; releasing a lock nobody holds is an error."""
        if not self._held.locked():
            raise RuntimeError("Engine lock released while not held")
        self._held.release()

    def locked(self) -> bool:
        return self._held.locked()
