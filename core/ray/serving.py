"""The serving side of a run: the rollout engines, the router in front of them, and a detachable owner.

Engines come from the rollout-engine plugin selected by `--rollout-engine` (registry kind "rollout_engines");
its launcher follows `slime.backend_interfaces.EngineLauncher`: `target(args, num_engines)` returns the
engines' URLs (the result may carry the engines' Ray actors in `.actors` and a `shutdown()`). With
`--rollout-router sglang-router` one sglang-router (`slime.ray.router`) is started in front of them.
`ServingCluster` is a detached owner of engines, router, queue controller and engine lock, so that a new
driver can reattach to running engines. Importing this module imports no SGLang.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from slime.backend_interfaces import check_launched_engines
from slime.errors import RunInterrupted
from slime.ray.layout import LayoutError, check_engines_fit
from slime.ray.router import SGLangRouter
from slime.ray.settings import ServingSettings

logger = logging.getLogger(__name__)


@dataclass
class ServingDeployment:
    """What a `RolloutManager` needs from a serving cluster it attaches to."""

    placements: dict
    servers: dict
    controller: Any
    restore_plan: Any
    routers: dict
    engine_lock: Any
    reused: bool = False


@dataclass
class RolloutServer:
    """One model's engines: their URLs, the launcher that made them and the slots of engines that died.

    `all_engines[i]` is None when engine i is gone (`mark_engine_dead`); `urls[i]` keeps its last address.
    `recover()` relaunches exactly those slots, puts them behind the router and counts them in
    `num_new_engines` (trainers must connect to new engines before the next weight update).
    """

    args: Any
    launcher: Any
    urls: list = field(default_factory=list)
    all_engines: list = field(default_factory=list)
    router: Any = None
    update_weights: bool = True
    num_new_engines: int = 0
    launched: list = field(default_factory=list, repr=False)
    name: str = "rollout"

    @classmethod
    def launch(cls, args: Any, launcher: Any, num_engines: int, name: str) -> RolloutServer:
        """Start `num_engines` engines with `launcher`, the launcher of rollout engine `name`."""
        engines = launcher(args, num_engines)
        urls = check_launched_engines(engines, num_engines, name)
        server = cls(args, launcher, urls, list(getattr(engines, "actors", None) or urls), name=name)
        server.launched.append(engines)
        server.num_new_engines = len(server.urls)
        return server

    def mark_engine_dead(self, slot: int) -> None:
        """Take engine `slot` out of service: slot None, out of the router, its Ray actor killed (a hung
        engine must not keep its resources while its replacement starts)."""
        engine = self.all_engines[slot]
        if engine is None:
            return
        self.all_engines[slot] = None
        if isinstance(engine, ray.actor.ActorHandle):
            ray.kill(engine, no_restart=True)
        if self.router is not None:
            router_remove_worker(self.router, self.urls[slot])

    def recover(self) -> None:
        """Relaunch every engine whose slot is None and add the new engines to the router.

        When the cluster's alive nodes cannot hold the replacements at all (the node that offered their
        `--rollout-resources` is gone), `RunInterrupted` says so: the run stops, and its last joint commit resumes
        once the cluster can hold its layout again.
        """
        missing = [index for index, engine in enumerate(self.all_engines) if engine is None]
        if not missing:
            self.num_new_engines = 0
            return
        try:
            engines = self._relaunch(len(missing))
        except LayoutError as exc:
            raise RunInterrupted(
                f"rollout engine slot(s) {', '.join(map(str, missing))} died and cannot be relaunched: {exc}\nWhat "
                "the run committed is intact: rerun the same command to resume from its last joint commit once the "
                "cluster can hold its layout again (the lost node back, or other nodes with those resources)"
            ) from exc
        self.launched.append(engines)
        urls = check_launched_engines(engines, len(missing), self.name)
        actors = list(getattr(engines, "actors", None) or urls)
        for slot, url, actor in zip(missing, urls, actors, strict=True):
            logger.info("Rollout engine slot %d relaunched at %s (was %s)", slot, url, self.urls[slot])
            self.urls[slot] = url
            self.all_engines[slot] = actor
            if self.router is not None:
                router_add_worker(self.router, url)
        self.num_new_engines = len(missing)

    def _relaunch(self, count: int) -> Any:
        """`count` new engines from the launcher, checked to fit the cluster's alive nodes first and again when the
        launch fails (a relaunch placed on a node that was being lost fails once Ray notices): `LayoutError` then."""
        check_engines_fit(self.args, count)
        try:
            return self.launcher(self.args, count)
        except Exception:
            check_engines_fit(self.args, count)
            raise

    def shutdown(self) -> None:
        if self.router is not None:
            self.router.close()
        for engines in self.launched:
            if hasattr(engines, "shutdown"):
                engines.shutdown()


def live_urls(server: Any) -> list[str]:
    """The URLs of `server`'s engines that are in service (all of them for a server that tracks no slots)."""
    urls = list(getattr(server, "urls", None) or [])
    engines = getattr(server, "all_engines", None)
    if engines is None:
        return urls
    return [url for url, engine in zip(urls, list(engines), strict=True) if engine is not None]


