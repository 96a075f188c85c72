"""The CPU engine's HTTP face: the subset of SGLang's server protocol that slime and sglang-router use.

`create_app(engine, scheduler)` builds the FastAPI app; `EngineServer` runs one engine behind uvicorn on
127.0.0.1 and a free (or given) port, in a background thread of the current process (a test, or a Ray actor).
`listen_socket` takes the port first, so a port in use is an error naming the port and the server.
Route handlers take `fastapi.Request`, imported at module level so FastAPI can resolve the annotations.
The routes are the engine contract of `slime.backend_interfaces.ENGINE_ENDPOINTS`, plus `/health_generate`,
`/update_weight_version` and `/flush_cache`, which SGLang servers also have.
Errors answer `{"error": {"message": ..., "code": ...}}` with status 400, as SGLang does.
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from slime.plugins.cpu_engine_core import CPUEngine, EngineScheduler, RequestError, parse_generate_body


def _error(message: str, status: int = 400):
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


async def _json_body(request: Any, required: bool = True) -> Any:
    raw = await request.body()
    if not raw and not required:
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from exc


def create_app(engine: CPUEngine, scheduler: EngineScheduler):
    """The FastAPI application serving `engine` through `scheduler`."""
    app = FastAPI(title="slime CPU engine")

    @app.exception_handler(RequestError)
    async def _request_error(_request: Request, exc: RequestError):
        return _error(str(exc), exc.status)

    async def run(requests):
        futures = scheduler.submit(requests)
        return await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))

    @app.post("/generate")
    async def generate(request: Request):
        body = await _json_body(request)
        requests, batched = parse_generate_body(body, engine.tokenizer, engine.vocab_size, engine.next_rid)
        too_long = [r for r in requests if len(r.input_ids) >= engine.context_length]
        if too_long:
            raise RequestError(
                f"the input has {len(too_long[0].input_ids)} tokens; the model's context length is "
                f"{engine.context_length}"
            )
        results = await run(requests)
        return JSONResponse(results if batched else results[0])

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        probe = {"input_ids": [engine.pad_token_id], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        requests, _ = parse_generate_body(probe, engine.tokenizer, engine.vocab_size, engine.next_rid)
        await run(requests)
        return Response(status_code=200)

    @app.get("/model_info")
    async def model_info():
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.tokenizer_path,
            "is_generation": True,
            "weight_version": engine.weight_version,
        }

    @app.get("/server_info")
    async def server_info():
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.tokenizer_path,
            "served_model_name": engine.model_path,
            "engine": "slime-cpu",
            "tp_size": 1,
            "dp_size": 1,
            "context_length": engine.context_length,
            "max_batch_size": scheduler.max_batch_size,
            "random_seed": engine.seed,
            "weight_version": engine.weight_version,
            "internal_states": [{"num_batches": engine.num_batches, "num_requests": engine.num_requests}],
        }

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": engine.weight_version}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await _json_body(request)
        version = body.get("new_version") if isinstance(body, dict) else None
        if version is None:
            raise RequestError("/update_weight_version needs {'new_version': str}")
        if body.get("abort_all_requests"):
            scheduler.abort(abort_all=True)
        engine.weight_version = str(version)
        return {"success": True, "message": f"Weight version updated to {version}"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await _json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise RequestError("/update_weights_from_disk needs {'model_path': str, 'weight_version': str?}")
        if body.get("abort_all_requests"):
            scheduler.abort(abort_all=True)
        try:
            message = await asyncio.to_thread(
                engine.update_weights_from_disk, body["model_path"], body.get("weight_version")
            )
        except RequestError as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        return {"success": True, "message": message, "num_paused_requests": 0}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        # No prefix cache is kept between requests; there is nothing to drop.
        return Response("Cache flushed.", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await _json_body(request, required=False)
        if not isinstance(body, dict) or (body.get("rid") is None and not body.get("abort_all")):
            raise RequestError("/abort_request needs {'rid': str} or {'abort_all': true}")
        count = scheduler.abort(rid=body.get("rid"), abort_all=bool(body.get("abort_all")))
        return {"success": True, "aborted": count}

    return app


class PortInUseError(OSError):
    """A component could not listen on its port: another process holds it."""


def listen_socket(host: str, port: int, component: str) -> socket.socket:
    """A socket listening on `host:port` (port 0: a free one, race-free since this socket holds it).

    A port that cannot be bound is an error naming the port and `component`, the server that wanted it.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # Lets a restarted server reuse a port still in TIME_WAIT; a port another socket listens on stays taken.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(
                exc.errno,
                f"{component} cannot listen on {host}:{port}: the port is already in use by another process; "
                "stop that process, choose another port, or pass port 0 for a free one",
            ) from exc
        raise OSError(exc.errno, f"{component} cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


class _ThreadedUvicorn:
    """uvicorn serving an app on an already listening socket (which it then owns), in a daemon thread."""

    def __init__(self, app: Any, sock: socket.socket, name: str = "uvicorn") -> None:
        import uvicorn

        self._sock = sock
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        # "error": sglang-router probes each worker's protocol, which uvicorn would log as invalid requests.
        config = uvicorn.Config(app, log_level="error", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.name = name
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} failed to start on {self.url}")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


class EngineServer:
    """One CPU engine served over HTTP from this process; `url` is where it listens.

    The port is taken before the model loads, so a port in use fails at once; `sock` is a socket already
    listening (from `listen_socket`) for callers that publish the address before the model is loaded.
    """

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        sock: socket.socket | None = None,
        seed: int = 0,
        max_batch_size: int = 32,
        batch_wait_s: float = 0.005,
        num_threads: int | None = None,
    ) -> None:
        sock = sock if sock is not None else listen_socket(host, port, "CPU engine HTTP server")
        try:
            if num_threads is not None:
                import torch

                torch.set_num_threads(num_threads)
            self.engine = CPUEngine(model_path, tokenizer_path, seed=seed)
            self.scheduler = EngineScheduler(self.engine, max_batch_size=max_batch_size, batch_wait_s=batch_wait_s)
        except BaseException:
            sock.close()
            raise
        try:
            self._http = _ThreadedUvicorn(create_app(self.engine, self.scheduler), sock, name="cpu-engine-http")
        except BaseException:
            self.scheduler.close()
            raise
        self.url = self._http.url

    def stop(self) -> None:
        self._http.stop()
        self.scheduler.close()
