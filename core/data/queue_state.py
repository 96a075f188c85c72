"""A Sample's queue bookkeeping: one typed record, and the one table of where it lives on the Sample.

The queue stamps each Sample it hands out with its task authorization and provenance, and the stamps travel
with the Sample through generation, publication and acceptance. They are stored as plain attributes
(`_queue_lease`, `_queue_receipt`, ...; the attribute names are part of the acceptance spec and of archived
records), but nothing reads or writes them by name except through this module: `QueueState.of(sample)`
reads the typed record, `stamp`/`set` write fields, `clear_live` removes what is valid only inside a live
queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Field -> Sample attribute. Leading underscores mark the authorizations an archive must not carry back.
ATTRIBUTES = {
    "lease": "_queue_lease",
    "receipt": "_queue_receipt",
    "source_positions": "_queue_source_positions",
    "resume_origin": "_queue_resume_origin",
    "generation_start": "_queue_generation_start",
    "branch": "_queue_branch",
    "policy_segments": "queue_policy_segments",
    "generation_requests": "queue_generation_requests",
}
#: Fields that authorize work in one live queue; an archived or replayed Sample must not keep them.
LIVE_FIELDS = ("lease", "receipt", "source_positions", "generation_start", "resume_origin")


@dataclass(frozen=True)
class QueueState:
    """What the queue recorded on one Sample (every field None when the Sample never came from a queue).

    `lease`: the task authorization (a `straw.protocol.Lease` as a dict) while the group is being generated;
    `receipt`: the commit receipt (as a dict) once the group was accepted; `source_positions`: queue positions
    the Sample's prompt came from; `generation_start` / `branch` / `policy_segments`: which tokens which
    branch generated (provenance); `generation_requests`: requests a custom generate function made for it;
    `resume_origin`: where a resumed Sample was handed back.
    """

    lease: dict | None = None
    receipt: dict | None = None
    source_positions: list | None = None
    resume_origin: Any = None
    generation_start: int | None = None
    branch: str | None = None
    policy_segments: list | None = None
    generation_requests: int | None = None

    @classmethod
    def of(cls, sample: Any) -> QueueState:
        """The record stamped on `sample` (a Sample or anything with a `__dict__`)."""
        values = vars(sample) if hasattr(sample, "__dict__") else {}
        return cls(**{name: values.get(attribute) for name, attribute in ATTRIBUTES.items()})

    @property
    def position(self) -> int | None:
        """The accepted queue position (from the receipt), or None before acceptance."""
        return None if self.receipt is None else int(self.receipt["position"])

    @property
    def task_id(self) -> str | None:
        """The queue task this Sample belongs to (receipt first, then lease), or None."""
        authorization = self.receipt or self.lease
        if authorization is None:
            return None
        task_id = authorization.get("task_id") if isinstance(authorization, dict) else authorization.task_id
        return None if task_id is None else str(task_id)


def stamp(sample: Any, **values: Any) -> None:
    """Set the given fields of `sample`'s record."""
    for name, value in values.items():
        setattr(sample, ATTRIBUTES[name], value)


def remove(sample: Any, *names: str) -> None:
    """Remove the given fields from `sample`'s record (absent ones are ignored)."""
    for name in names:
        sample.__dict__.pop(ATTRIBUTES[name], None)


def copy_state(source: Any, target: Any) -> None:
    """Give `target` every field `source` has (a Sample a custom generate function made from `source`)."""
    for attribute in ATTRIBUTES.values():
        if attribute in vars(source):
            setattr(target, attribute, getattr(source, attribute))


def clear_live(sample: Any) -> None:
    """Remove the live-queue authorizations (`LIVE_FIELDS`); provenance stays."""
    remove(sample, *LIVE_FIELDS)
