"""The CPU engine's HTTP face: SGLang 0.5.19's server protocol, as slime, trainers and sglang-router use it.

`create_app(engine, scheduler)` builds the FastAPI app; `EngineServer` runs one engine behind uvicorn on
127.0.0.1 and a free (or given) port, in a background thread of the current process (a test, or a Ray actor).
`listen_socket` takes the port first, so a port in use is an error naming the port and the server.
Route handlers take `fastapi.Request`, imported at module level so FastAPI can resolve the annotations.

Routes: the engine contract of `slime.backend_interfaces.ENGINE_ENDPOINTS` (`/generate`, `/health`,
`/model_info`, `/server_info`, `/update_weights_from_disk`, `/abort_request`, ...), plus SGLang's
`/health_generate`, `/flush_cache`, `/v1/loads`, `/update_weight_version`, `/pause_generation`,
`/continue_generation`, `/release_memory_occupation`, `/resume_memory_occupation` and the weight transfers
`/init_weights_update_group`, `/update_weights_from_distributed`, `/destroy_weights_update_group` and
`/update_weights_from_tensor` (see `slime.plugins.cpu_engine_weights` for how the engine joins a group and
reads tensors). `/get_weight_version` (deprecated in SGLang 0.5.19, which answers 404 there) still answers
until slime reads the version from `/model_info`.

Bodies are checked against SGLang's request schemas: a malformed body answers 400
`{"error": {"message": ..., "code": 400}}` naming the field. A weight operation that is well formed but
fails (a group that does not form, an unknown parameter name) answers 400 `{"success": false, "message": ...}`
as SGLang does, and leaves the served weights as they were. Blocking work (joining a group, broadcasts,
loading weights, pausing) runs off the event loop, so `/health` keeps answering meanwhile (unlike SGLang,
whose server blocks while a group forms).
"""

from __future__ import annotations

import asyncio
import datetime
import errno
import json
import socket
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from slime.plugins.cpu_engine_core import (
    DEFAULT_GROUP_TIMEOUT_S,
    WEIGHTS_RELEASED_MESSAGE,
    CPUEngine,
    RequestError,
    parse_generate_body,
)
from slime.plugins.cpu_engine_scheduler import EngineScheduler
from slime.plugins.cpu_engine_weights import parse_control_body


def _error(message: str, status: int = 400):
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def _refusal(message: str):
    """SGLang's answer to a weight operation that failed."""
    return JSONResponse({"success": False, "message": message}, status_code=400)


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
        if engine.weights_released:
            raise RequestError(WEIGHTS_RELEASED_MESSAGE)
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
        if engine.gate.mode is not None or engine.weights_released:
            # Paused or released on purpose: a probe would wait (or fail); the server itself is healthy.
            return Response(status_code=200)
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
            "batch_per_request": scheduler.batch_per_request,
            "random_seed": engine.seed,
            "weight_version": engine.weight_version,
            "internal_states": [{"num_batches": engine.num_batches, "num_requests": engine.num_requests}],
        }

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": engine.weight_version}

    @app.get("/v1/loads")
    async def loads():
        counts = scheduler.loads()
        return {
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "loads": [{"dp_rank": 0, **counts, "token_usage": 0.0}],
        }

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        params = parse_control_body("/update_weight_version", await _json_body(request))
        if params["abort_all_requests"]:
            scheduler.abort(abort_all=True, message="Aborted by /update_weight_version")
        version = params["new_version"]
        engine.weight_version = version
        return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        params = parse_control_body("/pause_generation", await _json_body(request, required=False))
        await asyncio.to_thread(scheduler.pause, params["mode"])
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        parse_control_body("/continue_generation", await _json_body(request, required=False))
        scheduler.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request):
        params = parse_control_body("/release_memory_occupation", await _json_body(request, required=False))
        await asyncio.to_thread(engine.release_memory, params["tags"])
        return None

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request):
        params = parse_control_body("/resume_memory_occupation", await _json_body(request, required=False))
        await asyncio.to_thread(engine.resume_memory, params["tags"])
        return None

    async def weight_operation(function, *args):
        try:
            message = await asyncio.to_thread(function, *args)
        except RequestError as exc:
            return _refusal(str(exc))
        return {"success": True, "message": message}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        params = parse_control_body("/init_weights_update_group", await _json_body(request))
        return await weight_operation(
            engine.weight_groups.init,
            params["master_address"],
            params["master_port"],
            params["rank_offset"],
            params["world_size"],
            params["group_name"],
            params["backend"],
        )

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        params = parse_control_body("/destroy_weights_update_group", await _json_body(request, required=False))
        return await weight_operation(engine.weight_groups.destroy, params["group_name"])

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        params = parse_control_body("/update_weights_from_distributed", await _json_body(request))
        if params["abort_all_requests"]:
            scheduler.abort(abort_all=True, message="Aborted by /update_weights_from_distributed")
        return await weight_operation(
            engine.update_weights_from_distributed,
            params["names"],
            params["dtypes"],
            params["shapes"],
            params["group_name"],
            params["load_format"],
            params["weight_version"],
        )

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        params = parse_control_body("/update_weights_from_tensor", await _json_body(request))
        if params["abort_all_requests"]:
            scheduler.abort(abort_all=True, message="Aborted by /update_weights_from_tensor")
        # One entry per tensor-parallel rank; the CPU engine is rank 0 of 1.
        entry = params["serialized_named_tensors"][0]
        return await weight_operation(engine.update_weights_from_tensor, entry, params["weight_version"])

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await _json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise RequestError("/update_weights_from_disk needs {'model_path': str, 'weight_version': str?}")
        if body.get("abort_all_requests"):
            scheduler.abort(abort_all=True, message="Aborted by /update_weights_from_disk")
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
        batch_per_request: bool = False,
        num_threads: int | None = None,
        weights_group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    ) -> None:
        sock = sock if sock is not None else listen_socket(host, port, "CPU engine HTTP server")
        try:
            if num_threads is not None:
                import torch

                torch.set_num_threads(num_threads)
            self.engine = CPUEngine(
                model_path, tokenizer_path, seed=seed, weights_group_timeout_s=weights_group_timeout_s
            )
            self.scheduler = EngineScheduler(
                self.engine,
                max_batch_size=max_batch_size,
                batch_wait_s=batch_wait_s,
                batch_per_request=batch_per_request,
            )
        except BaseException:
            sock.close()
            raise
        try:
            self._http = _ThreadedUvicorn(create_app(self.engine, self.scheduler), sock, name="cpu-engine-http")
        except BaseException:
            self.scheduler.close()
            self.engine.close()
            raise
        self.url = self._http.url

    def stop(self) -> None:
        self._http.stop()
        self.scheduler.close()
        self.engine.close()
