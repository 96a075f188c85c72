"""What rollout functions return, and how finished groups become one batch output.

A rollout function returns a `RolloutFnTrainOutput` (or a bare list of groups, or a reference to one);
`call_rollout_fn` normalises these. `finalize_rollout_groups` orders the finished groups and, with a
durable transport, publishes a batch manifest that references the already published groups (nothing is
loaded or copied unless a batch hook needs the Samples).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from slime.data.refs import DiskPayloadRef, RawRolloutRef, RolloutGroupRef
from slime.utils.types import Sample


@dataclass
class RolloutFnTrainOutput:
    """Training rollout result: groups (a list, or a reference to a published list) and metrics."""

    samples: list | DiskPayloadRef
    metrics: dict | None = None
    on_accepted: Callable[[], Any] | None = field(default=None, repr=False, compare=False)
    sample_refs: Any = field(default=None, repr=False, compare=False)


@dataclass
class RolloutFnEvalOutput:
    """Evaluation rollout result: per-dataset data and metrics."""

    data: dict
    metrics: dict | None = None


def call_rollout_fn(fn: Callable[..., Any], *args: Any, evaluation: bool, **kwargs: Any) -> Any:
    """Call a rollout function and normalise its result to the output types above."""
    output = fn(*args, **kwargs, evaluation=evaluation)
    if isinstance(output, RawRolloutRef):
        if evaluation:
            raise TypeError("Unsupported rollout output: an accepted RawRolloutRef cannot be an evaluation result")
        return output
    if evaluation:
        if isinstance(output, RolloutFnEvalOutput):
            return output
        if isinstance(output, dict):
            return RolloutFnEvalOutput(data=output)
    else:
        if isinstance(output, RolloutFnTrainOutput):
            if not isinstance(output.samples, (list, DiskPayloadRef)):
                raise TypeError(
                    f"Unsupported rollout output: RolloutFnTrainOutput.samples must be a list or DiskPayloadRef, "
                    f"got {type(output.samples).__name__}"
                )
            return output
        if isinstance(output, (list, DiskPayloadRef)):
            return RolloutFnTrainOutput(samples=output)
    kind = "evaluation" if evaluation else "training"
    raise TypeError(f"Unsupported rollout output: {type(output).__name__} from {fn!r} for {kind}")


def iter_samples(value: Any) -> Iterator[Sample]:
    """Sample leaves of arbitrarily nested lists/tuples, depth first (a Sample yields itself)."""
    if isinstance(value, Sample):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_samples(item)


def _group_order(group: Any) -> int:
    if isinstance(group, RolloutGroupRef):
        return group.index or 0
    first = next(iter_samples(group), None)
    return (first.index if first is not None else None) or 0


def finalize_rollout_groups(
    args: Any, rollout_id: Any, groups: list, metrics: dict | None = None, *, session: Any = None
) -> RolloutFnTrainOutput:
    """Sort finished groups (without loading them), run the batch filter if any, and publish the batch.

    `session` is the run's transport session (default: `current_session(args)`); Samples the batch filter
    (`--rollout-sample-filter-path`) removed are reported to it by identity.
    """
    from slime.interfaces import current_session
    from slime.utils import misc

    session = session if session is not None else current_session(args)
    groups.sort(key=_group_order)
    dropped: list = []
    hook_path = getattr(args, "rollout_sample_filter_path", None)
    if hook_path:
        groups = session.load_groups(groups)
        incoming = list(iter_samples(groups))
        misc.load_function(misc.plugin_name("batch_filters", hook_path, args))(args, groups)
        kept = {id(sample) for sample in iter_samples(groups)}
        dropped = [sample for sample in incoming if id(sample) not in kept]
    samples = session.publish_batch(groups, rollout_id, dropped=dropped)
    return RolloutFnTrainOutput(samples=samples, metrics=metrics)
