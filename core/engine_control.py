"""HTTP requests slime makes to running rollout engines, with errors that name the engine, the endpoint and
the engine's answer.

The weight senders (`slime.weight_sync`) and the rollout manager (`slime.ray.rollout`) talk to engines
through these helpers: `engine_get` / `engine_post` for one engine, `post_engines` for the same request to
several engines at once (each in its own thread, so one slow engine does not delay the others), and
`start_posts` when the caller has work of its own to do while the requests run (an engine answers
`/init_weights_update_group` and `/update_weights_from_distributed` only once the trainer has joined the group
or finished its broadcast). Above them, the control calls of a weight update: pausing and continuing
generation, releasing and resuming engine memory (`--offload-rollout`) and reading and checking the weight
version each engine serves (`GET /model_info`). The endpoints are `slime.backend_interfaces.ENGINE_ENDPOINTS`.

An engine that answers a status other than 200, or a body with `"success": false`, is an `EngineRequestError`
(never a silent skip); so is one that does not answer within the timeout. Importing this module imports
neither Ray nor SGLang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

__all__ = [
    "EngineRequestError",
    "EngineUnreachableError",
    "PendingPosts",
    "check_weight_version",
    "continue_generation",
    "engine_get",
    "engine_post",
    "engine_weight_versions",
    "pause_generation",
    "post_engines",
    "release_memory_occupation",
    "resume_memory_occupation",
    "start_posts",
]

#: `POST /pause_generation` modes: "abort" ends in-flight requests (finish_reason "abort"); "retract" puts them
#: back in the engine's queue, to finish with the new weights after `/continue_generation`.
PAUSE_MODES = ("abort", "retract")


class EngineRequestError(RuntimeError):
    """A rollout engine refused a request, failed it, or did not answer in time."""


class EngineUnreachableError(EngineRequestError):
    """A rollout engine gave no answer at all: the connection failed or the request timed out."""


def _engine_message(response: httpx.Response) -> str:
    """The reason an engine gives in its answer: SGLang's `message`, the CPU engine's `error.message`, else
    the raw body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if body.get("message"):
            return str(body["message"])
    return response.text.strip()


def _answer(url: str, method: str, path: str, response: httpx.Response) -> Any:
    """The JSON body of an engine's answer (None when it has none); `EngineRequestError` unless it succeeded."""
    if response.status_code != 200:
        raise EngineRequestError(
            f"rollout engine {url} refused {method} {path} ({response.status_code}): {_engine_message(response)}"
        )
    try:
        body = response.json() if response.content else None
    except ValueError:
        return None
    if isinstance(body, dict) and body.get("success") is False:
        raise EngineRequestError(f"rollout engine {url} failed {method} {path}: {_engine_message(response)}")
    return body


_CLIENT: httpx.Client | None = None
_CLIENT_LOCK = threading.Lock()


def _client() -> httpx.Client:
    """This process's client for engine requests, built once: `httpx.get`/`httpx.post` build a client, and its TLS
    context, per call (about 35 ms here, four times per weight update and engine). No idle connections are kept,
    so a request never goes out on a connection the engine closed meanwhile (a relaunched engine, an idle timeout)."""
    global _CLIENT
    with _CLIENT_LOCK:
        if _CLIENT is None:
            _CLIENT = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
        return _CLIENT


def engine_get(url: str, path: str, timeout: float) -> Any:
    """`GET url+path`: the engine's JSON answer; `EngineRequestError` naming the engine when it fails."""
    try:
        response = _client().get(f"{url}{path}", timeout=timeout)
    except httpx.HTTPError as exc:
        raise EngineUnreachableError(f"rollout engine {url} did not answer GET {path}: {exc!r}") from exc
    return _answer(url, "GET", path, response)


