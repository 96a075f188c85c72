"""The rollout manager: one Ray actor that runs rollout steps and hands training batches to the trainers.

Per step it calls the rollout function (default `slime.rollout.sglang_rollout.generate_rollout`) inside the
run's transport session, has the transport accept the step, plans and converts the batch with the
`BatchBuilder` and returns one reference per data-parallel rank. Everything about how data travels is the
run's transport's (`slime.interfaces.Transport`); the manager holds its service (`self.controller`, None for
transports without one) and passes it back. With a serving cluster (`serving=`), engines and the transport's
service belong to the cluster: the manager borrows them and never disposes them.

Between steps it drives the engines' side of a weight update (`RayTrainGroup.update_weights`):
`prepare_weight_update` relaunches dead engines, resumes released memory and pauses generation;
`finish_weight_update` checks every engine's weight version and lets them generate again (a disk update runs
`update_weights_from_disk` between the two). With `--offload-rollout` engines release their memory after each
step (`generate`) and take it back before the next weight update or generation.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from types import MappingProxyType
from typing import Any

import ray

from slime.engine_control import (
    EngineUnreachableError,
    check_weight_version,
    continue_generation,
    pause_generation,
    post_engines,
    release_memory_occupation,
    resume_memory_occupation,
)
from slime.errors import RunInterrupted
from slime.interfaces import Transport, rollout_session_scope, run_transport
from slime.observability import logging_utils
from slime.observability.logging_utils import (
    configure_logger,
    init_tracking,
    log_eval_rollout_data,
    log_rollout_data,
    rollout_examples,
)
from slime.observability.phase_timer import PhaseTimer
from slime.observability.rollout_data_utils import (
    load_debug_rollout_data,
    save_debug_rollout_data,
    validate_rollout_id_annotated,
)
from slime.ray.health_monitor import start_health_monitors
from slime.ray.lock import Lock
from slime.ray.serving import live_urls
from slime.ray.settings import ManagerSettings
from slime.rollout.base_types import call_rollout_fn, iter_samples
from slime.utils.misc import load_function, plugin_name

logger = logging.getLogger(__name__)


def check_rollout_storage(args: Any) -> None:
    """Have the run's transport prove every node can use its storage (a module name, so tests can stub it)."""
    run_transport(args).check_storage()


