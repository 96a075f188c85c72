"""Engine health: monitors mark dead engines, requests are retried on live ones, dead engines are relaunched."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import pytest

from slime.data.data_source import RolloutDataSourceWithBuffer
from slime.data.refs import DiskPayloadRef
from slime.data.transport import load_rollout_samples
from slime.ray.health_monitor import EngineHealthMonitor, HealthSettings
from slime.ray.serving import RolloutServer, live_urls
from slime.rollout import sglang_rollout
from slime.utils.types import Sample

GOOD_REPLY = {
    "text": "42",
    "output_ids": [5, 6],
    "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 5], [-0.25, 6]]},
}


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class _FakeEngine:
    """An SGLang-protocol stand-in on 127.0.0.1 whose answers a test scripts.

    `/health_generate` answers the statuses in `health_script` first, then `health`, after `health_delay_s`;
    `/v1/loads` reports `running` requests in flight; `generate(count)` returns what the `count`-th `/generate`
    answers: `(status, body_bytes)`.
    """

    def __init__(
        self,
        generate=None,
        health: int = 200,
        health_script: tuple[int, ...] = (),
        health_delay_s: float = 0.0,
        running: int = 0,
    ) -> None:
        self.health = health
        self.health_delay_s = health_delay_s
        self.running = running
        self.health_script = list(health_script)
        self.generate = generate or (lambda count: (200, json.dumps(GOOD_REPLY).encode()))
        self.health_hits = 0
        self.generate_hits = 0
        self.lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes = b"") -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/loads":
                    loads = [{"dp_rank": 0, "num_running_reqs": engine.running, "num_waiting_reqs": 0}]
                    return self._send(200, json.dumps({"loads": loads}).encode())
                if self.path == "/health_generate":
                    time.sleep(engine.health_delay_s)
                    with engine.lock:
                        engine.health_hits += 1
                        status = engine.health_script.pop(0) if engine.health_script else engine.health
                    return self._send(status)
                return self._send(404)

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/abort_request":
                    return self._send(200, b"{}")
                with engine.lock:
                    engine.generate_hits += 1
                    count = engine.generate_hits
                self._send(*engine.generate(count))

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def fake_engines():
    made = []

    def make(**kwargs) -> _FakeEngine:
        made.append(_FakeEngine(**kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def _closed_port_url() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens there once the socket closes


def _rollout_args(tmp_path, urls, **overrides):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"q": f"prompt {i}"}) + "\n" for i in range(8)))
    values = dict(
        prompt_data=str(path),
        input_key="q",
        n_samples_per_prompt=2,
        rollout_batch_size=4,
        over_sampling_batch_size=4,
        rollout_engine_urls=list(urls),
        custom_rm_path=lambda args, sample: 1.0,
        dynamic_sampling_filter_path=None,
        rollout_sample_filter_path=None,
        rollout_all_samples_process_path=None,
        rollout_data_transport="object-store",
        rollout_max_response_len=4,
        rollout_request_retries=3,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def _run_rollout(args):
    source = RolloutDataSourceWithBuffer(args)
    output, aborted = asyncio.run(sglang_rollout.generate_rollout_async(args, 0, source.get_samples))
    assert aborted == []
    return output


# --- bounded retries -------------------------------------------------------------------------------


def test_failing_engine_requests_are_retried_on_the_live_one(tmp_path, fake_engines):
    broken = fake_engines(generate=lambda count: (500, b'{"error": "engine crashed"}'))
    good = fake_engines()
    dead = _closed_port_url()
    output = _run_rollout(_rollout_args(tmp_path, [broken.url, dead, good.url]))
    samples = [sample for group in output.samples for sample in group]
    assert len(output.samples) == 4 and len(samples) == 8
    assert all(s.status == Sample.Status.COMPLETED and s.response == "42" and s.response_length == 2 for s in samples)
    assert all(s.rollout_log_probs == [-0.5, -0.25] and s.loss_mask == [1, 1] for s in samples)
    assert good.generate_hits == 8  # every sample was answered by the good engine, once
    assert broken.generate_hits >= 1  # the broken one was tried, and its 500s were retried elsewhere


def test_retries_are_bounded_and_the_error_names_the_engines(tmp_path, fake_engines):
    malformed = fake_engines(generate=lambda count: (200, b'{"text": "4'))
    args = _rollout_args(tmp_path, [malformed.url], rollout_request_retries=2, n_samples_per_prompt=1)
    with pytest.raises(RuntimeError) as error:
        _run_rollout(args)
    message = str(error.value)
    assert f"Rollout engine {malformed.url}/generate failed 3 time(s)" in message
    assert "--rollout-request-retries 2" in message and "malformed reply" in message
    assert malformed.generate_hits >= 3

    broken = fake_engines(generate=lambda count: (503, b"overloaded"))
    dead = _closed_port_url()
    args = _rollout_args(tmp_path, [broken.url, dead], rollout_request_retries=1, n_samples_per_prompt=1)
    with pytest.raises(RuntimeError, match="failed 2 time") as error:
        _run_rollout(args)
    assert broken.url in str(error.value) and dead in str(error.value)
    assert "ConnectError" in str(error.value) or "answered 503: overloaded" in str(error.value)


def test_a_client_error_is_not_retried(tmp_path, fake_engines):
    refusing = fake_engines(generate=lambda count: (400, b'{"error": {"message": "input too long"}}'))
    args = _rollout_args(
        tmp_path, [refusing.url], n_samples_per_prompt=1, rollout_batch_size=1, over_sampling_batch_size=1
    )
    with pytest.raises(RuntimeError, match=f"{refusing.url}/generate answered 400: .*input too long"):
        _run_rollout(args)
    assert refusing.generate_hits == 1


def test_retried_malformed_replies_publish_each_sample_once(tmp_path, fake_engines):
    def every_other_malformed(count):
        if count % 2:
            return 200, b'{"text": "42", "output_ids": [5, 6], "meta_info": {"output_token_logprobs": [[-0.5]]}}'
        return 200, json.dumps(GOOD_REPLY).encode()

    flaky = fake_engines(generate=every_other_malformed)
    args = _rollout_args(
        tmp_path,
        [flaky.url],
        rollout_data_transport="straw",
        rollout_data_dir=str(tmp_path / "pool"),
        rollout_request_retries=10,  # every other reply is malformed: a sample may need a few tries
    )
    output = sglang_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert isinstance(output.samples, DiskPayloadRef)
    groups = load_rollout_samples(output.samples)
    samples = [sample for group in groups for sample in group]
    assert len(groups) == 4 and len(samples) == 8
    assert len({sample.index for sample in samples}) == 8
    # A malformed reply (log-probs for 1 of 2 tokens) never reached a sample: each holds exactly one answer.
    assert all(s.response == "42" and s.tokens == [5, 6] and s.rollout_log_probs == [-0.5, -0.25] for s in samples)
    assert flaky.generate_hits == 16


# --- the health monitor ----------------------------------------------------------------------------


def test_monitor_marks_an_engine_dead_after_consecutive_failures_only(fake_engines, caplog):
    # Two failures, one success (the count starts again), then failures until the engine is marked dead.
    flapping, steady = fake_engines(health=503, health_script=(503, 503, 200)), fake_engines()
    server = RolloutServer(None, None, [flapping.url, steady.url], ["engine-0", "engine-1"])
    monitor = EngineHealthMonitor(server, HealthSettings(interval_s=0.05, timeout_s=1.0, failure_threshold=3))
    monitor.start()
    try:
        with caplog.at_level(logging.WARNING, logger="slime.ray.health_monitor"):
            monitor.resume()
            _wait_for(lambda: server.all_engines[0] is None, 5, "the engine to be marked dead")
        assert flapping.health_hits == 6  # dead at the third failure in a row, and never probed again
        assert server.all_engines[1] == "engine-1" and steady.health_hits >= 6
        assert f"Rollout engine {flapping.url} (model slot 0) is dead after 3 consecutive" in caplog.text
        assert "/health_generate answered 503" in caplog.text
        assert live_urls(server) == [steady.url]

        monitor.pause()
        hits = steady.health_hits
        time.sleep(0.3)
        assert steady.health_hits == hits  # paused: no checks

        steady.health = 500
        assert monitor.check_once() == [steady.url]  # decisive at the boundary: three probes in a row
        assert steady.health_hits == hits + 3 and server.all_engines == [None, None]
        assert live_urls(server) == []
    finally:
        monitor.stop()


def test_a_slow_health_generation_is_healthy_only_while_the_engine_reports_work(fake_engines):
    from slime.ray.health_monitor import probe_engine

    busy = fake_engines(health_delay_s=0.5, running=3)
    idle = fake_engines(health_delay_s=0.5, running=0)
    assert probe_engine(busy.url, timeout_s=0.2) is None
    reason = probe_engine(idle.url, timeout_s=0.2)
    assert reason is not None and "did not answer within 0.2 s and the engine reports no work" in reason
    assert "answered 503" in probe_engine(fake_engines(health=503).url, timeout_s=1.0)
    assert probe_engine(_closed_port_url(), timeout_s=1.0).startswith("ConnectError")


def test_health_settings_reject_nonpositive_values():
    assert HealthSettings.from_args(SimpleNamespace()) == HealthSettings(5.0, 5.0, 3)
    with pytest.raises(ValueError, match="--rollout-health-check-failures must be positive"):
        HealthSettings.from_args(SimpleNamespace(rollout_health_check_failures=0))
    with pytest.raises(ValueError, match="--rollout-request-retries must be >= 0, got -1"):
        sglang_rollout.GenerateState(SimpleNamespace(rollout_engine_urls=["http://x"], rollout_request_retries=-1))


# --- real CPU engines ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from slime.plugins.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.mark.slow
def test_router_drops_a_dead_worker_and_takes_its_replacement(model_dir, monkeypatch):
    from slime.plugins.cpu_engine_server import EngineServer
    from slime.ray import serving

    monkeypatch.setattr(serving, "check_engines_fit", lambda args, count: None)  # no Ray cluster here
    from slime.ray.router import SGLangRouter, sglang_router_available

    if not sglang_router_available():
        pytest.skip("sglang-router is not installed (pip install 'slime-rl[router]')")
    engines = [EngineServer(str(model_dir), num_threads=1) for _ in range(3)]
    first, second, replacement = engines
    router = SGLangRouter([first.url, second.url])

    def routed() -> set:
        workers = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
        return {worker["url"] for worker in workers if worker.get("is_healthy")}

    server = RolloutServer(None, lambda args, count: [replacement.url], [first.url, second.url], [first, second])
    server.router = router
    try:
        server.mark_engine_dead(1)
        _wait_for(lambda: routed() == {first.url}, 10, "the router to drop the dead worker")
        server.recover()
        assert server.urls == [first.url, replacement.url] and server.num_new_engines == 1
        _wait_for(lambda: routed() == {first.url, replacement.url}, 20, "the router to add the relaunched engine")
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
        for _ in range(4):
            assert httpx.post(f"{router.url}/generate", json=body, timeout=60).status_code == 200
        assert replacement.engine.num_requests >= 1 and second.engine.num_requests == 0
    finally:
        router.close()
        for engine in engines:
            engine.stop()


@pytest.mark.slow
def test_engine_killed_mid_rollout_is_routed_around_and_relaunched(tmp_path, model_dir, caplog):
    import ray

    from slime.ray import rollout
    from slime.ray.serving import ServingCluster

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cluster_args = SimpleNamespace(
            rollout_engine="cpu",
            rollout_num_engines=2,
            rollout_router="none",  # the rollout functions route around the dead engine themselves
            hf_checkpoint=str(model_dir),
            rollout_seed=1,
            rollout_health_check_interval=0.2,
            rollout_health_check_timeout=2.0,
            rollout_health_check_failures=2,
        )
        cluster = ServingCluster.options(num_cpus=0).remote(cluster_args)
        server = ray.get(cluster.health_monitoring_resume.remote())["model"]
        survivor, victim = server.urls
        victim_pid = ray.get(server.all_engines[1].__ray_call__.remote(lambda actor: os.getpid()))
        killed = []

        def kill_victim_after_the_first_sample(args, sample):
            if not killed:
                os.kill(victim_pid, signal.SIGKILL)
                killed.append(time.monotonic())

                def refused():
                    try:
                        httpx.get(f"{victim}/health", timeout=1)
                    except httpx.ConnectError:
                        return True
                    except httpx.TransportError:  # reset while the process goes away
                        return False
                    return False

                _wait_for(refused, 10, "the killed engine to stop listening")
            return 1.0

        args = _rollout_args(
            tmp_path,
            [survivor, victim],
            hf_checkpoint=str(model_dir),
            rollout_batch_size=6,
            over_sampling_batch_size=6,
            sglang_server_concurrency=2,  # so most requests are sent after the kill
            custom_rm_path=kill_victim_after_the_first_sample,
        )
        with caplog.at_level(logging.WARNING, logger="slime.rollout.sglang_rollout"):
            output = _run_rollout(args)
        samples = [sample for group in output.samples for sample in group]
        assert killed and len(output.samples) == 6 and len(samples) == 12
        assert all(s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED) for s in samples)
        assert all(s.response_length > 0 and len(s.rollout_log_probs) == s.response_length for s in samples)
        assert f"Rollout engine {victim} is unreachable" in caplog.text
        served = httpx.get(f"{survivor}/server_info").json()["internal_states"][0]["num_requests"]
        assert served >= 11  # all but (at most) the one the victim finished before it was killed

        # The cluster's monitor marks the engine on its own, before the rollout boundary checks.
        _wait_for(lambda: ray.get(cluster.get_updatable_engines_and_lock.remote())[0][1] is None, 15, "the monitor")
        servers = ray.get(cluster.finish_rollout.remote())
        assert live_urls(servers["model"]) == [survivor]

        # The next weight update relaunches the dead engine first, so it serves the new weights too.
        manager = object.__new__(rollout.RolloutManager.__ray_metadata__.modified_class)
        manager.serving, manager.servers, manager.args = cluster, servers, SimpleNamespace()
        manager.rollout_id, manager.weight_version = 0, 0
        manager.update_weights_from_disk(str(model_dir), "1")
        engines, _, num_new_engines = ray.get(cluster.get_updatable_engines_and_lock.remote())
        relaunched = manager.engine_urls()[1]
        assert None not in engines and num_new_engines == 0
        assert manager.engine_urls()[0] == survivor and relaunched not in (survivor, victim)
        assert manager.args.rollout_engine_urls == [survivor, relaunched]
        for url in (survivor, relaunched):
            assert httpx.get(f"{url}/get_weight_version").json()["weight_version"] == "1"

        manager.health_monitoring_resume()
        args = _rollout_args(
            tmp_path,
            manager.engine_urls(),
            hf_checkpoint=str(model_dir),
            rollout_batch_size=2,
            over_sampling_batch_size=2,
        )
        samples = [sample for group in _run_rollout(args).samples for sample in group]
        assert len(samples) == 4 and all(s.weight_versions == ["1"] for s in samples)
        assert httpx.get(f"{relaunched}/server_info").json()["internal_states"][0]["num_requests"] >= 1
        assert live_urls(ray.get(cluster.finish_rollout.remote())["model"]) == [survivor, relaunched]
        ray.get(cluster.dispose.remote())
    finally:
        ray.shutdown()
