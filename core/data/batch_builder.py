"""`BatchBuilder`: turn one accepted rollout step into per-rank training shares, durably and replayably.

With a durable transport every training batch is a control task in the queue's accepted log:
`begin` persists the batch's selection and conversion configuration (the *plan*) before any hook runs,
`publish_converted` publishes the conversion and accepts it as the batch task's result, and `split_by_dp`
hands each data-parallel rank a small `TrainBatchRef` (a column selection of that one conversion plus the
rank's schedule), so no per-rank payload is ever written. Replaying `begin` after a crash reuses the stored
plan and, once converted, rebuilds the very same per-rank references without writing anything.
How the shares travel is the run's transport's business (`Transport.shard_batch`): the straw transport calls
`durable_shares` here, in-memory transports put per-rank dicts into Ray; both use `dp_schedule`.

Module-level `ray` and `build_dp_schedule` are looked up at call time (tests patch them).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from slime.data.queue_state import QueueState
from slime.data.refs import DiskPayloadRef, TrainBatchRef
from slime.data.straw_settings import StrawSettings
from slime.data.transport import pack_rollout_payload, rollout_store
from slime.interfaces import run_transport
from slime.utils.dp_schedule import build_dp_schedule
from slime.utils.misc import Box, load_function, plugin_name
from slime.utils.types import Sample

#: Per-sample columns partitioned across data-parallel ranks.
PARTITIONED_FIELDS = (
    "tokens",
    "multimodal_train_inputs",
    "response_lengths",
    "rewards",
    "truncated",
    "loss_masks",
    "round_number",
    "sample_indices",
    "rollout_ids",
    "rollout_mask_sums",
    "rollout_log_probs",
    "rollout_topk_token_ids",
    "rollout_topk_log_probs",
    "rollout_top_p_token_ids",
    "rollout_top_p_token_offsets",
    "rollout_top_p_log_probs",
    "rollout_routed_experts",
    "source_names",
    "prompt",
    "teacher_log_probs",
    "train_metadata",
)
#: Columns every rank receives whole.
GLOBAL_FIELDS = ("raw_reward", "total_lengths")
#: Arguments that change what a batch trains on; part of the plan identity.
PLAN_CONFIGURATION = (
    "custom_reward_post_process_path",
    "custom_convert_samples_to_train_data_path",
    "advantage_estimator",
    "rewards_normalization",
    "grpo_std_normalization",
    "reward_key",
    "global_batch_size",
    "micro_batch_size",
    "use_dynamic_batch_size",
    "balance_data",
    "n_samples_per_prompt",
    "rollout_batch_size",
    "use_score_centering",
    "use_rollout_routing_replay",
)
_OPTIONAL_SAMPLE_FIELDS = (
    "rollout_log_probs",
    "rollout_topk_token_ids",
    "rollout_topk_log_probs",
    "teacher_log_probs",
    "multimodal_train_inputs",
)


def _record_set(value: Any) -> Any:
    from straw.protocol import RecordSetRef

    return value if isinstance(value, RecordSetRef) else RecordSetRef.from_dict(value)


def take_rows(values: Any, indices: list[int]) -> Any:
    """The rows `indices` of a column (a list, or a tensor indexed along its first dimension)."""
    if hasattr(values, "shape") and hasattr(values, "__getitem__") and not isinstance(values, list):
        return values[indices]
    return [values[i] for i in indices]


def _plan_changes(stored: dict, identity: dict) -> str:
    """Name what differs between a stored batch plan and the one being made (for the mismatch error)."""
    changes = []
    if stored.get("raw_digest") != identity["raw_digest"]:
        changes.append("the accepted raw rollout")
    for key, label in (("sample_indices", "the selected samples"), ("rollout_ids", "the samples' rollout ids")):
        if stored.get(key) != identity[key]:
            changes.append(label)
    stored_config = stored.get("configuration") or {}
    for name, value in identity["configuration"].items():
        if stored_config.get(name) != value:
            changes.append(f"--{name.replace('_', '-')} ({stored_config.get(name)!r} -> {value!r})")
    if stored.get("parallel") != identity["parallel"]:
        changes.append(f"the parallel layout ({stored.get('parallel')!r} -> {identity['parallel']!r})")
    return ", ".join(changes) or "the plan format"


@dataclass(frozen=True)
class DpSchedule:
    """How one batch is split across data-parallel ranks (from `build_dp_schedule`)."""

    partitions: list
    micro_batch_indices: list
    num_microbatches: list
    global_batch_sizes: list
    total_lengths: list

    def for_rank(self, rank: int) -> dict:
        """The schedule fields a rank's shard carries."""
        return {
            "partition": self.partitions[rank],
            "global_batch_sizes": self.global_batch_sizes,
            "num_microbatches": self.num_microbatches,
            "micro_batch_indices": self.micro_batch_indices[rank],
        }

    def rank_shard(self, data: dict, rank: int) -> dict:
        """Rank `rank`'s training dict from the converted batch `data`, as trainers load it: its rows of the
        per-sample columns, the global columns whole, its schedule, columns as tensors."""
        from slime.observability.rollout_data_utils import tensorize_rollout_data_for_training

        partition = self.partitions[rank]
        shard = {key: take_rows(data[key], partition) for key in PARTITIONED_FIELDS if data.get(key) is not None}
        shard.update({key: data[key] for key in GLOBAL_FIELDS if data.get(key) is not None})
        shard["total_lengths"] = list(self.total_lengths)
        shard.update(self.for_rank(rank))
        return tensorize_rollout_data_for_training(shard)


