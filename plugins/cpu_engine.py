"""The built-in CPU rollout engine plugin: SGLang-protocol HTTP servers running a Hugging Face model on CPU.

`launch_cpu_engines(args, num_engines)` starts `num_engines` Ray actors (`CPUEngineActor`), each serving one
model over HTTP on 127.0.0.1 (see `slime.plugins.cpu_engine_server`), and returns their URLs.
`start_router(worker_urls, args)` puts them behind one address: `sglang-router` (round robin) when it is
installed, the built-in round-robin proxy otherwise (`--rollout-router auto|sglang|builtin`).

This module is imported whenever the plugin registry is built, so it imports nothing heavy (no torch,
no transformers, no sglang_router) at module level.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from slime import hookimpl
from slime.specs import RolloutEngineSpec

ROUTER_STARTUP_TIMEOUT_S = 60.0


class CPUEngineActor:
    """A Ray actor (wrapped with `ray.remote` by the launcher) that serves one CPU engine from its process."""

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str | None = None,
        seed: int = 0,
        max_batch_size: int = 32,
        batch_wait_s: float = 0.005,
        num_threads: int | None = 1,
    ) -> None:
        from slime.plugins.cpu_engine_server import EngineServer

        self._server = EngineServer(
            model_path,
            tokenizer_path,
            seed=seed,
            max_batch_size=max_batch_size,
            batch_wait_s=batch_wait_s,
            num_threads=num_threads,
        )

    def url(self) -> str:
        """The engine's base URL, e.g. `http://127.0.0.1:41234`."""
        return self._server.url

    def stop(self) -> None:
        self._server.stop()


class LaunchedEngines(list):
    """The engines' URLs (a `list[str]`), holding the Ray actors that serve them.

    Ray destroys an actor once no handle refers to it, so keep this object for as long as the engines
    are needed; `shutdown()` stops them.
    """

    def __init__(self, urls: Sequence[str], actors: Sequence[Any]) -> None:
        super().__init__(urls)
        self.actors = list(actors)

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors.clear()


def resolve_model_path(args: Any) -> str:
    """`args.hf_checkpoint`, or the built-in tiny model (built on first use)."""
    checkpoint = getattr(args, "hf_checkpoint", None)
    if checkpoint:
        if not Path(checkpoint, "config.json").is_file():
            raise FileNotFoundError(
                f"--hf-checkpoint {checkpoint} is not a Hugging Face model directory (no config.json there)"
            )
        return str(checkpoint)
    from slime.plugins.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())


def launch_cpu_engines(args: Any, num_engines: int) -> LaunchedEngines:
    """Start `num_engines` CPU engine actors on Ray and return their URLs once every one answers HTTP.

    Reads (all optional): `hf_checkpoint`, `rollout_seed` (engine i seeds its sampling with seed + i),
    `cpu_engine_max_batch_size` (32), `cpu_engine_batch_wait_ms` (5), `cpu_engine_num_cpus` (Ray CPUs
    reserved per engine, 0 so engines never starve training ranks of scheduling slots), and
    `cpu_engine_num_threads` (torch threads per engine, 1).
    """
    import ray

    if num_engines < 1:
        raise ValueError(f"launch_cpu_engines needs at least one engine, got num_engines={num_engines}")
    model_path = resolve_model_path(args)
    actor_class = ray.remote(CPUEngineActor).options(
        num_cpus=getattr(args, "cpu_engine_num_cpus", 0) or 0,
        max_concurrency=4,
    )
    seed = int(getattr(args, "rollout_seed", 42) or 0)
    actors = [
        actor_class.remote(
            model_path,
            None,
            seed=seed + index,
            max_batch_size=int(getattr(args, "cpu_engine_max_batch_size", 32) or 32),
            batch_wait_s=float(getattr(args, "cpu_engine_batch_wait_ms", 5) or 0) / 1000.0,
            num_threads=int(getattr(args, "cpu_engine_num_threads", 1) or 1),
        )
        for index in range(num_engines)
    ]
    try:
        urls = ray.get([actor.url.remote() for actor in actors])
    except Exception as exc:
        for actor in actors:
            ray.kill(actor)
        raise RuntimeError(f"a CPU engine failed to start serving {model_path}: {exc}") from exc
    return LaunchedEngines(urls, actors)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def sglang_router_available() -> bool:
    """Whether the `sglang-router` package is installed (checked without importing it)."""
    try:
        return importlib.util.find_spec("sglang_router") is not None
    except ImportError:  # an import hook that forbids sglang counts as "not installed"
        return False


