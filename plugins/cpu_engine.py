"""The built-in CPU rollout engine plugin: SGLang-protocol HTTP servers running a Hugging Face model on CPU.

`launch_cpu_engines(args, num_engines)` starts `num_engines` Ray actors (`CPUEngineActor`), each serving one
model over HTTP on 127.0.0.1 (see `slime.plugins.cpu_engine_server`), and returns their URLs. Each engine
writes its stdout/stderr to its own log (`--cpu-engine-log-dir`, default `<save>/logs/cpu-engines`); an engine
that cannot load its model, dies or misses `--cpu-engine-startup-timeout` raises `EngineStartError` naming
its address and quoting the tail of that log.
`launch_cpu_engines` is the plugin's `slime.backend_interfaces.EngineLauncher`; a run puts the engines behind
one sglang-router with `--rollout-router sglang-router` (see `slime.ray.router`).

This module is imported whenever the plugin registry is built, so it imports nothing heavy (no torch,
no transformers) at module level.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from slime import hookimpl
from slime.plugins.cpu_engine_settings import ENGINE_STARTUP_TIMEOUT_S, CPUEngineSettings
from slime.ray.layout import engine_actor_options
from slime.specs import RolloutEngineSpec

ENGINE_HOST = "127.0.0.1"
LOG_TAIL_LINES = 40
LOG_TAIL_CHARS = 4000


class _Tee:
    """A text stream that writes to `stream` and to the engine's log file (Ray still streams `stream`)."""

    def __init__(self, stream: Any, log: Any) -> None:
        self._stream = stream
        self._log = log

    def write(self, text: str) -> int:
        self._log.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._log.flush()
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def log_tail(path: str | os.PathLike | None, lines: int = LOG_TAIL_LINES, max_chars: int = LOG_TAIL_CHARS) -> str:
    """The last `lines` lines (at most `max_chars` characters) of a log file, or why there are none."""
    if path is None:
        return "(no log file)"
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return f"(no log at {path}: the engine had not started writing it, or it is on the engine's node)"
    except OSError as exc:
        return f"(log {path} unreadable here: {exc.strerror}; it may be on the engine's node)"
    tail = "".join(text.splitlines(keepends=True)[-lines:])[-max_chars:]
    return tail or "(the log is empty)"


class CPUEngineActor:
    """A Ray actor (wrapped with `ray.remote` by the launcher) that serves one CPU engine from its process.

    Construction is cheap: it starts the engine's log (`log_path`, which then receives this process's
    stdout, stderr and, on a fatal signal, a faulthandler traceback) and takes the HTTP port, so `address()`
    answers before `start()` loads the model. A launcher can then name the engine's address and log when
    the model fails to load or the process dies.
    """

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str | None = None,
        seed: int = 0,
        max_batch_size: int = 32,
        batch_wait_s: float = 0.005,
        num_threads: int | None = 1,
        *,
        batch_per_request: bool = False,
        name: str = "CPU engine",
        log_path: str | None = None,
        host: str = ENGINE_HOST,
        port: int = 0,
    ) -> None:
        from slime.plugins.cpu_engine_server import listen_socket

        self._options = {
            "seed": seed,
            "max_batch_size": max_batch_size,
            "batch_wait_s": batch_wait_s,
            "batch_per_request": batch_per_request,
            "num_threads": num_threads,
        }
        self._model_path, self._tokenizer_path = model_path, tokenizer_path
        self._log_path = log_path
        self._log = self._capture_output(log_path) if log_path is not None else None
        self._note(f"{name}: pid {os.getpid()}, model {model_path}")
        self._sock = listen_socket(host, port, f"{name} HTTP server")
        host, port = self._sock.getsockname()[:2]
        self._url = f"http://{host}:{port}"
        self._note(f"{name}: listening on {self._url}, loading the model")
        self._server = None

    def _note(self, line: str) -> None:
        """A progress line for the engine's log only: the run's console shows the driver's summary of the engines,
        not each engine's steps (without a log, stdout, which Ray streams)."""
        if self._log is not None:
            self._log.write(line + "\n")
        else:
            print(line, flush=True)

    @staticmethod
    def _capture_output(log_path: str) -> Any:
        """Open the log for the rest of this process's life and send stdout, stderr and fatal signals to it."""
        import faulthandler

        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115 - process lifetime
        sys.stdout = _Tee(sys.stdout, log)
        sys.stderr = _Tee(sys.stderr, log)
        faulthandler.enable(file=log)
        return log

    def address(self) -> dict[str, Any]:
        """Where the engine listens (before the model is loaded), its pid and its log file."""
        return {"url": self._url, "pid": os.getpid(), "log_path": self._log_path}

    def start(self) -> str:
        """Load the model and serve it; returns the URL. A failure's traceback goes to the log, then it is raised
        (to the log only: Ray already reports the raised error with its traceback)."""
        from slime.plugins.cpu_engine_server import EngineServer

        try:
            self._server = EngineServer(self._model_path, self._tokenizer_path, sock=self._sock, **self._options)
        except BaseException:
            if self._log is not None:
                traceback.print_exc(file=self._log)
            raise
        self._note(f"serving {self._model_path} on {self._url}")
        return self._url

    def url(self) -> str:
        """The engine's base URL, e.g. `http://127.0.0.1:41234`."""
        return self._url

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
        else:
            self._sock.close()


