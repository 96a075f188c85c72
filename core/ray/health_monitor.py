"""Engine health monitors: one background thread per rollout server probes every live engine (`probe_engine`).

An engine that crashed (killed, out of memory) or hangs must stop receiving requests and be relaunched
before the next weight update. After `--rollout-health-check-failures` consecutive failed checks (each
bounded by `--rollout-health-check-timeout`, one every `--rollout-health-check-interval` seconds) the
monitor marks the engine dead through `server.mark_engine_dead(slot)`: its slot in `all_engines`
becomes None (so `recover()` relaunches exactly it), it leaves the router and its actor is killed (a hung
engine must not hold its resources while a replacement starts). Rollout clients learn of it from the
engine URLs the rollout manager publishes at the next step; within a step they skip engines that fail.

Monitors poll only while resumed: rollout steps resume them, the rollout boundary pauses them and runs one
decisive `check_once()`, so weight updates (engines may answer slowly meanwhile) never count as failures.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 5.0
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_FAILURE_THRESHOLD = 3
#: The most time `check_once` waits between two probes of a failing engine.
BOUNDARY_RECHECK_S = 0.2


@dataclass(frozen=True)
class HealthSettings:
    interval_s: float = DEFAULT_INTERVAL_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    failure_threshold: int = DEFAULT_FAILURE_THRESHOLD

    @classmethod
    def from_args(cls, args: Any) -> HealthSettings:
        """Settings from `--rollout-health-check-{interval,timeout,failures}` (defaults when unset)."""

        def pick(name: str, default: float) -> float:
            value = getattr(args, name, None)
            return default if value is None else value

        settings = cls(
            float(pick("rollout_health_check_interval", DEFAULT_INTERVAL_S)),
            float(pick("rollout_health_check_timeout", DEFAULT_TIMEOUT_S)),
            int(pick("rollout_health_check_failures", DEFAULT_FAILURE_THRESHOLD)),
        )
        for flag, value in (
            ("--rollout-health-check-interval", settings.interval_s),
            ("--rollout-health-check-timeout", settings.timeout_s),
            ("--rollout-health-check-failures", settings.failure_threshold),
        ):
            if value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        return settings


def probe_engine(url: str, timeout_s: float, client: Any = None) -> str | None:
    """None when the engine at `url` is healthy, else why not.

    Healthy: `GET /health_generate` (a real one-token generation, so a hung scheduler fails it) answers 200
    within `timeout_s`; or it does not, but `GET /v1/loads` answers within `timeout_s` with requests running or
    waiting: the engine is busy, not dead (SGLang answers /v1/loads from its scheduler too, so a hung one fails
    both). Pass a long-lived `httpx.Client`: a fresh one per probe builds an SSL context each time, which cost
    the rollout manager about a tenth of its CPU at one boundary check per step.
    """
    import httpx

    client = client or httpx
    try:
        response = client.get(f"{url}/health_generate", timeout=timeout_s)
    except httpx.TimeoutException as exc:
        busy = _busy_requests(url, timeout_s, client)
        if busy:
            logger.info(
                "Rollout engine %s is busy (%d requests in flight): health generation took over %gs",
                url,
                busy,
                timeout_s,
            )
            return None
        detail = exc or "timeout"
        return f"/health_generate did not answer within {timeout_s:g} s and the engine reports no work ({detail})"
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc or 'no detail'}"
    if response.status_code != 200:
        return f"/health_generate answered {response.status_code}: {response.text[:200]}"
    return None


def _busy_requests(url: str, timeout_s: float, client: Any) -> int:
    """Requests running or waiting on the engine per `GET /v1/loads` (0 when it does not answer in time)."""
    import httpx

    try:
        response = client.get(f"{url}/v1/loads", timeout=timeout_s)
        loads = response.json().get("loads", []) if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return 0  # no answer (or not the protocol's shape) is the probe's failure, reported by the caller
    return sum(int(load.get("num_running_reqs", 0)) + int(load.get("num_waiting_reqs", 0)) for load in loads)


class EngineHealthMonitor:
    """Polls the live engines of one `RolloutServer` from a daemon thread while resumed.

    `server` needs `urls`, `all_engines` (None = dead) and `mark_engine_dead(slot)`. Consecutive
    failures are counted per URL: a relaunched engine in the same slot starts from zero.
    """

    def __init__(self, server: Any, settings: HealthSettings | None = None, *, name: str = "model") -> None:
        self.server = server
        self.settings = settings or HealthSettings()
        self.name = name
        self.failures: dict[str, int] = {}
        self._active = threading.Event()
        self._stopped = threading.Event()
        self._round = threading.Lock()  # held while probing and marking: pause() waits for it
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"health-{name}")
        self._client: Any = None  # one httpx.Client for every probe, made on first use
        self._thread = threading.Thread(target=self._run, name=f"engine-health-{name}", daemon=True)

    def start(self) -> None:
        """Start the thread; it polls once `resume()` is called."""
        self._thread.start()

    def resume(self) -> None:
        self._active.set()

    def pause(self) -> None:
        """Stop polling; returns once no check is in progress (so engines may be relaunched safely)."""
        self._active.clear()
        with self._round:
            pass

    def stop(self) -> None:
        self._stopped.set()
        self._active.set()  # wake the thread so it sees the stop
        if self._thread.is_alive():
            self._thread.join(timeout=self.settings.timeout_s + 5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()

    def check_once(self) -> list[str]:
        """A decisive check at a rollout boundary: an engine that fails is probed again right away, up to
        the failure threshold, and marked dead if it never answers. Returns the URLs marked dead."""
        marked: list[str] = []
        with self._round:
            slots = self._live_slots()
            for attempt in range(self.settings.failure_threshold):
                if attempt:
                    time.sleep(min(self.settings.interval_s, BOUNDARY_RECHECK_S))
                newly_dead, slots = self._poll(slots)
                marked += newly_dead
                if not slots:
                    break
        return marked

    # ---------------------------------------------------------------- internals

    def _live_slots(self) -> list[tuple[int, str]]:
        pairs = zip(list(self.server.urls), list(self.server.all_engines), strict=True)
        return [(slot, url) for slot, (url, engine) in enumerate(pairs) if engine is not None]

    def _poll(self, slots: list[tuple[int, str]]) -> tuple[list[str], list[tuple[int, str]]]:
        """Probe `slots` once; returns the URLs marked dead now and the slots that failed but are not dead yet."""
        if self._client is None:
            import httpx

            self._client = httpx.Client()
        client = self._client
        reasons = list(self._pool.map(lambda item: probe_engine(item[1], self.settings.timeout_s, client), slots))
        threshold = self.settings.failure_threshold
        marked, failing = [], []
        for (slot, url), reason in zip(slots, reasons, strict=True):
            where = f"Rollout engine {url} ({self.name} slot {slot})"
            if reason is None:
                if self.failures.pop(url, 0):
                    logger.info("%s answers its health check again", where)
                continue
            count = self.failures[url] = self.failures.get(url, 0) + 1
            if count < threshold:
                logger.warning("%s failed health check %d/%d: %s", where, count, threshold, reason)
                failing.append((slot, url))
                continue
            del self.failures[url]
            if self.server.all_engines[slot] is None or self.server.urls[slot] != url:
                continue  # relaunched or marked meanwhile
            logger.error(
                "%s is dead after %d consecutive failed health checks (last: %s); it is removed from routing and "
                "relaunched at the next engine recovery",
                where,
                count,
                reason,
            )
            try:
                self.server.mark_engine_dead(slot)
            except Exception:  # noqa: BLE001 - the slot is None already; the monitor must keep running
                logger.exception("Removing dead rollout engine %s from routing failed", url)
            marked.append(url)
        return marked, failing

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._active.wait()
            if self._stopped.is_set():
                return
            with self._round:
                if self._active.is_set():
                    try:
                        self._poll(self._live_slots())
                    except Exception:  # noqa: BLE001 - a monitor that dies silently would hide every later crash
                        logger.exception("Health check round of the %s engines failed", self.name)
            self._stopped.wait(self.settings.interval_s)


def start_health_monitors(servers: dict[str, Any], args: Any) -> list[EngineHealthMonitor]:
    """One started (paused) monitor per server that has engines."""
    settings = HealthSettings.from_args(args)
    monitors = []
    for name, server in servers.items():
        if getattr(server, "all_engines", None):
            monitor = EngineHealthMonitor(server, settings, name=name)
            monitor.start()
            monitors.append(monitor)
    return monitors