class SGLangRouter:
    """`sglang-router launch ... --policy round_robin` as a subprocess of this process."""

    kind = "sglang-router"

    def __init__(self, worker_urls: Sequence[str], host: str = "127.0.0.1", port: int | None = None) -> None:
        import httpx

        self.worker_urls = list(worker_urls)
        self.port = port or _free_port(host)
        self.url = f"http://{host}:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="slime-sglang-router-", suffix=".log", delete=False)
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
            "--log-level",
            "warn",
        ]
        self._process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ROUTER_STARTUP_TIMEOUT_S
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {self._process.returncode}: {self._log_tail()}")
            try:
                workers = httpx.get(f"{self.url}/workers", timeout=2).json().get("workers", [])
                healthy = {w.get("url") for w in workers if w.get("is_healthy")}
                if healthy >= set(self.worker_urls):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(
                    f"sglang-router on {self.url} did not report all workers {self.worker_urls} healthy within "
                    f"{ROUTER_STARTUP_TIMEOUT_S:.0f} s: {self._log_tail()}"
                )
            time.sleep(0.05)

    def _log_tail(self) -> str:
        try:
            return Path(self._log.name).read_text(errors="replace")[-2000:] or "(no output)"
        except OSError:
            return "(log unreadable)"

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()
        os.unlink(self._log.name)


def start_router(worker_urls: Sequence[str], args: Any = None):
    """Put `worker_urls` behind one URL; returns an object with `url`, `kind` and `close()`.

    `args.rollout_router`: "auto" (default: sglang-router when installed, else built-in), "sglang"
    (required; fails when not installed) or "builtin".
    """
    choice = getattr(args, "rollout_router", "auto") or "auto"
    if choice not in ("auto", "sglang", "builtin"):
        raise ValueError(f"--rollout-router must be auto, sglang or builtin, got {choice!r}")
    if choice == "sglang" or (choice == "auto" and sglang_router_available()):
        if not sglang_router_available():
            raise RuntimeError("--rollout-router sglang needs the sglang-router package: pip install sglang-router")
        return SGLangRouter(worker_urls)
    from slime.plugins.cpu_engine_server import RoundRobinProxy

    return RoundRobinProxy(worker_urls)


@hookimpl
def slime_rollout_engines() -> Iterable[RolloutEngineSpec]:
    return [
        RolloutEngineSpec(
            "cpu",
            launch_cpu_engines,
            "Hugging Face causal LM on CPU behind the SGLang HTTP protocol (default: the built-in tiny model)",
            requires_gpu=False,
        )
    ]


@hookimpl
def slime_addoption(parser) -> None:
    group = parser.add_argument_group("cpu engine")
    group.add_argument(
        "--rollout-router",
        choices=["auto", "sglang", "builtin"],
        default="auto",
        help="router in front of the engines: sglang-router when installed (auto), or the built-in round robin",
    )
    group.add_argument("--cpu-engine-max-batch-size", type=int, default=32, help="requests generated together")
    group.add_argument("--cpu-engine-batch-wait-ms", type=float, default=5.0, help="time to collect a batch")
    group.add_argument("--cpu-engine-num-cpus", type=float, default=0, help="Ray CPUs reserved per engine actor")
    group.add_argument("--cpu-engine-num-threads", type=int, default=1, help="torch threads per engine")