def _sglang_router_call(router: Any, method: str, path: str, **kwargs: Any) -> Any:
    import httpx

    try:
        response = httpx.request(method, f"{router.url}{path}", timeout=30, **kwargs)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"sglang-router at {router.url} did not answer {method} {path}: {exc}") from exc
    return response


def router_remove_worker(router: Any, url: str) -> None:
    """Stop `router` (an sglang-router) sending requests to `url`: `DELETE /workers/{id}` of its worker API."""
    listing = _sglang_router_call(router, "GET", "/workers")
    workers = listing.json().get("workers", []) if listing.status_code == 200 else []
    ids = [worker.get("id") for worker in workers if worker.get("url") == url]
    if not ids:
        return  # the router dropped it already
    response = _sglang_router_call(router, "DELETE", f"/workers/{ids[0]}")
    if response.status_code >= 400:
        raise RuntimeError(
            f"sglang-router at {router.url} refused to remove worker {url} ({response.status_code}): {response.text}"
        )


def router_add_worker(router: Any, url: str) -> None:
    """Put a (relaunched) engine at `url` behind `router` (an sglang-router): `POST /workers {"url": url}`."""
    response = _sglang_router_call(router, "POST", "/workers", json={"url": url})
    if response.status_code >= 400:
        raise RuntimeError(
            f"sglang-router at {router.url} refused to add worker {url} ({response.status_code}): {response.text}"
        )


def engine_weight_version(urls: list[str], *, allow_inconsistent: bool = False) -> int | None:
    """The weight version all engines at `urls` serve (`GET /model_info` "weight_version"); None without engines.

    Inconsistent or non-numeric versions are an error (unless `allow_inconsistent`: then the oldest).
    """
    from slime.engine_control import engine_weight_versions

    versions = set(engine_weight_versions(urls, timeout=30).values())
    if not versions:
        return None
    try:
        numbers = sorted(int(version) for version in versions)
    except ValueError as exc:
        raise RuntimeError(f"Rollout engines report a non-numeric weight version: {sorted(versions)}") from exc
    if len(numbers) > 1 and not allow_inconsistent:
        raise RuntimeError(f"Rollout engines serve inconsistent weight versions: {numbers}")
    return numbers[0]


def launch_rollout_servers(args: Any, engine_launcher: Any = None) -> dict[str, RolloutServer]:
    """Start the engines of `--rollout-engine` (default "cpu"; `engine_launcher`, its launcher, when the caller
    has resolved it already); returns `{"model": RolloutServer}`.

    With `--rollout-router sglang-router` (or "auto" and several engines, the package installed) an sglang-router
    is started in front of them and its address is
    set as `args.rollout_router_url`, where the rollout functions send their requests; its output, and at the
    end how many requests it routed, go to `<save>/logs/sglang-router.log` (a temporary file without `--save`).
    """
    from slime.backend_interfaces import resolve_engine_launcher

    settings = ServingSettings.from_args(args)
    launcher = engine_launcher if engine_launcher is not None else resolve_engine_launcher(args)
    server = RolloutServer.launch(args, launcher, settings.num_engines, settings.engine)
    if settings.router_to_start == "sglang-router":
        log_path = Path(settings.save).expanduser() / "logs" / "sglang-router.log" if settings.save else None
        try:
            server.router = SGLangRouter(server.urls, log_path=log_path)
        except BaseException:
            server.shutdown()
            raise
        args.rollout_router_url = server.router.url
    return {"model": server}


