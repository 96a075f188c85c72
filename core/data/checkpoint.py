"""Joint checkpoints: selection of what to restore, and the commit that makes a training step durable."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class RestorePlan:
    """What `resolve_checkpoint` selected for this run; travels to the queue controller and the manager."""

    mode: Literal["new", "resume", "snapshot", "empty"] = "new"
    root: str | None = None
    expected_current: str | None = None
    branch: dict[str, Any] | None = None
    queue_id: str | None = None
    dataset_cursor: str | None = None


@dataclass(frozen=True)
class SourceRestore:
    """What the data source restored: a fresh queue (fork) and/or the retained source reference."""

    new_queue: bool = False
    source_ref: Any = None
