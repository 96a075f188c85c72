"""`PhaseTimer`: wall-clock seconds spent in the named phases of one rollout step.

The rollout manager times `generate`, `convert` and `store`; the driver times `train`, `save`,
`update_weights` and the whole `step`. Each becomes a `perf/<phase>_time` metric in `metrics.jsonl`, which
is where `benchmarks/e2e.py` reads the step-time breakdown from.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    """Accumulates seconds per phase name; a phase entered twice adds up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body under `name` (also when it raises: the time was spent)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def metrics(self) -> dict[str, float]:
        """`{"perf/<phase>_time": seconds}` for every phase timed so far."""
        return {f"perf/{name}_time": seconds for name, seconds in self.seconds.items()}