class LaunchedEngines(list):
    """The engines' URLs (a `list[str]`), holding the Ray actors that serve them.

    Ray destroys an actor once no handle refers to it, so keep this object for as long as the engines
    are needed; `shutdown()` stops them and removes their logs when they were in a temporary directory.
    """

    def __init__(self, urls: Sequence[str], actors: Sequence[Any], temporary_log_dir: str | None = None) -> None:
        super().__init__(urls)
        self.actors = list(actors)
        self.temporary_log_dir = temporary_log_dir

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors.clear()
        if self.temporary_log_dir is not None:
            shutil.rmtree(self.temporary_log_dir, ignore_errors=True)
            self.temporary_log_dir = None


def resolve_model_path(settings: CPUEngineSettings) -> str:
    """`--hf-checkpoint` (checked to be a complete model directory), or the built-in tiny model."""
    if settings.hf_checkpoint:
        from slime.utils.hf_checkpoint import validate_hf_checkpoint_dir

        validate_hf_checkpoint_dir(settings.hf_checkpoint)
        return str(settings.hf_checkpoint)
    from slime.plugins.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())


def _engine_log_dir(settings: CPUEngineSettings) -> tuple[Path, bool]:
    """Where engine logs go: `--cpu-engine-log-dir`, `<save>/logs/cpu-engines`, else a temporary directory
    (the flag says whether it is temporary)."""
    if settings.log_dir:
        return Path(settings.log_dir).expanduser(), False
    if settings.save:
        return Path(settings.save).expanduser() / "logs" / "cpu-engines", False
    return Path(tempfile.mkdtemp(prefix="slime-cpu-engines-")), True


class EngineStartError(RuntimeError):
    """A CPU engine did not come up; the message names the engine, its address and the tail of its log."""


_LOGGED_PID = re.compile(r": pid (\d+), model ")
_LOGGED_URL = re.compile(r": listening on (http://\S+), loading the model")


def _failure(what: str, model_path: str, info: dict[str, Any], reason: str) -> EngineStartError:
    log_path = info.get("log_path")
    tail = log_tail(log_path)
    # An engine that died before `address()` answered may still have logged its pid and address.
    logged = {}
    try:
        head = Path(log_path).read_text(errors="replace")[:4096] if log_path else ""
    except OSError:
        head = ""
    for key, pattern in (("pid", _LOGGED_PID), ("url", _LOGGED_URL)):
        found = pattern.search(head)
        if found:
            logged[key] = found.group(1)
    url = info.get("url") or logged.get("url") or f"{ENGINE_HOST}, port not yet taken"
    pid = info.get("pid") or logged.get("pid")
    return EngineStartError(
        f"{what} ({url}{f', pid {pid}' if pid else ''}) failed to start serving {model_path}: {reason}\n"
        f"--- last lines of its log {log_path} ---\n{tail}"
    )


