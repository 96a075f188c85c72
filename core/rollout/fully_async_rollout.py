"""Fully asynchronous rollout: a background worker keeps generating groups between training steps.

The data source owns the worker (`data_buffer.consumers["fully_async"]`) so that the manager can pause it
around checkpoints. Each step drains exactly the groups it still needs and hands each kept group to the
run's transport session before the next one is taken, so generation and storage overlap.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any

from slime.interfaces import current_session
from slime.rollout.base_types import RolloutFnTrainOutput, finalize_rollout_groups, iter_samples
from slime.rollout.filter_hub.base_types import dynamic_filter_verdict
from slime.rollout.settings import RolloutSettings
from slime.utils.misc import load_function
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

POLL_S = 0.05


class AsyncRolloutWorker:
    """Generates groups from `data_buffer.get_samples` on a background thread with its own event loop."""

    def __init__(self, args: Any, data_buffer: Any, concurrency: int) -> None:
        self.args = args
        self.data_buffer = data_buffer
        settings = RolloutSettings.from_args(args)
        self.max_groups = max(1, int(concurrency) // settings.n_samples_per_prompt)
        # Finished-but-unconsumed groups are bounded too: at most one step ahead of training.
        self.max_buffered = max(self.max_groups, settings.batch_size)
        self.error: BaseException | None = None
        self._completed: queue.Queue = queue.Queue()
        self._running = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._thread: threading.Thread | None = None
        self._sequence = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fully-async-rollout", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - surfaced to the rollout step through `error`
            logger.exception("Fully async rollout worker failed")
            self.error = exc

    async def _main(self) -> None:
        from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group

        state = GenerateState(self.args)
        pending: dict[asyncio.Task, list] = {}
        while not self._stop.is_set():
            if self._abort.is_set() and pending:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                self._return(list(pending.values()))
                pending.clear()
            self._abort.clear()
            if self._running.is_set():
                while len(pending) < self.max_groups and len(pending) + self._completed.qsize() < self.max_buffered:
                    groups = self.data_buffer.get_samples(1)
                    if not groups:
                        break
                    for group in groups:
                        task = asyncio.ensure_future(
                            generate_and_rm_group(self.args, group, dict(state.sampling_params))
                        )
                        pending[task] = group
            if not pending:
                self._idle.set()
                await asyncio.sleep(POLL_S)
                continue
            self._idle.clear()
            done, _ = await asyncio.wait(list(pending), timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                pending.pop(task)
                self._completed.put((self._sequence, task.result()))
                self._sequence += 1
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._return(list(pending.values()))

    def _return(self, groups: list) -> None:
        for sample in iter_samples(groups):
            sample.status = Sample.Status.PENDING
        if groups:
            self.data_buffer.add_samples(groups)

    def pause(self, drain: bool = True) -> None:
        """Stop taking new prompts; `drain` waits for in-flight groups, otherwise they are aborted and returned."""
        self._running.clear()
        if not drain:
            self._abort.set()
        if self._thread is not None:
            while not self._idle.wait(POLL_S):
                if self.error is not None or not self._thread.is_alive():
                    break

    def resume(self) -> None:
        self._running.set()

    def get_completed_groups(self, limit: int) -> list[tuple[int, list]]:
        groups = []
        while len(groups) < limit:
            try:
                groups.append(self._completed.get_nowait())
            except queue.Empty:
                break
        return groups

    def queue_size(self) -> int:
        return self._completed.qsize()

    def state_dict(self) -> dict:
        """Finished groups not yet consumed by a step (they are trained after a resume)."""
        ready = list(self._completed.queue)
        return {"ready": [[sample.to_dict() for sample in group] for _, group in ready]}

    def load_state_dict(self, state: dict) -> None:
        for group in state.get("ready", []):
            self._completed.put((self._sequence, [Sample.from_dict(item) for item in group]))
            self._sequence += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _get_worker(args: Any, data_buffer: Any) -> Any:
    """The data source's worker (created and started on first use)."""
    consumers = getattr(data_buffer, "consumers", None)
    if consumers is None:
        consumers = data_buffer.consumers = {}
    worker = consumers.get("fully_async")
    if worker is not None:
        return worker
    if getattr(data_buffer, "reader_config", None) is not None:
        from slime.rollout.fully_async_distributed import DistributedRollout

        worker = DistributedRollout(args, data_buffer)
    else:
        settings = RolloutSettings.from_args(args)
        concurrency = settings.concurrency * (len(settings.engine_urls) or 1)
        worker = AsyncRolloutWorker(args, data_buffer, concurrency=concurrency)
        worker.start()
    if hasattr(data_buffer, "register_consumer"):
        data_buffer.register_consumer("fully_async", worker)
    else:
        consumers["fully_async"] = worker
    return worker


async def _generate_rollout_async(args: Any, rollout_id: int, data_buffer: Any) -> RolloutFnTrainOutput:
    """Take finished groups from the background worker until the batch is full; kept groups go to the session."""
    settings = RolloutSettings.from_args(args)
    worker = _get_worker(args, data_buffer)
    worker.resume()
    session = current_session(args)
    target = settings.batch_size
    collected: list = []
    dropped: dict[str, int] = {}
    seen = 0
    while len(collected) < target:
        if worker.error is not None:
            raise RuntimeError("The fully async rollout worker failed") from worker.error
        groups = worker.get_completed_groups(limit=target - len(collected))
        if not groups:
            await asyncio.sleep(POLL_S)
            continue
        for _, group in groups:
            seen += 1
            verdict = dynamic_filter_verdict(args, group, load_function)
            if not verdict.keep:
                reason = verdict.reason or "filtered"
                dropped[reason] = dropped.get(reason, 0) + 1
                await asyncio.to_thread(session.discard_group, group, reason)
                continue
            collected.append(await session.publish_group(group, rollout_id))
    metrics = None
    if dropped:
        count = sum(dropped.values())
        metrics = {f"rollout/dynamic_filter/drop_{reason}": n for reason, n in dropped.items()}
        metrics["rollout/dynamic_filter/dropped_groups"] = count
        metrics["rollout/dynamic_filter/dropped_ratio"] = count / max(seen, 1)
    if settings.sample_filter_path:
        return finalize_rollout_groups(args, rollout_id, collected, metrics, session=session)
    return await asyncio.to_thread(finalize_rollout_groups, args, rollout_id, collected, metrics, session=session)


def generate_rollout_fully_async(
    args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False
) -> RolloutFnTrainOutput | list:
    """Rollout function entry point (registered as "fully-async"); training only."""
    if evaluation:
        raise ValueError("The fully async rollout has no evaluation mode; set --eval-function-path to another one")
    worker = _get_worker(args, data_buffer)
    from slime.rollout.fully_async_distributed import DistributedRollout

    if isinstance(worker, DistributedRollout):
        return worker.generate(rollout_id, prefetch=worker.capacity)
    return asyncio.run(_generate_rollout_async(args, rollout_id, data_buffer))
