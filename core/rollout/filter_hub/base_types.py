"""Result type of dynamic-sampling filters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicFilterOutput:
    """Whether a finished group is kept; `reason` names why it was dropped (for metrics)."""

    keep: bool
    reason: str | None = None