def engine_post(url: str, path: str, body: Any, timeout: float) -> Any:
    """`POST url+path` with JSON `body`: the engine's JSON answer; `EngineRequestError` when it fails."""
    try:
        response = _client().post(f"{url}{path}", json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        raise EngineUnreachableError(f"rollout engine {url} did not answer POST {path}: {exc!r}") from exc
    return _answer(url, "POST", path, response)


class PendingPosts:
    """The same endpoint posted to several engines, each request in a daemon thread (`start_posts`)."""

    def __init__(self, path: str, urls: Sequence[str], bodies: Sequence[Any], timeout: float) -> None:
        self.path = path
        self.urls = list(urls)
        self._results: list[Any] = [None] * len(self.urls)
        self._errors: list[BaseException | None] = [None] * len(self.urls)
        self._threads = [
            threading.Thread(target=self._run, args=(i, body, timeout), name=f"engine-post{path}", daemon=True)
            for i, body in enumerate(bodies)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, index: int, body: Any, timeout: float) -> None:
        try:
            self._results[index] = engine_post(self.urls[index], self.path, body, timeout)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            self._errors[index] = exc

    def done(self) -> bool:
        return not any(thread.is_alive() for thread in self._threads)

    def first_error(self) -> BaseException | None:
        """The error of the first engine (in URL order) whose request has failed so far, else None."""
        return next((error for error in self._errors if error is not None), None)

    def wait(self, timeout: float) -> list[Any]:
        """The engines' answers, in URL order, once every request has ended; the first engine's error when one
        failed, or an `EngineRequestError` naming the engines still busy after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        error = self.first_error()
        if error is not None:
            raise error
        busy = [url for url, thread in zip(self.urls, self._threads, strict=True) if thread.is_alive()]
        if busy:
            raise EngineUnreachableError(
                f"rollout engine(s) {', '.join(busy)} did not answer POST {self.path} within {timeout:g} s"
            )
        return list(self._results)


def start_posts(urls: Sequence[str], path: str, body: Any, timeout: float) -> PendingPosts:
    """Post `body` (a list: one body per engine, in URL order) to `path` of every engine, without waiting."""
    bodies = body if isinstance(body, list) else [body] * len(urls)
    if len(bodies) != len(urls):
        raise ValueError(f"{len(bodies)} request bodies for {len(urls)} engines ({path})")
    return PendingPosts(path, urls, bodies, timeout)


def post_engines(urls: Sequence[str], path: str, body: Any, timeout: float) -> list[Any]:
    """Post to every engine at once and wait for all of them (see `start_posts` and `PendingPosts.wait`)."""
    return start_posts(urls, path, body, timeout).wait(timeout)


# ------------------------------------------------------------------------------- weight-update control


def pause_generation(urls: Sequence[str], mode: str, timeout: float) -> None:
    """Stop the engines generating before a weight update (`mode`: one of `PAUSE_MODES`)."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    post_engines(urls, "/pause_generation", {"mode": mode}, timeout)


def continue_generation(urls: Sequence[str], timeout: float) -> None:
    """Let paused engines generate again (retracted requests finish with the new weights)."""
    post_engines(urls, "/continue_generation", {}, timeout)


def release_memory_occupation(urls: Sequence[str], timeout: float) -> None:
    """Have the engines free their weights' and KV cache's device memory (colocated runs, `--offload-rollout`)."""
    post_engines(urls, "/release_memory_occupation", {"tags": None}, timeout)


def resume_memory_occupation(urls: Sequence[str], timeout: float) -> None:
    """Have engines that released their memory take it back (before they receive weights or generate)."""
    post_engines(urls, "/resume_memory_occupation", {"tags": None}, timeout)


def engine_weight_versions(urls: Sequence[str], timeout: float) -> dict[str, str]:
    """`{url: the weight version the engine serves}`, from each engine's `GET /model_info` "weight_version"."""
    versions = {}
    for url in urls:
        info = engine_get(url, "/model_info", timeout)
        if not isinstance(info, dict) or info.get("weight_version") is None:
            raise EngineRequestError(
                f"rollout engine {url} answers GET /model_info without 'weight_version' (got {info!r}); slime reads "
                "the served weight version there, as SGLang >= 0.5.19 reports it"
            )
        versions[url] = str(info["weight_version"])
    return versions


def check_weight_version(urls: Sequence[str], expected: int, timeout: float) -> None:
    """`EngineRequestError` naming every engine that does not serve weight version `expected` after an update."""
    reported = engine_weight_versions(urls, timeout)
    wrong = {url: version for url, version in reported.items() if version != str(expected)}
    if wrong:
        listed = "; ".join(f"engine {url} reports {version!r}" for url, version in wrong.items())
        raise EngineRequestError(
            f"after weight update {expected}, {listed} (expected {str(expected)!r}): the engine did not apply the "
            "update; stopping the run rather than training on rollouts from other weights"
        )
