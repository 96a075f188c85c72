"""Fully asynchronous rollout across nodes: one generation actor per node, scheduled with bounded prefetch.

Each `_GenerationActor` runs an `AsyncRolloutWorker` over its own queue reader (a `QueueReader` built from
the data source's `reader_config`), applies the dynamic filter where the group was generated and hands kept
groups to the run's transport session there (the straw transport publishes them, so only small references
travel back). `RolloutScheduler`
keeps up to `capacity` results requested from each actor and assembles the step's batch.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from slime.interfaces import run_transport
from slime.rollout.base_types import RolloutFnTrainOutput, finalize_rollout_groups
from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.rollout.settings import RolloutSettings

logger = logging.getLogger(__name__)


class _GenerationActor:
    """Per-node generator (wrapped with `ray.remote` by `DistributedRollout`)."""

    def __init__(self, args: Any, reader_config: Any, reader_id: str, concurrency: int) -> None:
        from slime.rollout.fully_async_rollout import AsyncRolloutWorker

        self.args = args
        self.reader = reader_config.open_reader(args, reader_id)
        self.session = run_transport(args).rollout_session(self.reader.controller)
        self.worker = AsyncRolloutWorker(args, self.reader, concurrency=concurrency)
        self.worker.start()

    def take(self, rollout_id: int, limit: int) -> list[tuple[Any, DynamicFilterOutput]]:
        """Up to `limit` finished groups with their filter verdicts; kept groups already published."""
        from slime.rollout.filter_hub.base_types import dynamic_filter_verdict
        from slime.rollout.fully_async_rollout import load_function

        if self.worker.error is not None:
            raise RuntimeError("A node's rollout worker failed") from self.worker.error
        results = []
        for _, group in self.worker.get_completed_groups(limit):
            verdict = dynamic_filter_verdict(self.args, group, load_function)
            if verdict.keep:
                group = self.session.publish_group_now(group, rollout_id)
            else:
                self.session.discard_group(group, verdict.reason or "filtered")
                group = None
            results.append((group, verdict))
        return results

    def pause(self, drain: bool = True) -> None:
        self.worker.pause(drain=drain)

    def resume(self) -> None:
        self.worker.resume()

    def close(self) -> None:
        try:
            self.worker.close()
        finally:
            self.reader.close()


class RolloutScheduler:
    """Collects `(group, verdict)` results from generation actors with at most `capacities[i]` in flight each."""

    def __init__(self, args: Any, workers: list, capacities: list[int]) -> None:
        if len(workers) != len(capacities):
            raise ValueError("RolloutScheduler needs one capacity per worker")
        self.args = args
        self.settings = RolloutSettings.from_args(args)
        self.workers = list(workers)
        self.capacities = [max(1, int(c)) for c in capacities]
        self.ready: list = []

    @property
    def capacity(self) -> int:
        return sum(self.capacities)

    def generate(self, rollout_id: int, prefetch: int | None = None) -> RolloutFnTrainOutput:
        target = self.settings.batch_size
        prefetch = prefetch or self.capacity
        kept = [group for group in self.ready[:target]]
        self.ready = self.ready[target:]
        dropped: dict[str, int] = {}
        seen = len(kept)
        in_flight: dict[Any, int] = {}
        while len(kept) < target:
            for index, worker in enumerate(self.workers):
                if index not in in_flight.values():
                    limit = min(self.capacities[index], prefetch)
                    in_flight[worker.take.remote(rollout_id, limit)] = index
            done, _ = ray.wait(list(in_flight), num_returns=1)
            for ref in done:
                in_flight.pop(ref)
                for group, verdict in ray.get(ref):
                    seen += 1
                    if not verdict.keep:
                        reason = verdict.reason or "filtered"
                        dropped[reason] = dropped.get(reason, 0) + 1
                    elif len(kept) < target:
                        kept.append(group)
                    else:
                        self.ready.append(group)
        for ref in in_flight:
            for group, verdict in ray.get(ref):
                if verdict.keep:
                    self.ready.append(group)
        metrics = None
        if dropped:
            count = sum(dropped.values())
            metrics = {f"rollout/dynamic_filter/drop_{reason}": n for reason, n in dropped.items()}
            metrics["rollout/dynamic_filter/dropped_groups"] = count
            metrics["rollout/dynamic_filter/dropped_ratio"] = count / max(seen, 1)
        return finalize_rollout_groups(self.args, rollout_id, kept, metrics)

    def pause(self, drain: bool = True) -> None:
        ray.get([worker.pause.remote(drain) for worker in self.workers])

    def resume(self) -> None:
        ray.get([worker.resume.remote() for worker in self.workers])

    def state_dict(self) -> dict:
        return {"ready": list(self.ready)}

    def load_state_dict(self, state: dict) -> None:
        self.ready = list(state.get("ready", []))

    def close(self) -> None:
        ray.get([worker.close.remote() for worker in self.workers])
        for worker in self.workers:
            ray.kill(worker)


class DistributedRollout(RolloutScheduler):
    """One generation actor per alive Ray node, each reading the queue through its own `QueueReader`."""

    def __init__(self, args: Any, data_buffer: Any) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        config = data_buffer.reader_config
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        if not nodes:
            raise RuntimeError("Distributed fully async rollout found no alive Ray node")
        settings = RolloutSettings.from_args(args)
        per_worker = settings.concurrency
        actor_cls = ray.remote(_GenerationActor)
        workers = [
            actor_cls.options(
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
            ).remote(args, config, f"node:{node['NodeID']}", per_worker)
            for node in nodes
        ]
        capacity = max(1, per_worker // settings.n_samples_per_prompt)
        super().__init__(args, workers, [capacity] * len(workers))