@ray.remote
class RolloutManager:
    """Runs rollout steps; owns (or borrows) the data source, the transport's service and the batch builder."""

    #: The run's transport service (`OpenedSource.service`; None until opened, and for transports without one).
    controller: Any = None
    #: The (engine URLs, router URL) last published into `self.args` (None: nothing published yet).
    _published_engines: tuple[list[str], str | None] | None = None
    #: Engines that released their memory after the last rollout step (`--offload-rollout`).
    _released_urls: frozenset[str] = frozenset()
    #: Held-out prompts of --eval-prompt-data (None until started; empty: eval functions read the data source's).
    eval_data: Any = None
    #: What `log_rollout_data` logged for the last generated step (empty before the first).
    _rollout_metrics: Mapping[str, Any] = MappingProxyType({})
    #: A few of the last generated step's answers (`rollout_examples`), for the driver's observers.
    _rollout_examples: tuple[dict[str, Any], ...] = ()

    def __init__(
        self, args: Any, pg: Any, *, restore_plan: Any = None, serving: Any = None, deployment: Any = None
    ) -> None:
        self._settings = ManagerSettings.from_args(args)
        configure_logger(verbose=self._settings.verbose)
        self.serving = serving
        self.pg = pg
        self.args = args
        self.restore_plan = restore_plan
        self.controller = deployment.controller if deployment is not None else None
        self._owns_controller = False
        self._launched_servers = False
        self.weight_version = self.settings.update_weight_start_version
        self.rollout_id = -1
        self.train_actors: dict[str, list] = {}
        self.servers: dict = deployment.servers if deployment is not None else {}
        launch = deployment is None and not self.settings.debug_train_only
        if launch:
            from slime.backend_interfaces import resolve_engine_launcher
            from slime.ray.serving import launch_rollout_servers

            engine_launcher = resolve_engine_launcher(args)  # an unknown engine fails here, before anything starts
        # Engines take seconds to come up (their processes import torch and load the model): the storage probe (a
        # Ray task in a new worker) runs on a thread meanwhile. The engines and the router start on this thread: a
        # child process started with `die_with_parent` (the router) dies with the thread that started it. The data
        # source and its queue service come after both, so a run whose engines fail writes nothing under --save.
        pool = ThreadPoolExecutor(1, thread_name_prefix="storage-probe")
        probing = pool.submit(check_rollout_storage, args)
        pool.shutdown(wait=False)
        try:
            if launch:
                self.servers = launch_rollout_servers(args, engine_launcher)
                self._launched_servers = True
            probing.result()
            self._publish_engine_urls()  # the components see the engines' URLs
            self._init_components(restore_plan)
        except BaseException as exc:
            wait([probing])  # its Ray task must not outlive a failed manager unseen
            if probing.exception() not in (None, exc):
                logger.error("the rollout storage probe failed too", exc_info=probing.exception())
            self._release_after_failed_init()
            raise
        # Engines this manager started are its to watch; a serving cluster watches its own.
        self._health_monitors = start_health_monitors(self.servers, args) if self._launched_servers else []
        init_tracking(args, primary=False)
        if deployment is not None:
            self.rollout_engine_lock = deployment.engine_lock
        else:
            # A lock needs no CPU slot of its own (training ranks would wait for it on small machines).
            self.rollout_engine_lock = Lock.options(num_cpus=0, num_gpus=0).remote()

    @property
    def settings(self) -> ManagerSettings:
        """This manager's settings: built by the constructor (a manager made without it builds them from
        `self.args` on first use). Not a `functools.cached_property`: Ray cannot pickle its lock (Python 3.11)."""
        settings = self.__dict__.get("_settings")
        if settings is None:
            settings = self._settings = ManagerSettings.from_args(self.args)
        return settings

    @property
    def transport(self) -> Transport:
        """The run's transport (cheap to build; state lives in its storage and service)."""
        return run_transport(self.args)

    def _init_components(self, restore_plan: Any) -> None:
        args, settings = self.args, self.settings
        self.data_source = self._create_data_source(restore_plan)
        self.generate_rollout = load_function(plugin_name("rollout_functions", settings.rollout_function, args))
        self.eval_generate_rollout = load_function(plugin_name("rollout_functions", settings.eval_function, args))
        from slime.data.eval_data import EvalDatasets

        # Held-out prompts (--eval-prompt-data); without them, eval functions read the data source's own.
        self.eval_data = EvalDatasets(args)
        from slime.data.batch_builder import BatchBuilder

        self.batch_builder = BatchBuilder(args, controller=self.controller)

    def _release_after_failed_init(self) -> None:
        """A constructor failure must not leave engines or an owned controller behind."""
        if self._owns_controller:
            try:
                ray.get(self.controller.close.remote())
            finally:
                ray.kill(self.controller, no_restart=True)
        if self._launched_servers:
            for server in self.servers.values():
                server.shutdown()

    def _create_data_source(self, restore_plan: Any) -> Any:
        """The data source, bound by the transport to its service (created here unless one is borrowed)."""
        source_cls = load_function(plugin_name("data_sources", self.settings.data_source, self.args))
        opened = self.transport.open_data_source(
            source_cls, restore_plan=restore_plan, serving=self.serving, service=self.controller
        )
        self.controller = opened.service
        self._owns_controller = opened.owned
        return opened.source

    # ------------------------------------------------------------------ lifecycle

    def dispose(self) -> None:
        """Close the source and the owned service, seal the transport, finish tracking; never the serving cluster.

        Every step runs even when an earlier one failed; the first failure is re-raised at the end.
        """
        errors: list[BaseException] = []

        def step(fn: Any) -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - collected and re-raised below
                logger.exception("Rollout manager cleanup step failed")
                errors.append(exc)

        close = getattr(self.data_source, "close", None)
        if close is not None:
            step(close)
        if self._owns_controller and self.controller is not None:
            controller = self.controller

            def close_controller() -> None:
                try:
                    ray.get(controller.close.remote())
                finally:
                    ray.kill(controller, no_restart=True)

            step(close_controller)
            self._owns_controller = False
        step(self.transport.seal)
        if self._launched_servers:
            for monitor in self._health_monitors:
                step(monitor.stop)
            for server in self.servers.values():
                step(server.shutdown)
            self._launched_servers = False
        step(lambda: logging_utils.finish_tracking(self.args))
        if errors:
            raise RuntimeError(f"Rollout manager cleanup failed: {errors[0]}") from errors[0]

    # ------------------------------------------------------------ rollout boundary

    def generate(self, rollout_id: int) -> Any:
        """Run rollout step `rollout_id`; returns one `Box` per data-parallel rank (None when rollout-only)."""
        start_time = time.time()
        self.rollout_id = rollout_id
        self.batch_builder.rollout_id = rollout_id
        self._resume_engine_memory()
        self.health_monitoring_resume()
        try:
            result = self._generate(rollout_id, start_time)
        except Exception as exc:
            lost = self._lost_engines()
            if not lost:
                raise
            # Every engine of the step may be gone (their node lost): the step cannot finish, and the run resumes
            # from its last joint commit exactly once; relaunching engines mid-step is not attempted.
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RunInterrupted(
                f"rollout step {rollout_id} failed because engine(s) {', '.join(lost)} died during it (last error: "
                f"{first_line}). What the run committed is intact: rerun the same command to resume from its last "
                "joint commit (once the cluster can hold the run's engines again, if their node was lost)"
            ) from exc
        self._check_engines()
        self._release_engine_memory()
        return result

    def _lost_engines(self) -> list[str]:
        """The URLs of the engines found dead by a health check now (their slots are then relaunched by recovery)."""
        self._check_engines()
        lost = []
        for server in self.servers.values():
            engines = getattr(server, "all_engines", None) or []
            lost += [url for url, engine in zip(server.urls, engines, strict=True) if engine is None]
        return lost

    def eval(self, rollout_id: int) -> dict[str, Any]:
        """Evaluate the engines' current weights; returns the logged eval metrics (`eval/<name>/...`)."""
        args = self.args
        if self.settings.debug_train_only:
            return {}
        self.rollout_id = rollout_id
        self._resume_engine_memory()
        self.health_monitoring_resume()
        source = self.eval_data or self.data_source
        with rollout_session_scope(self.transport.rollout_session(self.controller)):
            result = call_rollout_fn(self.eval_generate_rollout, args, rollout_id, source, evaluation=True)
        self._check_engines()
        save_debug_rollout_data(
            self.settings.save_debug_rollout_data, result.data, rollout_id=rollout_id, evaluation=True
        )
        return log_eval_rollout_data(rollout_id, args, result.data, result.metrics) or {}

    def rollout_report(self) -> dict[str, Any]:
        """For the driver's observers: `metrics`, what was logged for the last generated step (reward, lengths,
        phase times), and `samples`, a few of its answers (`rollout_examples`)."""
        return {"metrics": dict(self._rollout_metrics), "samples": [dict(row) for row in self._rollout_examples]}

    def _generate(self, rollout_id: int, start_time: float) -> Any:
        """Generate, convert and store one step; its rollout metrics line carries the phase times."""
        self._publish_engine_urls()  # engines may have been relaunched since the last step
        args = self.args
        timer = PhaseTimer()
        data, metrics = self._get_rollout_data(rollout_id, timer)
        save_debug_rollout_data(
            self.settings.save_debug_rollout_data,
            data,
            rollout_id=rollout_id,
            evaluation=False,
            args=args,
            reference=self.batch_builder.raw_ref,
        )
        result = None
        if not self.settings.debug_rollout_only:
            result = self._build_batch(data, timer)
        self._rollout_metrics = log_rollout_data(
            rollout_id, args, data, {**(metrics or {}), **timer.metrics()}, time.time() - start_time
        )
        self._rollout_examples = tuple(rollout_examples(data, args))
        return result

    def _build_batch(self, data: list, timer: PhaseTimer) -> Any:
        """Per-rank training references of this step's batch (a replayed step reuses its stored batch)."""
        with timer.phase("convert"):
            cached = self.batch_builder.begin(data, replay=bool(self.settings.load_debug_rollout_data))
            if cached is not None:
                return cached
            converted = self.batch_builder.convert(data)
        with timer.phase("store"):
            return self.batch_builder.split_by_dp(converted)

    def _get_rollout_data(self, rollout_id: int, timer: PhaseTimer | None = None) -> tuple[list, dict | None]:
        """This step's Samples (flat list) and the rollout function's metrics; phase times go to `timer`."""
        timer = timer or PhaseTimer()
        args, settings = self.args, self.settings
        transport = self.transport
        template = settings.load_debug_rollout_data
        if template:
            with timer.phase("store"):
                replayed = transport.replay_archive(template, rollout_id, service=self.controller)
                if replayed is not None:
                    data, self.batch_builder.raw_ref = replayed
                    return self._flatten(data), None
                data = load_debug_rollout_data(
                    template,
                    rollout_id=rollout_id,
                    subsample_ratio=settings.load_debug_rollout_data_subsample,
                )
            self.batch_builder.raw_ref = None
            return self._flatten(validate_rollout_id_annotated(data)), None
        with timer.phase("generate"), rollout_session_scope(transport.rollout_session(self.controller)):
            output = call_rollout_fn(self.generate_rollout, args, rollout_id, self.data_source, evaluation=False)
        with timer.phase("store"):
            data, metrics, accepted = transport.accept_rollout(output, rollout_id, service=self.controller)
            if accepted is not None:
                self.batch_builder.raw_ref = accepted
        return self._flatten(validate_rollout_id_annotated(data)), metrics

    @staticmethod
    def _flatten(data: Any) -> list:
        return list(iter_samples(data))

    # ------------------------------------------------------------------ engines

    def recover_updatable_engines(self) -> None:
        """Relaunch dead engines before a weight update (the serving cluster decides, whatever the rollout id)."""
        if self.serving is not None:
            self.servers = ray.get(self.serving.recover_updatable_engines.remote())
            return
        if self.rollout_id == -1:
            return
        for server in self.servers.values():
            if getattr(server, "update_weights", False):
                server.recover()
        self._publish_engine_urls()

    def health_monitoring_resume(self) -> None:
        if self.serving is not None:
            self.servers = ray.get(self.serving.health_monitoring_resume.remote())
            return
        for monitor in self._health_monitors:
            monitor.resume()

    def health_monitoring_pause(self) -> None:
        if self.serving is not None:
            self.servers = ray.get(self.serving.health_monitoring_pause.remote())
            return
        for monitor in self._health_monitors:
            monitor.pause()

    def _check_engines(self) -> None:
        """At the rollout boundary and before a weight update: monitors pause and check every engine once (the
        serving cluster's, or ours), marking the dead ones so `recover_updatable_engines` relaunches them."""
        if self.serving is not None:
            self.servers = ray.get(self.serving.finish_rollout.remote())
            return
        for monitor in self._health_monitors:
            monitor.pause()
            monitor.check_once()

    def _publish_engine_urls(self) -> None:
        """Rollout functions find the engines in `args.rollout_engine_urls` and the router, when the engines have
        one, in `args.rollout_router_url` (on a copy: the caller's args stay as they are)."""
        urls = self.engine_urls()
        router = next((server.router.url for server in self.servers.values() if server.router is not None), None)
        if (urls or router) and self._published_engines != (urls, router):
            self.args = copy.copy(self.args)
            self.args.rollout_engine_urls = urls
            self.args.rollout_router_url = router
            self._published_engines = (urls, router)

    def engine_urls(self) -> list[str]:
        """The live engines' URLs (engines marked dead are left out until they are relaunched)."""
        return [url for server in self.servers.values() for url in live_urls(server)]

    def _updatable_urls(self) -> list[str]:
        """The live URLs of the engines that receive weight updates."""
        return [
            url
            for server in self.servers.values()
            if getattr(server, "update_weights", False)
            for url in live_urls(server)
        ]

    # ------------------------------------------------------------ weight updates

    def prepare_weight_update(self) -> list[str]:
        """Before the training ranks send weights: relaunch dead engines (a relaunched engine then serves these
        weights from the next step on), give engines that released their memory (`--offload-rollout`) their
        memory back and pause generation everywhere (`--partial-rollout`: mode "retract", else "abort").
        Returns the URLs of the engines to send the weights to. An engine lost meanwhile is relaunched and the
        preparation repeated once."""
        try:
            return self._prepare_engines()
        except EngineUnreachableError as exc:
            logger.warning("%s; relaunching dead engines and preparing the weight update again", exc)
            return self._prepare_engines()

    def _prepare_engines(self) -> list[str]:
        self._check_engines()  # an engine may have died since the rollout boundary (during training, saving)
        self.recover_updatable_engines()
        self._publish_engine_urls()
        self._resume_engine_memory()
        urls = self._updatable_urls()
        pause_generation(urls, self.settings.pause_mode, self.settings.http_timeout_s)
        return urls

    def finish_weight_update(self, version: int) -> None:
        """After weight `version` was sent: check that every engine serves it (an error naming the engines that
        do not), then let them generate again. No engine waits for a weight connection any more
        (`num_new_engines` = 0). An engine lost after it loaded is marked dead here (and relaunched, with the
        weights of the time, at the next update); the others go on."""
        try:
            self._check_and_continue(version)
        except EngineUnreachableError as exc:
            logger.warning("%s; leaving the lost engine out until the next weight update relaunches it", exc)
            self._check_engines()
            self._publish_engine_urls()
            self._check_and_continue(version)

    def _check_and_continue(self, version: int) -> None:
        urls = self._updatable_urls()
        check_weight_version(urls, version, self.settings.http_timeout_s)
        if self.serving is not None:
            ray.get(self.serving.clear_updatable_num_new_engines.remote())
        for server in self.servers.values():
            if getattr(server, "update_weights", False):
                server.num_new_engines = 0
        self.weight_version = int(version)
        continue_generation(urls, self.settings.http_timeout_s)

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        """Have every engine load the exported weights at `model_path` as `weight_version`, between
        `prepare_weight_update` and `finish_weight_update`."""
        urls = self.prepare_weight_update()
        body = {"model_path": model_path, "weight_version": weight_version}
        try:
            post_engines(urls, "/update_weights_from_disk", body, self.settings.http_timeout_s)
        except EngineUnreachableError as exc:
            # An engine died while loading: relaunch it and have every engine load the same files again, once.
            logger.warning("%s; relaunching dead engines and sending weight version %s again", exc, weight_version)
            urls = self.prepare_weight_update()
            post_engines(urls, "/update_weights_from_disk", body, self.settings.http_timeout_s)
        self.finish_weight_update(int(weight_version))

    def _release_engine_memory(self) -> None:
        """`--offload-rollout`: after a rollout step, every engine frees its device memory for the trainers."""
        if not self.settings.offload_rollout:
            return
        urls = self.engine_urls()
        release_memory_occupation(urls, self.settings.http_timeout_s)
        self._released_urls = frozenset(urls)

    def _resume_engine_memory(self) -> None:
        """Engines that released their memory take it back (before a weight update, or a generation that comes
        without one); relaunched engines never released theirs."""
        if not self._released_urls:
            return
        released = [url for url in self.engine_urls() if url in self._released_urls]
        self._released_urls = frozenset()
        resume_memory_occupation(released, self.settings.http_timeout_s)

    def get_weight_version(self) -> int:
        """The version the engines serve (the serving cluster's answer when attached to one)."""
        if self.serving is not None:
            version = ray.get(self.serving.get_weight_version.remote())
        else:
            from slime.ray.serving import engine_weight_version

            version = engine_weight_version(self.engine_urls())
        return self.weight_version if version is None else version

    def register_training_actors(self, role: str, handles: list) -> dict:
        """Remember a group's ranks; returns the configuration they must adopt (weight version, engine URLs)."""
        self.train_actors[role] = list(handles)
        return {"update_weight_start_version": self.weight_version, "rollout_engine_urls": self.engine_urls()}

    def set_train_parallel_config(self, config: dict) -> None:
        self.batch_builder.train_parallel_config = config

    def training_ready(self) -> None:
        """Trainers hold the initial weights; rollout may start."""

    def pause_rollout_admission(self) -> bool:
        return False

    def resume_rollout_admission(self) -> None:
        """Admission is never paused by this manager (no background generation between steps)."""

    def get_num_rollout_per_epoch(self) -> int:
        size = len(getattr(self.data_source, "dataset", None) or [])
        if size == 0:
            raise ValueError("--num-epoch needs a data source with a known dataset size (use --num-rollout)")
        return max(1, size // self.settings.batch_size)

    # --------------------------------------------------------------- checkpoints

    def save(self, rollout_id: int) -> None:
        """Save the data source and batch builder with training step `rollout_id` (consumers paused meanwhile)."""
        paused = []
        try:
            for consumer in dict(getattr(self.data_source, "consumers", None) or {}).values():
                if hasattr(consumer, "pause"):
                    consumer.pause()
                    paused.append(consumer)
            self.data_source.save(rollout_id)
            self.transport.save_state(self.batch_builder, rollout_id)
        finally:
            for consumer in paused:
                consumer.resume()

    def load(self, rollout_id: int | None = None) -> None:
        restored = self.data_source.load(rollout_id)
        self.transport.load_state(self.batch_builder, rollout_id, restored)

    def training_completed(self, rollout_id: int) -> None:
        self.batch_builder.training_completed(rollout_id)
