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


def _receipt_positions(groups: list) -> set[int]:
    return {
        sample._queue_receipt["position"]
        for sample in iter_samples(groups)
        if getattr(sample, "_queue_receipt", None) is not None
    }


def finalize_rollout_groups(
    args: Any, rollout_id: Any, groups: list, metrics: dict | None = None, *, controller: Any = None
) -> RolloutFnTrainOutput:
    """Sort finished groups (without loading them), run the batch hook if any, and publish the batch."""
    from slime.data import transport
    from slime.utils import misc

    groups.sort(key=_group_order)
    dropped: list[int] = []
    hook_path = getattr(args, "rollout_sample_filter_path", None)
    if hook_path:
        groups = transport.load_rollout_samples(groups)
        incoming = _receipt_positions(groups)
        misc.load_function(hook_path)(args, groups)
        dropped = sorted(incoming - _receipt_positions(groups))
    samples = transport.pack_rollout_payload(groups, args, rollout_id)
    if dropped and transport.use_straw(args):
        if controller is None:
            raise ValueError("The batch hook dropped queue samples but no coordinator binding was given")
        import ray

        record = transport.pack_rollout_payload(
            {"positions": dropped, "reason": "rollout_sample_filter", "output": samples}, args, rollout_id
        )
        ray.get(controller.record_dispositions.remote(record.manifest))
    return RolloutFnTrainOutput(samples=samples, metrics=metrics)
