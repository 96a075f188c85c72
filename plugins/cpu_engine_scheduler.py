"""The CPU engine's request scheduler: the background worker that forms batches and runs them through `CPUEngine`."""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
import time
from typing import Any

from slime.plugins.cpu_engine_core import CPUEngine, GenerationRequest


class EngineScheduler:
    """Background worker: collects requests for `batch_wait_s`, then runs them through the engine together.

    With `batch_per_request` the batches are instead fixed by the clients: the inputs of one `/generate` body (one
    `submit` call) run together, in chunks of `max_batch_size`, never joined by another body's inputs and without
    waiting. Which rows share a forward pass then depends on the request alone, not on timing, so a request's
    answer is reproducible (`--deterministic`), while a client that sends a prompt group as one batched body still
    gets it generated as one batch.

    No batch starts while generation is paused (`engine.gate`) or a weight change waits for the engine;
    requests aborted while waiting are answered at once, without the model.
    """

    def __init__(
        self,
        engine: CPUEngine,
        max_batch_size: int = 32,
        batch_wait_s: float = 0.005,
        *,
        batch_per_request: bool = False,
    ) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.batch_per_request = batch_per_request
        self._gate = engine.gate
        self._cond = engine.gate.cond
        #: Waiting requests with their futures and the number of the `submit` call that brought them.
        self._waiting: collections.deque[tuple[GenerationRequest, concurrent.futures.Future, int]] = collections.deque()
        self._submissions = itertools.count()
        self._running: list[GenerationRequest] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="cpu-engine-scheduler", daemon=True)
        self._thread.start()

    def submit(self, requests: list[GenerationRequest]) -> list[concurrent.futures.Future]:
        futures: list[concurrent.futures.Future] = [concurrent.futures.Future() for _ in requests]
        with self._cond:
            if self._closed:
                raise RuntimeError("the CPU engine is stopped")
            submission = next(self._submissions)
            self._waiting.extend(
                (request, future, submission) for request, future in zip(requests, futures, strict=True)
            )
            self._cond.notify_all()
        return futures

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "Aborted by /abort_request") -> int:
        """Flag matching queued or running requests; they finish with finish_reason "abort"."""
        with self._cond:
            queued = [request for request, _, _ in self._waiting]
            targets = [r for r in queued + self._running if (abort_all or r.rid == rid) and not r.aborted.is_set()]
            for request in targets:
                request.abort(message)
            self._cond.notify_all()
        return len(targets)

    def pause(self, mode: str) -> None:
        """Pause generation (see `CPUEngine`); returns once no decode step is running: the running batch has
        finished (mode "abort") or reached its pause point."""
        self._gate.pause(mode)
        if mode == "abort":
            self.abort(abort_all=True, message="Aborted by /pause_generation")
        with self._cond:
            while self._running and not (mode != "abort" and self._gate.held):
                self._cond.wait()

    def resume(self) -> None:
        self._gate.resume()

    def loads(self) -> dict[str, int]:
        with self._cond:
            return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._waiting)}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for request in [r for r, _, _ in self._waiting] + self._running:
                request.abort("The CPU engine stopped")
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            kind, items = self._next_work()
            if kind == "aborted":
                for request, future in items:
                    future.set_result(self.engine.abort_response(request))
            elif kind == "batch":
                self._execute(items)
            else:
                for _, future in items:
                    future.set_exception(RuntimeError("the CPU engine stopped before the request ran"))
                return

    def _next_work(self) -> tuple[str, list[tuple[GenerationRequest, concurrent.futures.Future]]]:
        """Wait for work: ("aborted", requests aborted while queued), ("batch", requests to run) or ("closed",
        the requests left)."""
        with self._cond:
            while True:
                aborted = [item[:2] for item in self._waiting if item[0].aborted.is_set()]
                if aborted:
                    self._waiting = collections.deque(item for item in self._waiting if not item[0].aborted.is_set())
                    return "aborted", aborted
                if self._closed:
                    left, self._waiting = [item[:2] for item in self._waiting], collections.deque()
                    return "closed", left
                if self._waiting and self._gate.may_start_batch():
                    if not self.batch_per_request:
                        self._collect_window()
                    if self._closed or not self._gate.may_start_batch():
                        continue
                    batch = self._take_batch()
                    self._running = [request for request, _ in batch]
                    return "batch", batch
                self._cond.wait()

    def _collect_window(self) -> None:
        """Wait (holding `_cond`) up to `batch_wait_s` for more requests, until `max_batch_size` are waiting."""
        deadline = time.monotonic() + self.batch_wait_s
        while len(self._waiting) < self.max_batch_size and not self._closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._cond.wait(remaining)

    def _take_batch(self) -> list[tuple[GenerationRequest, concurrent.futures.Future]]:
        """The next batch off the queue: up to `max_batch_size` requests, all of the first waiting request's
        `submit` call under `batch_per_request`."""
        submission = self._waiting[0][2]
        batch = []
        while self._waiting and len(batch) < self.max_batch_size:
            if self.batch_per_request and self._waiting[0][2] != submission:
                break
            request, future, _ = self._waiting.popleft()
            batch.append((request, future))
        return batch

    def _execute(self, batch: list[tuple[GenerationRequest, concurrent.futures.Future]]) -> None:
        requests = [request for request, _ in batch]
        try:
            results: list[Any] | Exception = self.engine.generate(requests)
        except Exception as exc:  # a failed batch fails its requests loudly, the worker keeps serving
            results = exc
        finally:
            with self._cond:  # before answering, so a client that got its answer sees it off the loads
                self._running = []
                self._cond.notify_all()
        for index, (_, future) in enumerate(batch):
            if isinstance(results, Exception):
                future.set_exception(results)
            else:
                future.set_result(results[index])