@ray.remote
class ServingCluster:
    """Owns engines, router, queue controller and engine lock across trainer restarts."""

    def __init__(self, args: Any, restore_plan: Any = None) -> None:
        from slime.ray.health_monitor import start_health_monitors
        from slime.ray.lock import Lock

        self.args = copy.deepcopy(args)
        self.restore_plan = restore_plan
        self.servers = launch_rollout_servers(self.args)
        self._health_monitors: list = start_health_monitors(self.servers, self.args)
        self._controller = None
        self._trainers: dict[str, list] = {}
        self._job_id = None
        self.engine_lock = Lock.options(num_cpus=0, num_gpus=0).remote()

    def _pause_monitors(self) -> None:
        for monitor in self._health_monitors:
            monitor.pause()

    def recover_updatable_engines(self) -> dict:
        """Relaunch dead engines of the updatable server; never `recover()` when all are alive.

        A no-op recover would reset `num_new_engines`, losing the markers a fresh trainer needs.
        """
        self._pause_monitors()
        server = next((s for s in self.servers.values() if getattr(s, "update_weights", False)), None)
        if server is not None and any(engine is None for engine in server.all_engines):
            server.recover()
        return self.servers

    def finish_rollout(self) -> dict:
        """Rollout boundary: pause the health monitors and check every engine once."""
        self._pause_monitors()
        for monitor in self._health_monitors:
            monitor.check_once()
        return self.servers

    def health_monitoring_resume(self) -> dict:
        for monitor in self._health_monitors:
            monitor.resume()
        return self.servers

    def health_monitoring_pause(self) -> dict:
        self._pause_monitors()
        return self.servers

    def get_queue_controller(self) -> Any:
        """The run's queue controller, created on first use and owned by this cluster."""
        if self._controller is None:
            from slime.data import queue_data_source

            self._controller = queue_data_source.create_queue_controller(self.args, restore_plan=self.restore_plan)
        return self._controller

    def deployment(self, reused: bool = False) -> ServingDeployment:
        return ServingDeployment(
            placements={},
            servers=self.servers,
            controller=self._controller,
            restore_plan=self.restore_plan,
            routers={name: s.router for name, s in self.servers.items() if s.router is not None},
            engine_lock=self.engine_lock,
            reused=reused,
        )

    def attach_training(self, job_id: str) -> dict:
        if self._job_id not in (None, job_id):
            raise RuntimeError(f"Serving cluster is attached to training job {self._job_id}; detach it first")
        self._job_id = job_id
        return self.servers

    def detach_training(self, job_id: str) -> None:
        if self._job_id == job_id:
            self._job_id = None
            self._trainers.clear()

    def register_trainers(self, role: str, handles: list) -> None:
        self._trainers[role] = list(handles)

    def release_trainers(self, role: str) -> None:
        self._trainers.pop(role, None)

    def get_updatable_engines_and_lock(self) -> tuple[list, Any, int]:
        server = next((s for s in self.servers.values() if s.update_weights), None)
        if server is None:
            return [], self.engine_lock, 0
        return list(server.all_engines), self.engine_lock, server.num_new_engines

    def get_weight_version(self, allow_inconsistent: bool = False) -> int | None:
        urls = [url for server in self.servers.values() for url in live_urls(server)]
        return engine_weight_version(urls, allow_inconsistent=allow_inconsistent)

    def clear_updatable_num_new_engines(self) -> None:
        for server in self.servers.values():
            if server.update_weights:
                server.num_new_engines = 0

    def dispose(self) -> None:
        """Full teardown: the health monitors, the controller (closed, then killed), routers and engines."""
        for monitor in self._health_monitors:
            monitor.stop()
        try:
            if self._controller is not None:
                ray.get(self._controller.close.remote())
                ray.kill(self._controller, no_restart=True)
                self._controller = None
        finally:
            for server in self.servers.values():
                server.shutdown()
