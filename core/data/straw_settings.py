"""The straw transport's settings, read once from a run's arguments and validated there.

Every module of straw's data path (the writer cache, the queue controller and readers, the batch builder,
joint checkpoints) reads these fields instead of the argument namespace. Arguments may be partial (tools
and tests build them by hand): a missing option takes its default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_RUN_ID = "rollout"
DEFAULT_LEASE_SECONDS = 300
DEFAULT_TAKE_TIMEOUT_S = 600.0
DEFAULT_IO_CONCURRENCY = 16
DEFAULT_GC_INTERVAL_S = 60.0
COMPRESSIONS = (None, "none", "zstd")


@dataclass(frozen=True)
class StrawSettings:
    """What the `rollout data` group of `slime-run --help` sets (pool, queue, storage, compression, I/O)."""

    pool: str | None = None
    run_id: str = DEFAULT_RUN_ID
    storage_profile: str = "local"
    storage_declaration: str | None = None
    segment_mib: float | None = None
    online_gc: bool = False
    gc_interval_s: float = DEFAULT_GC_INTERVAL_S
    lease_seconds: int = DEFAULT_LEASE_SECONDS
    take_timeout_s: float = DEFAULT_TAKE_TIMEOUT_S
    compression: str | None = None
    io_concurrency: int = DEFAULT_IO_CONCURRENCY

    @classmethod
    def from_args(cls, args: Any) -> StrawSettings:
        """The settings of `args` (defaults for options it lacks); a bad value names its flag."""

        def pick(name: str, default: Any) -> Any:
            value = getattr(args, name, None)
            return default if value is None else value

        compression = pick("rollout_data_compression", None)
        if compression not in COMPRESSIONS:
            raise ValueError(f"Unsupported --rollout-data-compression {compression!r}; choose none or zstd")
        settings = cls(
            pool=pick("rollout_data_dir", None),
            run_id=pick("rollout_queue_run_id", None) or DEFAULT_RUN_ID,
            storage_profile=pick("rollout_storage_profile", None) or "local",
            storage_declaration=pick("rollout_storage_declaration", None),
            segment_mib=pick("rollout_queue_segment_mib", None),
            online_gc=bool(pick("rollout_queue_online_gc", False)),
            gc_interval_s=float(pick("rollout_queue_gc_interval", DEFAULT_GC_INTERVAL_S)),
            lease_seconds=int(pick("rollout_queue_lease_seconds", DEFAULT_LEASE_SECONDS)),
            take_timeout_s=float(pick("rollout_queue_take_timeout", DEFAULT_TAKE_TIMEOUT_S)),
            compression="zstd" if compression == "zstd" else None,
            io_concurrency=int(pick("rollout_io_concurrency", DEFAULT_IO_CONCURRENCY)),
        )
        for flag, value, minimum in (
            ("--rollout-queue-segment-mib", settings.segment_mib, 1e-3),
            ("--rollout-queue-gc-interval", settings.gc_interval_s, 1e-3),
            ("--rollout-queue-lease-seconds", settings.lease_seconds, 3),
            ("--rollout-queue-take-timeout", settings.take_timeout_s, 1e-3),
            ("--rollout-io-concurrency", settings.io_concurrency, 1),
        ):
            if value is not None and value < minimum:
                raise ValueError(f"{flag} must be at least {minimum:g}, got {value}")
        return settings
