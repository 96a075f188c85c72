"""Launching SGLang servers as rollout engines: one Ray actor per engine, each owning one server process.

`launch_sglang_engines(args, num_engines)` is the plugin's `slime.backend_interfaces.EngineLauncher`. Each
engine is an `SGLangEngineActor` that runs `python -m sglang.launch_server` as a **subprocess** (SGLang's own
entry point, in the actor's Python, so the server is exactly what users run by hand; an in-process `Engine`
would share the actor's signal handlers and event loop). The actor:

- picks a free port on 127.0.0.1 and retries on another one when the server reports the port taken
  (`--sglang-engine-port-attempts`);
- adds what a CPU-only machine needs (`--device cpu`, no CUDA graphs, a small static memory pool, no warm-up)
  unless the user gave those options through `--sglang-*`, and puts the CPU stand-ins for torchvision and vllm
  on the server's `PYTHONPATH` when they are not installed (see cpu_standins/README.md);
- waits for `GET /health_generate` (a real one-token generation) up to `--sglang-engine-startup-timeout`,
  and otherwise raises `EngineStartError` with the command line and the tail of the server's log;
- ties the server's life to its own: the server runs in its own process group, receives SIGKILL from the
  kernel when the actor's process dies (`PR_SET_PDEATHSIG`; SGLang's own subprocesses do the same towards
  the server), and `stop()` ends the whole group. No server outlives a killed run.

Engines listen on 127.0.0.1 only: a server reachable from other machines needs a per-run API key that every
client sends, which slime-rl does not have yet, so a `--sglang-host` other than a loopback address is refused.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from slime.plugins.sglang_engine.server_args import SGLANG_VERSION, installed_version, sglang_environment
from slime.plugins.sglang_engine.settings import SGLangEngineSettings
from slime.ray.layout import engine_actor_options
from slime.utils.child_process import die_with_parent

ENGINE_HOST = "127.0.0.1"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
#: What a CPU-only machine needs (SGLang's defaults assume CUDA), each unless given through --sglang-*.
CPU_DEFAULTS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("--device",), ("--device", "cpu")),
    (("--cuda-graph-backend-decode", "--disable-cuda-graph"), ("--cuda-graph-backend-decode", "disabled")),
    (("--cuda-graph-backend-prefill", "--disable-cuda-graph"), ("--cuda-graph-backend-prefill", "disabled")),
    (("--skip-server-warmup",), ("--skip-server-warmup",)),
    (("--mem-fraction-static",), ("--mem-fraction-static", "0.05")),
    (("--max-total-tokens",), ("--max-total-tokens", "4096")),
)
LOG_TAIL_LINES = 40
HEALTH_POLL_S = 1.0
#: How uvicorn reports a port it cannot bind ("[Errno 98] error while attempting to bind on address ...").
PORT_TAKEN_MARKERS = ("address already in use", "errno 98")


class EngineStartError(RuntimeError):
    """An SGLang engine did not come up; the message has its command line and the tail of its log."""


def log_tail(path: str | os.PathLike, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of the server's log, or why there are none."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        return f"(no log at {path}: {exc.strerror})"
    return "".join(text.splitlines(keepends=True)[-lines:]) or "(the log is empty)"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((ENGINE_HOST, 0))
        return sock.getsockname()[1]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_resources(args: Any) -> dict[str, float]:
    """What one engine asks Ray for (`RolloutEngineSpec.resources`): `--sglang-engine-num-cpus` CPUs, and
    `--rollout-num-gpus-per-engine` GPUs where CUDA is available (none on a CPU-only machine)."""
    settings = SGLangEngineSettings.from_args(args)
    return {"CPU": settings.num_cpus, "GPU": 0.0 if not _cuda_available() else float(settings.gpus_per_engine)}


def server_command(settings: SGLangEngineSettings, model_path: str, port: int, seed: int, on_cpu: bool) -> list[str]:
    """The `sglang.launch_server` command line of one engine: slime's options, then the user's `--sglang-*`."""
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path]
    command += ["--host", ENGINE_HOST, "--port", str(port)]
    if not settings.given("--random-seed"):
        command += ["--random-seed", str(seed)]
    if not settings.given("--tp-size", "--tensor-parallel-size"):
        command += ["--tp-size", str(settings.gpus_per_engine)]
    if on_cpu:
        for flags, tokens in CPU_DEFAULTS:
            if not settings.given(*flags):
                command += list(tokens)
    return command + list(settings.server_args)


class SGLangEngineActor:
    """A Ray actor (wrapped with `ray.remote` by the launcher) owning one SGLang server process.

    Use it with the default concurrency of one: Ray then runs every method on the actor's main thread, the
    thread the server's parent-death signal is bound to.
    """

    def __init__(self, command: list[str], log_path: str, name: str) -> None:
        self._command = list(command)
        self._log_path = log_path
        self._name = name
        self._process: subprocess.Popen | None = None
        self._url: str | None = None

    def start(self, timeout_s: float, port_attempts: int) -> str:
        """Start the server and return its URL once `/health_generate` answers 200; see the module docstring."""
        deadline = time.monotonic() + timeout_s
        for attempt in range(1, port_attempts + 1):
            port = _free_port()
            command = [str(port) if previous == "--port" else token for previous, token in _pairs(self._command)]
            self._spawn(command)
            outcome = self._await_health(f"http://{ENGINE_HOST}:{port}", deadline)
            if outcome == "healthy":
                self._url = f"http://{ENGINE_HOST}:{port}"
                print(f"{self._name}: serving on {self._url} (pid {self._process.pid})", flush=True)
                return self._url
            self.stop()
            tail = log_tail(self._log_path)
            if outcome != "timeout" and self._port_was_taken(port) and attempt < port_attempts:
                print(f"{self._name}: port {port} was taken, retrying on another one", flush=True)
                continue
            reason = (
                f"did not answer /health_generate within {timeout_s:g} s (raise --sglang-engine-startup-timeout "
                "for a model that loads slowly)"
                if outcome == "timeout"
                else f"exited with status {outcome}"
            )
            raise EngineStartError(
                f"{self._name} {reason}.\ncommand: {' '.join(command)}\n--- last lines of its log "
                f"{self._log_path} ---\n{tail}"
            )
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _port_was_taken(self, port: int) -> bool:
        """Whether this attempt's server reported `port` taken (anywhere in its part of the log)."""
        try:
            attempt_log = Path(self._log_path).read_text(errors="replace").rsplit("\n$ ", 1)[-1].lower()
        except OSError:
            return False
        return str(port) in attempt_log and any(marker in attempt_log for marker in PORT_TAKEN_MARKERS)

    def _spawn(self, command: list[str]) -> None:
        Path(self._log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "ab") as log:
            log.write(f"\n$ {' '.join(command)}\n".encode())
            log.flush()
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=sglang_environment(),
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def _await_health(self, url: str, deadline: float) -> str:
        """ "healthy", "timeout", or the server's exit status as text."""
        import httpx

        while time.monotonic() < deadline:
            status = self._process.poll()
            if status is not None:
                return str(status)
            try:
                if httpx.get(f"{url}/health_generate", timeout=10).status_code == 200:
                    return "healthy"
            except httpx.HTTPError:
                pass
            time.sleep(HEALTH_POLL_S)
        return "timeout"

    def url(self) -> str | None:
        return self._url

    def pid(self) -> int | None:
        """The server's process id (its process group id too)."""
        return None if self._process is None else self._process.pid

    def stop(self, grace_s: float = 10.0) -> None:
        """End the server's whole process group: SIGTERM, then SIGKILL after `grace_s`."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(process.pid, signal.SIGKILL)
        process.wait()


def _pairs(tokens: list[str]) -> list[tuple[str | None, str]]:
    return list(zip([None, *tokens[:-1]], tokens, strict=True))


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def _log_dir(settings: SGLangEngineSettings) -> Path:
    if settings.log_dir:
        return Path(settings.log_dir).expanduser()
    if settings.save:
        return Path(settings.save).expanduser() / "logs" / "sglang-engines"
    import tempfile

    return Path(tempfile.gettempdir()) / "slime-sglang-engines"


def check_host(settings: SGLangEngineSettings) -> None:
    """Refuse a server host other than loopback (see the module docstring)."""
    tokens = list(settings.server_args)
    for index, token in enumerate(tokens[:-1]):
        if token == "--host" and tokens[index + 1] not in LOOPBACK_HOSTS:
            raise ValueError(
                f"--sglang-host {tokens[index + 1]}: SGLang engines listen on 127.0.0.1 only (a server reachable "
                "from other machines needs a per-run API key, which slime-rl does not pass yet); drop --sglang-host"
            )


class SGLangEngines(list):
    """The engines' URLs (a `list[str]`) with their actors (`slime.backend_interfaces.LaunchedEngines`).

    `shutdown()` stops every server gracefully (SIGTERM to its process group), then kills the actors. Keep
    this object for as long as the engines are needed: Ray destroys actors nobody holds a handle to.
    """

    def __init__(self, urls: list[str], actors: list[Any]) -> None:
        super().__init__(urls)
        self.actors = list(actors)

    def shutdown(self) -> None:
        _stop_all(self.actors)


def launch_sglang_engines(args: Any, num_engines: int) -> SGLangEngines:
    """Start `num_engines` SGLang engines on Ray and return their URLs once every one generates.

    Reads `SGLangEngineSettings.from_args(args)`. Engine i seeds SGLang's sampling with `--rollout-seed` + i.
    An engine that fails raises `EngineStartError` (command line and log tail) after every engine of the
    launch is stopped.
    """
    import ray

    from slime.plugins.cpu_engine import resolve_model_path

    if num_engines < 1:
        raise ValueError(f"launch_sglang_engines needs at least one engine, got num_engines={num_engines}")
    if installed_version() is None:
        from slime.plugins.sglang_engine.server_args import INSTALL_HINT

        raise EngineStartError(f"--rollout-engine sglang: SGLang {SGLANG_VERSION} is not installed; {INSTALL_HINT}")
    settings = SGLangEngineSettings.from_args(args)
    check_host(settings)
    model_path = resolve_model_path(settings)
    on_cpu = not _cuda_available()
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    log_dir = _log_dir(settings)
    actor_class = ray.remote(SGLangEngineActor).options(**engine_actor_options(args, engine_resources(args)))
    actors, names, logs = [], [], []
    for index in range(num_engines):
        names.append(f"SGLang engine {index + 1}/{num_engines}")
        logs.append(str(log_dir / f"engine-{stamp}-{index}.log"))
        command = server_command(settings, model_path, 0, settings.seed + index, on_cpu)
        actors.append(actor_class.remote(command, logs[index], names[index]))
    starts = {
        actor.start.remote(settings.startup_timeout_s, settings.port_attempts): i for i, actor in enumerate(actors)
    }
    urls: dict[int, str] = {}
    try:
        pending = list(starts)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            index = starts[ready[0]]
            try:
                urls[index] = ray.get(ready[0])
            except ray.exceptions.RayTaskError as exc:
                raise (exc.cause if isinstance(exc.cause, EngineStartError) else exc) from exc
            except ray.exceptions.RayActorError as exc:
                raise EngineStartError(
                    f"{names[index]}'s actor died while starting its server ({exc}).\n--- last lines of its log "
                    f"{logs[index]} ---\n{log_tail(logs[index])}"
                ) from exc
    except BaseException:
        _stop_all(actors)
        raise
    return SGLangEngines([urls[index] for index in range(num_engines)], actors)


def _stop_all(actors: list[Any]) -> None:
    """Stop every engine's server (each actor ends its process group), then kill the actors."""
    import ray

    stops = [actor.stop.remote() for actor in actors]
    ray.wait(stops, num_returns=len(stops), timeout=30)
    for actor in actors:
        ray.kill(actor)
    actors.clear()
