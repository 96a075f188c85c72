"""The rollout manager's side of a weight update (`slime.engine_control`, `RolloutManager.prepare_weight_update`,
`finish_weight_update`, `update_weights_from_disk`) and `--offload-rollout`, against the real CPU engine; the order
and bodies of the calls against `_RecordingEngine`, an HTTP server that answers only `ENGINE_ENDPOINTS` paths."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import pytest

from slime.backend_interfaces import ENGINE_ENDPOINTS
from slime.engine_control import EngineRequestError, check_weight_version, engine_weight_versions, post_engines
from slime.ray import rollout, serving

Manager = rollout.RolloutManager.__ray_metadata__.modified_class


def _manager(args, urls, **fields):
    """A rollout manager (made without its constructor: no Ray, no data) whose engines are at `urls`."""
    manager = object.__new__(Manager)
    manager.args = args
    manager.serving = None
    manager.servers = {"model": serving.RolloutServer(SimpleNamespace(), None, list(urls), list(urls))}
    manager.rollout_id = -1
    manager.weight_version = 0
    manager._health_monitors = []
    for name, value in fields.items():
        setattr(manager, name, value)
    return manager


# ------------------------------------------------------------------------------------- the real CPU engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from slime.plugins.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def engine(model_dir):
    from slime.plugins.cpu_engine_server import EngineServer

    server = EngineServer(str(model_dir), num_threads=1)
    yield server
    server.stop()


def _generate(url: str) -> dict:
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    return httpx.post(f"{url}/generate", json=body, timeout=30).json()


def test_a_disk_update_pauses_loads_checks_and_continues_the_engines(engine, model_dir, tmp_path):
    manager = _manager(SimpleNamespace(), [engine.url])
    manager.update_weights_from_disk(str(model_dir), "5")
    assert manager.get_weight_version() == 5 == manager.weight_version
    assert _generate(engine.url)["meta_info"]["weight_version"] == "5"  # generating again

    with pytest.raises(EngineRequestError, match=f"rollout engine {engine.url} refused POST /update_weights_from_disk"):
        manager.update_weights_from_disk(str(tmp_path / "missing"), "6")
    assert manager.weight_version == 5
    post_engines([engine.url], "/continue_generation", {}, 30)  # the failed update left the engine paused


def test_engines_that_do_not_report_the_new_version_stop_the_run(engine):
    manager = _manager(SimpleNamespace(), [engine.url])
    post_engines([engine.url], "/update_weight_version", {"new_version": "8"}, 30)
    assert engine_weight_versions([engine.url], 30) == {engine.url: "8"}
    check_weight_version([engine.url], 8, 30)
    with pytest.raises(EngineRequestError, match=rf"after weight update 9, engine {engine.url} reports '8' \(expec"):
        manager.finish_weight_update(9)
    assert manager.weight_version == 0  # not adopted
    post_engines([engine.url], "/update_weight_version", {"new_version": "latest"}, 30)
    with pytest.raises(RuntimeError, match="non-numeric weight version"):
        manager.get_weight_version()


def test_offloaded_engines_release_their_memory_and_take_it_back_before_the_update(engine, model_dir):
    manager = _manager(SimpleNamespace(offload_rollout=True), [engine.url])
    manager._release_engine_memory()
    refused = httpx.post(f"{engine.url}/generate", json={"input_ids": [5], "sampling_params": {}}, timeout=30)
    assert refused.status_code >= 400 and "released" in refused.text  # a released engine does not generate
    manager.update_weights_from_disk(str(model_dir), "12")
    assert _generate(engine.url)["meta_info"]["weight_version"] == "12"


# --------------------------------------------------------------------------- the order of the calls


class _RecordingEngine(BaseHTTPRequestHandler):
    """Answers the weight-update control endpoints as SGLang does and records every request; `/model_info`
    reports the version of the last `/update_weights_from_disk` (or `version`, set by the test)."""

    version = "default"
    calls: list

    def log_message(self, *args):
        pass

    def _send(self, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        assert self.path == "/model_info"
        self.calls.append(("GET", self.path, None))
        self._send({"model_path": "m", "tokenizer_path": "m", "is_generation": True, "weight_version": self.version})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append(("POST", self.path, body))
        if self.path == "/update_weights_from_disk":
            type(self).version = body["weight_version"]
            return self._send({"success": True, "message": "ok"})
        if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
            return self._send(None)
        self._send({"message": "ok", "status": "ok"})


@pytest.fixture
def recording():
    handler = type("Engine", (_RecordingEngine,), {"calls": []})
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    handler.urls = [f"http://127.0.0.1:{server.server_address[1]}" for server in servers]
    yield handler
    for server in servers:
        server.shutdown()
        server.server_close()


def _paths(recording) -> list[str]:
    return [f"{method} {path}" for method, path, _ in recording.calls]


def test_the_recording_engine_answers_only_engine_endpoints():
    paths = {endpoint.path for endpoint in ENGINE_ENDPOINTS}
    assert {"/model_info", "/pause_generation", "/continue_generation", "/update_weights_from_disk"} <= paths
    assert {"/release_memory_occupation", "/resume_memory_occupation"} <= paths


@pytest.mark.parametrize(("partial_rollout", "mode"), [(False, "abort"), (True, "retract")])
def test_a_sent_update_pauses_every_engine_then_checks_the_version_before_continuing(recording, partial_rollout, mode):
    manager = _manager(SimpleNamespace(partial_rollout=partial_rollout), recording.urls)
    assert manager.prepare_weight_update() == recording.urls
    assert recording.calls == [("POST", "/pause_generation", {"mode": mode})] * 2
    recording.version = "3"  # what the engines serve once the ranks sent version 3
    manager.finish_weight_update(3)
    assert _paths(recording)[2:] == ["GET /model_info"] * 2 + ["POST /continue_generation"] * 2
    assert manager.weight_version == 3


def test_a_version_mismatch_leaves_the_engines_paused(recording):
    manager = _manager(SimpleNamespace(), recording.urls)
    manager.prepare_weight_update()
    with pytest.raises(EngineRequestError, match=f"engine {recording.urls[0]} reports 'default'.*expected '4'"):
        manager.finish_weight_update(4)
    assert "POST /continue_generation" not in _paths(recording)


def test_offload_releases_after_each_rollout_and_resumes_before_the_weight_update(recording, monkeypatch):
    manager = _manager(SimpleNamespace(offload_rollout=True), recording.urls, batch_builder=SimpleNamespace())
    monkeypatch.setattr(manager, "_generate", lambda *args: "batch")
    assert manager.generate(0) == "batch"
    assert _paths(recording) == ["POST /release_memory_occupation"] * 2
    assert recording.calls[0][2] == {"tags": None}
    manager.update_weights_from_disk("/weights/weight_v000001", "1")
    assert _paths(recording)[2:] == [
        *["POST /resume_memory_occupation"] * 2,
        *["POST /pause_generation"] * 2,
        *["POST /update_weights_from_disk"] * 2,
        *["GET /model_info"] * 2,
        *["POST /continue_generation"] * 2,
    ]
    recording.calls.clear()
    manager.update_weights_from_disk("/weights/weight_v000002", "2")  # not released since: no resume
    assert "POST /resume_memory_occupation" not in _paths(recording)
    manager.generate(1)
    recording.calls.clear()
    manager.generate(2)  # released engines take their memory back before generating without an update
    assert _paths(recording) == [*["POST /resume_memory_occupation"] * 2, *["POST /release_memory_occupation"] * 2]


def test_without_offload_engines_keep_their_memory(recording, monkeypatch):
    manager = _manager(SimpleNamespace(), recording.urls, batch_builder=SimpleNamespace())
    monkeypatch.setattr(manager, "_generate", lambda *args: "batch")
    manager.generate(0)
    manager.prepare_weight_update()
    assert _paths(recording) == ["POST /pause_generation"] * 2


class _EngineDroppingUpdates(_RecordingEngine):
    """Drops its next `drops[0]` disk updates unanswered (like an engine killed while loading), then answers."""

    drops: list

    def do_POST(self):
        if self.path == "/update_weights_from_disk" and self.drops[0] > 0:
            self.drops[0] -= 1
            self.rfile.read(int(self.headers["Content-Length"]))
            self.close_connection = True
            return
        super().do_POST()


@pytest.mark.parametrize("drops", [1, 2])
def test_an_engine_lost_during_a_disk_update_is_relaunched_and_sent_the_weights_again_once(monkeypatch, drops):
    handler = type("Engine", (_EngineDroppingUpdates,), {"calls": [], "drops": [drops]})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        manager = _manager(SimpleNamespace(), [f"http://127.0.0.1:{server.server_address[1]}"])
        boundary = []
        monkeypatch.setattr(manager, "_check_engines", lambda: boundary.append("check"))
        monkeypatch.setattr(manager, "recover_updatable_engines", lambda: boundary.append("recover"))
        if drops == 2:  # lost again after the relaunch: the error, not a third try
            with pytest.raises(EngineRequestError, match="did not answer POST /update_weights_from_disk"):
                manager.update_weights_from_disk("/weights/weight_v000001", "1")
            assert boundary == ["check", "recover"] * 2 and manager.weight_version == 0
            return
        manager.update_weights_from_disk("/weights/weight_v000001", "1")
        # Health-checked and recovered before the first send and again before the second, then serving version 1.
        assert boundary == ["check", "recover"] * 2 and manager.weight_version == 1
        assert [path for _, path, _ in handler.calls].count("/update_weights_from_disk") == 1
    finally:
        server.shutdown()
        server.server_close()


def test_an_engine_lost_after_loading_is_left_out_and_the_others_go_on(recording, monkeypatch):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    lost = f"http://127.0.0.1:{dead.getsockname()[1]}"
    try:
        manager = _manager(SimpleNamespace(), [recording.urls[0], lost])
        server = manager.servers["model"]
        # The health check finds the lost engine dead: its slot is emptied (`RolloutServer.mark_engine_dead`).
        monkeypatch.setattr(manager, "_check_engines", lambda: server.all_engines.__setitem__(1, None))
        recording.version = "5"
        manager.finish_weight_update(5)
        assert manager.weight_version == 5 and manager.engine_urls() == [recording.urls[0]]
        assert _paths(recording)[-1] == "POST /continue_generation"
    finally:
        dead.close()