def _reason(exc: BaseException) -> str:
    """The error an engine raised (a Ray task error carries it as `cause`), else Ray's own report."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    return f"{type(exc).__name__}: {exc}"


def _await_engines(
    refs: dict[Any, int], infos: list[dict[str, Any]], names: list[str], model_path: str, timeout: tuple[float, float]
) -> dict[int, Any]:
    """The value of every ref (keyed by engine index); the first engine that fails or times out raises.

    `timeout` is (deadline on the monotonic clock, the startup timeout in seconds it came from).
    """
    import ray

    deadline, timeout_s = timeout
    values: dict[int, Any] = {}
    pending = dict(refs)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            index = next(iter(pending.values()))
            raise _failure(
                names[index],
                model_path,
                infos[index],
                f"it did not come up within {timeout_s:g} s (raise --cpu-engine-startup-timeout for a model that "
                "loads slowly)",
            )
        index = pending.pop(ready[0])
        try:
            values[index] = ray.get(ready[0])
        except Exception as exc:
            raise _failure(names[index], model_path, infos[index], _reason(exc)) from exc
    return values


def launch_cpu_engines(args: Any, num_engines: int) -> LaunchedEngines:
    """Start `num_engines` CPU engine actors on Ray and return their URLs once every one answers HTTP.

    Reads `CPUEngineSettings.from_args(args)`: the model (`--hf-checkpoint`, default the built-in tiny
    model), `--rollout-seed` (engine i seeds its sampling with seed + i), the cpu engine options and
    `--save` (see `_engine_log_dir`). An engine that fails to load its model, dies or does not come up in
    time raises `EngineStartError` with its address and the tail of its log; every engine of the launch is
    then stopped.
    """
    import ray

    if num_engines < 1:
        raise ValueError(f"launch_cpu_engines needs at least one engine, got num_engines={num_engines}")
    settings = CPUEngineSettings.from_args(args)
    model_path = resolve_model_path(settings)
    timeout = settings.startup_timeout_s
    log_dir, temporary = _engine_log_dir(settings)
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    names = [f"CPU engine {index + 1}/{num_engines}" for index in range(num_engines)]
    actor_class = ray.remote(CPUEngineActor).options(
        **engine_actor_options(args, engine_resources(args)), max_concurrency=4
    )
    infos = [{"log_path": str(log_dir / f"engine-{stamp}-{index}.log")} for index in range(num_engines)]
    actors = [
        actor_class.remote(
            model_path,
            None,
            seed=settings.seed + index,
            max_batch_size=settings.max_batch_size,
            batch_wait_s=settings.batch_wait_ms / 1000.0,
            batch_per_request=settings.batch_per_request,
            num_threads=settings.num_threads,
            name=names[index],
            log_path=infos[index]["log_path"],
        )
        for index in range(num_engines)
    ]
    timing = (time.monotonic() + timeout, timeout)
    try:
        addresses = _await_engines(
            {actor.address.remote(): i for i, actor in enumerate(actors)}, infos, names, model_path, timing
        )
        for index, address in addresses.items():
            infos[index].update(address)
        urls = _await_engines(
            {actor.start.remote(): i for i, actor in enumerate(actors)}, infos, names, model_path, timing
        )
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        raise
    return LaunchedEngines([urls[index] for index in range(num_engines)], actors, str(log_dir) if temporary else None)


def engine_resources(args: Any) -> dict[str, float]:
    """What one CPU engine asks Ray for (`RolloutEngineSpec.resources`): `--cpu-engine-num-cpus` CPUs."""
    return {"CPU": CPUEngineSettings.from_args(args).num_cpus}


def _check_deterministic(args: Any) -> None:
    """CPU engines honour `--deterministic`: per-request `sampling_seed`, each request's inputs batched alone."""
    CPUEngineSettings.from_args(args).check_deterministic()


@hookimpl
def slime_rollout_engines() -> Iterable[RolloutEngineSpec]:
    return [
        RolloutEngineSpec(
            "cpu",
            launch_cpu_engines,
            "Hugging Face causal LM on CPU behind the SGLang HTTP protocol (default: the built-in tiny model)",
            deterministic=_check_deterministic,
            resources=engine_resources,
        )
    ]


@hookimpl(trylast=True)
def slime_configure(args: Any) -> None:
    """Refuse bad cpu engine option values when the run's arguments are parsed, before any engine starts."""
    CPUEngineSettings.from_args(args)


@hookimpl
def slime_addoption(parser) -> None:
    group = parser.add_argument_group("cpu engine")
    group.add_argument(
        "--cpu-engine-max-batch-size",
        type=int,
        default=32,
        help="requests generated together (under --deterministic: the inputs of one request, in chunks of this size)",
    )
    group.add_argument(
        "--cpu-engine-batch-wait-ms", type=float, default=5.0, help="time to collect a batch (not with --deterministic)"
    )
    group.add_argument("--cpu-engine-num-cpus", type=float, default=0, help="Ray CPUs reserved per engine actor")
    group.add_argument("--cpu-engine-num-threads", type=int, default=1, help="torch threads per engine")
    group.add_argument(
        "--cpu-engine-startup-timeout",
        type=float,
        default=ENGINE_STARTUP_TIMEOUT_S,
        help="seconds an engine may take to load its model and listen",
    )
    group.add_argument(
        "--cpu-engine-log-dir",
        default=None,
        help="where each engine's stdout/stderr log goes (default: <save>/logs/cpu-engines, else a temporary "
        "directory removed at shutdown)",
    )
