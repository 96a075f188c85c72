"""The run's rollout router: one sglang-router in front of the engines (`--rollout-router sglang-router`).

`SGLangRouter(worker_urls)` starts `python -m sglang_router.launch_router` (the `sglang-router` package,
`pip install "slime-rl[router]"`; it runs on CPU) as a subprocess of the calling process, round robin over
`worker_urls`, and returns once every worker is healthy behind it. `slime.ray.serving.launch_rollout_servers`
starts it for a run and sets `args.rollout_router_url`, where the rollout functions send their requests;
`router_remove_worker` / `router_add_worker` (in `slime.ray.serving`) take a dead engine out and put its
relaunched replacement in through the router's worker API. Importing this module imports no sglang_router.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from slime.utils.child_process import die_with_parent

logger = logging.getLogger(__name__)

ROUTER_CHOICES = ("auto", "none", "sglang-router")
ROUTER_STARTUP_TIMEOUT_S = 60.0
ROUTER_PORT_ATTEMPTS = 3
#: sglang-router's Prometheus counter of the requests it routed, per endpoint.
_ROUTED = re.compile(r'^s[mg]{2}_router_requests_total\{[^}]*endpoint="generate"[^}]*\}\s+([0-9.eE+]+)$', re.M)


def sglang_router_available() -> bool:
    """Whether the `sglang-router` package is installed (checked without importing it)."""
    try:
        return importlib.util.find_spec("sglang_router") is not None
    except ImportError:  # an import hook that forbids sglang counts as "not installed"
        return False


def router_for(choice: str, num_engines: int, deterministic: bool = False) -> str:
    """The router a run starts for `--rollout-router` `choice`: "auto" is "sglang-router" in front of several
    engines when the package is installed, else "none" (one engine needs no router).

    Under `--deterministic` "auto" is "none": the rollout function then sends each prompt group to an engine as one
    batched request with a seed per sample, which sglang-router cannot forward (it takes one `sampling_params` per
    batch), so through a router every sample would be a request and a batch of its own."""
    if choice != "auto":
        return choice
    wanted = num_engines > 1 and not deterministic
    return "sglang-router" if wanted and sglang_router_available() else "none"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class SGLangRouter:
    """`sglang-router` (round robin) over `worker_urls`, as a subprocess of this process; `url` is its address.

    Without `port`, free ports are chosen (for requests and for its Prometheus metrics) and handed to the
    subprocess; another process may take one in between, so a router that exits with "Address already in
    use" is started again on new ports (`ROUTER_PORT_ATTEMPTS` tries). A given `port` in use is an
    `OSError(EADDRINUSE)` naming it.
    """

    def __init__(
        self,
        worker_urls: Sequence[str],
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: str | os.PathLike | None = None,
    ) -> None:
        if not sglang_router_available():
            raise RuntimeError(
                '--rollout-router sglang-router needs the sglang-router package: pip install "slime-rl[router]"'
            )
        self.worker_urls = list(worker_urls)
        self._temporary_log = log_path is None
        if log_path is None:
            log_path = tempfile.NamedTemporaryFile(prefix="slime-sglang-router-", suffix=".log", delete=False).name
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._start(host, port)
        except BaseException:
            if self._temporary_log:
                self.log_path.unlink(missing_ok=True)
            raise

    def _start(self, host: str, port: int | None) -> None:
        attempts = 1 if port else ROUTER_PORT_ATTEMPTS
        for _ in range(attempts):
            self.port = port or _free_port(host)
            self.url = f"http://{host}:{self.port}"
            metrics_port = _free_port(host)
            self.metrics_url = f"http://{host}:{metrics_port}/metrics"
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - the router's output for its lifetime
            self._log_start = self._log.tell()
            command = [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                host,
                "--port",
                str(self.port),
                "--worker-urls",
                *self.worker_urls,
                "--policy",
                "round_robin",
                "--prometheus-host",
                host,
                "--prometheus-port",
                str(metrics_port),
                "--log-level",
                "warn",
            ]
            self._process = subprocess.Popen(
                command, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
            )
            if self._wait_until_ready():
                logger.info(
                    "sglang-router at %s routes to %d engines: %s", self.url, len(self.worker_urls), self.worker_urls
                )
                return
            tail = self._log_tail()
            self._stop()
        if port:
            raise OSError(
                errno.EADDRINUSE,
                f"sglang-router cannot listen on {host}:{port}: the port is already in use by another process; "
                f"stop that process or choose another port. Its output: {tail}",
            )
        raise OSError(
            errno.EADDRINUSE,
            f"sglang-router could not listen on {host}: each of {attempts} free ports chosen for it was taken by "
            f"another process before it started (last {self.port}). Its output: {tail}",
        )

    def _wait_until_ready(self) -> bool:
        """True once every worker is healthy behind the router; False when it exited because a port was taken."""
        import httpx

        deadline = time.monotonic() + ROUTER_STARTUP_TIMEOUT_S
        while True:
            if self._process.poll() is not None:
                tail = self._log_tail()
                if "Address already in use" in tail:
                    return False
                self._stop()
                raise RuntimeError(f"sglang-router on {self.url} exited with code {self._process.returncode}: {tail}")
            try:
                workers = httpx.get(f"{self.url}/workers", timeout=2).json().get("workers", [])
                healthy = {w.get("url") for w in workers if w.get("is_healthy")}
                if healthy >= set(self.worker_urls):
                    return True
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                tail = self._log_tail()
                self._stop()
                raise RuntimeError(
                    f"sglang-router on {self.url} did not report all workers {self.worker_urls} healthy within "
                    f"{ROUTER_STARTUP_TIMEOUT_S:.0f} s: {tail}"
                )
            time.sleep(0.05)

    def routed_requests(self) -> int | None:
        """How many `/generate` requests the router has routed (its Prometheus counter); None if unreadable."""
        import httpx

        try:
            text = httpx.get(self.metrics_url, timeout=5).text
        except httpx.HTTPError:
            return None
        counts = _ROUTED.findall(text)
        return int(sum(float(count) for count in counts)) if counts else 0

    def _log_tail(self) -> str:
        """The end of what this start of the router wrote to its log."""
        try:
            with open(self.log_path, "rb") as handle:
                handle.seek(self._log_start)
                return handle.read().decode(errors="replace")[-2000:] or "(no output)"
        except OSError:
            return "(log unreadable)"

    def _stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()

    def close(self) -> None:
        """Record how many requests the router routed (in the run's log and the router's), then stop it; a
        temporary log is removed."""
        if self._process.poll() is None:
            summary = f"sglang-router at {self.url} routed {self.routed_requests()} /generate requests"
            logger.info(summary)
            self._log.write(f"slime-rl: {summary}\n".encode())
            self._log.flush()
        self._stop()
        if self._temporary_log:
            self.log_path.unlink(missing_ok=True)