class BatchBuilder:
    """Plans, converts and shards one training batch per rollout step (see the module docstring)."""

    def __init__(self, args: Any, *, controller: Any = None) -> None:
        self.args = args
        self.controller = controller
        self.rollout_id = -1
        self.raw_ref = None
        self.batch_id: str | None = None
        self._plan: DiskPayloadRef | None = None
        self._lease: dict | None = None
        self.train_parallel_config: dict | None = None
        self._reward_hook = load_function(getattr(args, "custom_reward_post_process_path", None), args)
        self._convert_hook = load_function(getattr(args, "custom_convert_samples_to_train_data_path", None), args)
        # The registered estimator turning rewards into advantages; None: train on the raw rewards
        # (`--no-rewards-normalization`, or no `--advantage-estimator`).
        estimator = getattr(args, "advantage_estimator", None)
        normalize = getattr(args, "rewards_normalization", False) and estimator
        self._estimator = (
            load_function(plugin_name("advantage_estimators", estimator, args), args) if normalize else None
        )

    # ------------------------------------------------------------------------------------------ planning

    def _identity(self, samples: list[Sample]) -> dict:
        from straw.protocol import digest

        args = self.args
        identity = {
            "version": 1,
            "raw_digest": self.raw_ref.manifest.digest,
            "sample_indices": [sample.index for sample in samples],
            "rollout_ids": [sample.rollout_id for sample in samples],
            "configuration": {name: getattr(args, name, None) for name in PLAN_CONFIGURATION},
            "parallel": self.train_parallel_config,
        }
        return {**identity, "digest": digest(identity)}

    def _input_positions(self, samples: list[Sample]) -> list[int]:
        from straw.protocol import Lease

        positions = {self.raw_ref.receipt.position}
        for sample in samples:
            state = QueueState.of(sample)
            positions.update(state.source_positions or ())
            if state.receipt:
                positions.add(state.position)
            elif state.lease:
                result = ray.get(self.controller.result.remote(Lease(**state.lease)))
                if result is not None:
                    positions.add(result.position)
        return sorted(positions)

    def begin(self, samples: list[Sample], *, replay: bool = False) -> list[Box] | None:
        """Persist (or reuse) this step's batch plan; returns the per-rank refs when it was already converted."""
        if self.raw_ref is None:
            self.batch_id = self._plan = self._lease = None
            return None
        args = self.args
        self.batch_id = f"batch:{self.raw_ref.receipt.commit_id}"
        identity = self._identity(samples)
        existing = ray.get(self.controller.batch.remote(self.batch_id))
        if existing is not None:
            self._plan = DiskPayloadRef(_record_set(existing["plan_ref"]), args.rollout_data_dir)
            stored = self._plan.load()
            if not replay and stored["digest"] != identity["digest"]:
                raise ValueError(
                    f"An existing batch ID cannot be reused with a different selection or conversion plan "
                    f"({self.batch_id}; changed since it was planned: {_plan_changes(stored, identity)})"
                )
            self._lease = existing["lease"]
            if existing["ready"]:
                return self.split_by_dp(DiskPayloadRef(_record_set(existing["ready_ref"]), args.rollout_data_dir))
            positions = existing["input_positions"]
        else:
            positions = self._input_positions(samples)
            plan = {
                **identity,
                "raw": self.raw_ref,
                "input_positions": positions,
                "producer_processing": "training consumes the raw collection and the samples it replaced",
            }
            self._plan = pack_rollout_payload(plan, args, self.rollout_id, submission_id=f"plan:{self.batch_id}")
        batch = ray.get(self.controller.plan_batch.remote(self.batch_id, positions, self._plan.manifest))
        self._lease = batch["lease"]
        return None

    # ------------------------------------------------------------------------------------------ conversion

    def _rewards(self, samples: list[Sample]) -> tuple[list, list]:
        args = self.args
        if self._reward_hook is not None:
            return self._reward_hook(args, samples)
        raw = [sample.get_reward_value(args) for sample in samples]
        if self._estimator is None:
            return raw, list(raw)
        group = getattr(args, "n_samples_per_prompt", None) or 1
        advantages = self._estimator(args, raw, group, [sample.response_length for sample in samples])
        if len(advantages) != len(raw):
            raise ValueError(
                f"--advantage-estimator {args.advantage_estimator}: returned {len(advantages)} advantages for "
                f"{len(raw)} samples"
            )
        return raw, [float(value) for value in advantages]

    @staticmethod
    def _check_top_p(sample: Sample) -> None:
        offsets, ids = sample.rollout_top_p_token_offsets, sample.rollout_top_p_token_ids
        if offsets is None or ids is None or hasattr(offsets, "load") or hasattr(ids, "load"):
            return
        offsets = [int(v) for v in offsets]
        if (
            len(offsets) != sample.response_length + 1
            or offsets[0] != 0
            or offsets[-1] != len(ids)
            or any(b < a for a, b in zip(offsets, offsets[1:], strict=False))
        ):
            raise ValueError(
                f"Sample {sample.index}: rollout_top_p_token_offsets must be non-decreasing, start at 0, have "
                f"response_length + 1 entries and end at len(rollout_top_p_token_ids)"
            )

    def convert(self, samples: list[Sample]) -> dict:
        """The standard conversion of Samples into per-sample training columns (a custom hook replaces it)."""
        if self._convert_hook is not None:
            return self._convert_hook(self.args, samples)
        for sample in samples:
            if sample.rollout_id is None:
                sample.rollout_id = self.rollout_id
        raw_rewards, rewards = self._rewards(samples)
        loss_masks = []
        for sample in samples:
            mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
            if len(mask) != sample.response_length:
                raise ValueError(
                    f"Sample {sample.index}: loss_mask has {len(mask)} entries for response_length "
                    f"{sample.response_length}"
                )
            loss_masks.append(list(mask))
        data: dict[str, Any] = {
            "tokens": [sample.tokens for sample in samples],
            "response_lengths": [sample.response_length for sample in samples],
            "rewards": rewards,
            "raw_reward": raw_rewards,
            "truncated": [int(sample.status == Sample.Status.TRUNCATED) for sample in samples],
            "sample_indices": [sample.index for sample in samples],
            "rollout_ids": [sample.rollout_id for sample in samples],
            "loss_masks": loss_masks,
            "rollout_mask_sums": [float(sum(mask)) for mask in loss_masks],
        }
        if any("round_number" in (sample.metadata or {}) for sample in samples):
            data["round_number"] = [(sample.metadata or {}).get("round_number") for sample in samples]
        if any("source_name" in (sample.metadata or {}) for sample in samples):
            data["source_names"] = [(sample.metadata or {}).get("source_name") for sample in samples]
        for name in _OPTIONAL_SAMPLE_FIELDS:
            if any(getattr(sample, name) is not None for sample in samples):
                data[name] = [getattr(sample, name) for sample in samples]
        if any(sample.rollout_top_p_token_ids is not None for sample in samples):
            for sample in samples:
                self._check_top_p(sample)
            for name in ("rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_top_p_log_probs"):
                data[name] = [getattr(sample, name) for sample in samples]
        if any(sample.rollout_routed_experts is not None for sample in samples):
            data["rollout_routed_experts"] = [
                value if hasattr(value, "load") or value is None else sample.materialize_rollout_routed_experts()
                for sample in samples
                for value in [sample.rollout_routed_experts]
            ]
        if any(sample.train_metadata is not None for sample in samples):
            data["train_metadata"] = [sample.train_metadata for sample in samples]
        return data

    # ------------------------------------------------------------------------------------------ publication

    def publish_converted(self, data: dict) -> DiskPayloadRef:
        """Publish the conversion; for a planned batch, accept it as the batch task's result."""
        from slime.observability.rollout_data_utils import tensorize_rollout_data_for_training

        data = copy.copy(data)
        data["total_lengths"] = [len(tokens) for tokens in data["tokens"]]
        tensorize_rollout_data_for_training(data)
        if self._plan is not None:
            data["_plan"] = self._plan
        metadata = None
        if self.batch_id is not None:
            metadata = {"task_id": self.batch_id, "attempt_id": self._lease["attempt_id"]}
        reference = pack_rollout_payload(data, self.args, self.rollout_id, metadata=metadata)
        if self.batch_id is not None:
            ray.get(self.controller.ready_batch.remote(self.batch_id, reference.manifest))
        return reference

    def replay_converted(self, data: Any, batch_id: str | None) -> list[Box]:
        self.batch_id = batch_id
        return self.split_by_dp(data)

    def split_by_dp(self, data: Any) -> list[Box]:
        """One `Box` per data-parallel rank, as the run's transport moves them (`Transport.shard_batch`)."""
        return run_transport(self.args).shard_batch(self, data)

    def dp_schedule(self, data: dict) -> DpSchedule:
        """Split the converted batch `data` (at least `rollout_ids` and `tokens` or `total_lengths`) across ranks."""
        total_lengths = data.get("total_lengths")
        if total_lengths is None:
            total_lengths = [len(tokens) for tokens in data["tokens"]]
        partitions, micro_batch_indices, num_microbatches, global_batch_sizes = build_dp_schedule(
            self.args,
            self.train_parallel_config,
            total_lengths,
            global_batch_size=self.args.global_batch_size,
            rollout_indices=data["rollout_ids"],
        )
        return DpSchedule(partitions, micro_batch_indices, num_microbatches, global_batch_sizes, list(total_lengths))

    def durable_shares(self, data: Any) -> list[Box]:
        """Publish the conversion once (unless `data` already is it) and hand each rank a `TrainBatchRef` into it."""
        reference = data if isinstance(data, DiskPayloadRef) else self.publish_converted(data)
        schedule = self.dp_schedule(reference.load(selection={"total_lengths": None, "rollout_ids": None}))
        return self._durable_shares(reference, schedule)

    def _durable_shares(self, reference: DiskPayloadRef, schedule: DpSchedule) -> list[Box]:
        from straw.protocol import digest

        partitions = schedule.partitions
        micro_batch_indices = schedule.micro_batch_indices
        global_batch_sizes = schedule.global_batch_sizes

        plan_digest = digest(
            {
                "conversion": reference.manifest.digest,
                "partitions": partitions,
                "micro_batch_indices": micro_batch_indices,
                "global_batch_sizes": global_batch_sizes,
            }
        )
        boxes = []
        for rank, partition in enumerate(partitions):
            selection = {field: partition for field in PARTITIONED_FIELDS}
            selection.update({field: None for field in GLOBAL_FIELDS})
            ref = TrainBatchRef(
                reference.manifest,
                reference.root,
                self.batch_id,
                rank,
                plan_digest,
                selection=selection,
                schedule=schedule.for_rank(rank),
            )
            boxes.append(Box(ray.put(ref)))
        return boxes

    # ------------------------------------------------------------------------------------------ lifecycle

    def training_completed(self, rollout_id: int) -> None:
        """Training finished this step's batch: its conversion becomes processed in the queue."""
        if self.batch_id is None:
            return
        if rollout_id != self.rollout_id:
            raise ValueError(
                f"Training completion does not match the current batch (completed {rollout_id}, "
                f"current {self.rollout_id})"
            )
        ray.get(self.controller.finish_batch.remote(self.batch_id))

    def _state_path(self, rollout_id: int) -> Path:
        return Path(self.args.save) / "rollout" / f"builder_state_{rollout_id}.json"

    def save(self, rollout_id: int) -> None:
        """Write `builder_state_<id>.json`: the training consumer's state, retained for this checkpoint."""
        from straw.protocol import digest

        import slime.data.queue_data_source as facade

        state = ray.get(self.controller.training_state.remote())
        if state is None:
            return
        path = self._state_path(rollout_id).resolve()
        refs = [_record_set(state[key]) for key in ("state_ref", "progress_ref") if state.get(key)]
        owner = f"checkpoint:{path}:{digest([ref.digest for ref in refs])}"
        store, _, lock = rollout_store(self.args)
        with lock:
            store.retain(owner, refs)
        facade.write_report(
            path,
            {
                "version": 1,
                "run_id": StrawSettings.from_args(self.args).run_id,
                "rollout_id": rollout_id,
                "consumer": state,
                "storage_owner": owner,
            },
        )

    def load(self, rollout_id: int | None, *, source_restore: Any = None) -> None:
        """Rewind the training consumer to the checkpointed state (no-op for forks and fresh runs)."""
        args = self.args
        if not getattr(args, "load", None) or rollout_id is None:
            return
        if source_restore is not None and source_restore.new_queue:
            self.raw_ref = self.batch_id = self._plan = self._lease = None
            return
        import json

        path = Path(args.load) / "rollout" / f"builder_state_{rollout_id}.json"
        if not path.exists():
            return
        saved = json.loads(path.read_text())
        run_id = StrawSettings.from_args(args).run_id
        if saved.get("version") != 1 or saved.get("run_id") != run_id:
            raise ValueError(f"BatchBuilder checkpoint run/schema differs: {path} (expected version 1, run {run_id})")
        consumer = saved["consumer"]
        retained = getattr(source_restore, "source_ref", None) if source_restore is not None else None
        ray.get(
            self.controller.restore_training_state.remote(
                _record_set(consumer["state_ref"]), consumer["fetch_cursor"], consumer["processed_cursor"], retained
            )
        )
