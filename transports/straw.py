"""The straw transport: every rollout group, batch and tensor is durable on shared storage first.

Payloads are published through straw-queue to a pool directory every node mounts
(`--rollout-data-dir`); only small frozen references travel through Ray. A durable queue records what
was generated, accepted and trained, and checkpoints are joint commits of model, critic, queue and
batch-builder state. Naming this plugin (`slime-run --plugin straw`) makes straw the default transport.

`StrawTransport` adapts the modules that implement straw's data path (`slime.data.transport`,
`slime.data.queue_data_source`, `slime.data.batch_builder`, `slime.data.checkpoint`, `slime.data.archive`)
to the `Transport` interface. It calls their functions through their modules, so code (and tests) that
replace a module attribute see the replacement. This module is the only place that knows they belong
together; the queue's service (a `RolloutQueueController` actor) is the opaque `service` orchestration
passes back.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slime import hookimpl
from slime.data import queue_state
from slime.data.queue_state import QueueState
from slime.data.straw_settings import StrawSettings
from slime.interfaces import OpenedSource, RolloutSession, Transport
from slime.specs import DataSourceSpec, TransportSpec


def _data_transport() -> Any:
    """`slime.data.transport`, imported when a straw operation runs (it needs straw-queue)."""
    import slime.data.transport as data_transport

    return data_transport


class StrawSession(RolloutSession):
    """Groups are published (and their queue tasks completed) while generation continues."""

    def __init__(self, args: Any, controller: Any) -> None:
        self.args = args
        self.controller = controller

    async def publish_group(self, group: list, rollout_id: Any) -> Any:
        return await _data_transport().publish_rollout_async(
            group, self.args, rollout_id, group=True, controller=self.controller
        )

    def publish_group_now(self, group: list, rollout_id: Any) -> Any:
        return _data_transport().pack_rollout_group(group, self.args, rollout_id, controller=self.controller)

    def discard_group(self, group: Any, reason: str) -> None:
        _data_transport().discard_rollout_group(group, self.args, reason, controller=self.controller)

    def load_groups(self, groups: Any) -> list:
        return _data_transport().load_rollout_samples(groups)

    def publish_batch(self, groups: list, rollout_id: Any, *, dropped: list | None = None) -> Any:
        """Publish the batch manifest; queue samples a batch filter removed get a recorded disposition."""
        data_transport = _data_transport()
        samples = data_transport.pack_rollout_payload(groups, self.args, rollout_id)
        positions = sorted({p for sample in dropped or () if (p := QueueState.of(sample).position) is not None})
        if positions:
            if self.controller is None:
                raise ValueError(
                    "The batch filter dropped queue samples, but this rollout runs without the queue's service "
                    "(rollout functions must run inside the rollout manager, which installs it)"
                )
            import ray

            record = data_transport.pack_rollout_payload(
                {"positions": positions, "reason": "rollout_sample_filter", "output": samples}, self.args, rollout_id
            )
            ray.get(self.controller.record_dispositions.remote(record.manifest))
        return samples


class StrawTransport(Transport):
    """Durable rollout data on a straw-queue pool, a durable work queue and joint checkpoints."""

    def resolve_restore(self) -> tuple[Any, Any]:
        """Pick the joint commit to restore; the pool defaults to `<--save>/rollout_data` (before any branching)."""
        from slime.data import checkpoint

        args = self.args
        if getattr(args, "rollout_data_dir", None) is None and getattr(args, "save", None):
            args.rollout_data_dir = str(Path(args.save).expanduser().resolve() / "rollout_data")
        return checkpoint.resolve_checkpoint(args)

    def prepare_storage(self) -> None:
        _data_transport().resolve_rollout_data_dir(self.args)

    def check_storage(self) -> None:
        _data_transport().check_rollout_storage(self.args)

    def open_data_source(self, source_cls: Any, *, restore_plan: Any, serving: Any, service: Any) -> OpenedSource:
        """A custom source is built with `(args)` only; a queue controller is created only when none exists yet."""
        import ray

        from slime.data import queue_data_source

        args = self.args
        controller, owned, source = service, False, None
        if source_cls is not queue_data_source.QueueDataSource:
            source = source_cls(args)
            if isinstance(source, queue_data_source.QueueReader) and controller is None:
                controller = source.controller
        if controller is None:
            if serving is not None:
                controller = ray.get(serving.get_queue_controller.remote())
            else:
                controller = queue_data_source.create_queue_controller(args, restore_plan=restore_plan)
                owned = True
        if source is None:
            try:
                source = source_cls(
                    args,
                    controller=controller,
                    restore_plan=restore_plan,
                    reader_generation=uuid.uuid4().hex if serving is not None else "",
                )
            except BaseException:
                if owned:
                    try:
                        ray.get(controller.close.remote())
                    finally:
                        ray.kill(controller, no_restart=True)
                raise
        return OpenedSource(source, controller, owned)

    def rollout_session(self, service: Any) -> RolloutSession:
        return StrawSession(self.args, service)

    def adopt_generated(self, source: Any, produced: Any) -> None:
        """Produced samples keep the source's queue task and count as one more generation request of it."""
        _data_transport().inherit_queue_context(source, produced)
        if produced is not source and QueueState.of(source).lease is not None:
            requests = QueueState.of(produced).generation_requests or 0
            queue_state.stamp(produced, generation_requests=requests + 1)

    def accept_rollout(self, output: Any, rollout_id: int, *, service: Any) -> tuple[Any, dict | None, Any]:
        """Accept the step into the queue; Samples the output holds in memory are used as they are."""
        from slime.data.refs import DiskPayloadRef

        data_transport = _data_transport()
        samples = getattr(output, "samples", None)
        accepted = data_transport.accept_raw_rollout(output, self.args, rollout_id, controller=service)
        if isinstance(samples, list) and not any(isinstance(s, DiskPayloadRef) for s in samples):
            return samples, accepted.metrics, accepted
        return data_transport.load_rollout_samples(accepted), accepted.metrics, accepted

    def replay_archive(self, template: str, rollout_id: int, *, service: Any) -> tuple[list, Any] | None:
        """Accept an archived step by reference: no Sample is re-encoded and no tensor is loaded."""
        if not template.endswith(".straw.json") or getattr(self.args, "load_debug_rollout_data_subsample", None):
            return None
        from slime.data.archive import RolloutArchive
        from slime.rollout.base_types import RolloutFnTrainOutput

        args = self.args
        path = Path(template.format(rollout_id=rollout_id)).expanduser()
        archive = RolloutArchive(path)
        try:
            pool = str(Path(args.rollout_data_dir).expanduser().resolve())
            run_id = StrawSettings.from_args(args).run_id
            if str(Path(archive.index["root"]).resolve()) != pool or archive.manifest.manifest.segment.run_id != run_id:
                raise ValueError(
                    f"Debug rollout archives must belong to the same Straw storage pool and run: {path} was written "
                    f"to {archive.index['root']} (run {archive.manifest.manifest.segment.run_id}), this replay "
                    f"uses {pool} (run {run_id})"
                )
            data = archive.load_samples()
            refs = archive.sample_refs()
        finally:
            archive.close()
        accepted = _data_transport().accept_raw_rollout(
            RolloutFnTrainOutput(samples=data, sample_refs=refs), args, rollout_id, controller=service
        )
        return data, accepted

    def shard_batch(self, builder: Any, data: Any) -> list:
        return builder.durable_shares(data)

    def save_state(self, builder: Any, rollout_id: int) -> None:
        builder.save(rollout_id)

    def load_state(self, builder: Any, rollout_id: int | None, source_restore: Any) -> None:
        from slime.data.checkpoint import SourceRestore

        restored = source_restore if isinstance(source_restore, SourceRestore) else None
        builder.load(rollout_id, source_restore=restored)

    def seal(self) -> None:
        _data_transport().seal_rollout_store(self.args)


@hookimpl
def slime_transports() -> Iterable[TransportSpec]:
    return [
        TransportSpec(
            "straw",
            StrawTransport,
            "Durable straw-queue pool on a shared filesystem; survives crashes, resumable, replayable",
            checkpoint_policy="joint",
            data_source="queue",
        )
    ]


@hookimpl
def slime_data_sources() -> Iterable[DataSourceSpec]:
    from slime.data.queue_reader import QueueDataSource  # importable without straw-queue (it loads straw lazily)

    return [
        DataSourceSpec(
            "queue",
            QueueDataSource,
            "Prompts as durable queue tasks with leases; its cursor and pending work are part of joint checkpoints",
        )
    ]


@hookimpl
def slime_cli_defaults() -> dict[str, Any]:
    return {"rollout_data_transport": "straw"}
