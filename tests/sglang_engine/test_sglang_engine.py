"""The SGLang engine plugin against real SGLang 0.5.19 servers on CPU: launch, generation with log-probs,
rollout control (pause/continue, abort, memory release), the router, health-monitor relaunch, and bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time

import httpx
import psutil
import pytest

pytestmark = pytest.mark.sglang

#: ~15 s of decoding for the tiny model on SGLang's CPU path (~20 tokens/s for one request).
LONG = {"temperature": 1.0, "max_new_tokens": 300, "ignore_eos": True}


def _generate(url: str, sampling: dict, timeout: float = 120.0, **extra) -> dict:
    response = httpx.post(
        f"{url}/generate", json={"text": "1+2=", "sampling_params": sampling, **extra}, timeout=timeout
    )
    assert response.status_code == 200, response.text
    return response.json()


def _in_background(function, *args, **kwargs) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run():
        try:
            result["value"] = function(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _wait_running(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loads = httpx.get(f"{url}/v1/loads", timeout=10).json()["loads"]
        if sum(load["num_running_reqs"] for load in loads):
            return
        time.sleep(0.05)
    raise AssertionError(f"no request started running on {url}")


def _router_workers(router_url: str, timeout: float = 30.0) -> list[str]:
    """The router's workers once its asynchronous registration settled (sglang-router adds them in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        urls = sorted(worker["url"] for worker in httpx.get(f"{router_url}/workers", timeout=10).json()["workers"])
        if urls or time.monotonic() > deadline:
            return urls
        time.sleep(0.2)


def _server_processes(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(processes: list[psutil.Process]) -> list[int]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_engines_generate_with_log_probs_and_report_their_weight_version(two_engines):
    for url in two_engines:
        reply = _generate(url, {"temperature": 1.0, "max_new_tokens": 12}, return_logprob=True, logprob_start_len=0)
        meta = reply["meta_info"]
        assert len(meta["output_token_logprobs"]) == len(reply["output_ids"]) > 0
        assert [token for _, token, _ in meta["output_token_logprobs"]] == reply["output_ids"]
        assert all(logprob <= 0.0 for logprob, _, _ in meta["output_token_logprobs"])
        assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
        assert meta["weight_version"] == "default"
        info = httpx.get(f"{url}/model_info", timeout=10).json()
        assert info["weight_version"] == "default" and info["is_generation"] is True
        assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200


def test_pause_retract_keeps_generations_that_finish_after_continue(two_engines):
    url = two_engines[0]
    thread, result = _in_background(_generate, url, LONG)
    _wait_running(url)
    assert httpx.post(f"{url}/pause_generation", json={"mode": "retract"}, timeout=30).status_code == 200
    thread.join(timeout=2.0)
    assert thread.is_alive(), "a retracted generation must wait for /continue_generation"
    assert httpx.post(f"{url}/continue_generation", json={}, timeout=30).status_code == 200
    thread.join(timeout=120)
    assert result["value"]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(result["value"]["output_ids"]) == LONG["max_new_tokens"]


def test_pause_abort_and_abort_request_end_running_generations(two_engines):
    url = two_engines[1]
    for stop in (
        lambda: httpx.post(f"{url}/pause_generation", json={"mode": "abort"}, timeout=30),
        lambda: httpx.post(f"{url}/abort_request", json={"abort_all": True}, timeout=30),
    ):
        thread, result = _in_background(_generate, url, LONG)
        _wait_running(url)
        assert stop().status_code == 200
        thread.join(timeout=60)
        assert result["value"]["meta_info"]["finish_reason"]["type"] == "abort"
        httpx.post(f"{url}/continue_generation", json={}, timeout=30).raise_for_status()
    assert _generate(url, {"max_new_tokens": 4})["meta_info"]["finish_reason"]["type"] in ("length", "stop")


def test_memory_release_and_resume_keep_the_engine_serving(two_engines):
    url = two_engines[0]
    greedy = {"temperature": 0.0, "max_new_tokens": 8}
    before = _generate(url, greedy)["output_ids"]
    assert httpx.post(f"{url}/release_memory_occupation", json={}, timeout=60).status_code == 200
    assert httpx.post(f"{url}/resume_memory_occupation", json={}, timeout=60).status_code == 200
    assert _generate(url, greedy)["output_ids"] == before


def test_router_spreads_requests_over_both_engines(two_engines, tmp_path):
    from slime.ray.router import SGLangRouter

    router = SGLangRouter(list(two_engines), log_path=tmp_path / "router.log")
    try:
        assert _router_workers(router.url) == sorted(two_engines)
        replies = [_generate(router.url, {"max_new_tokens": 4}) for _ in range(4)]
        assert all(reply["output_ids"] for reply in replies)
    finally:
        router.close()


def test_a_killed_server_is_marked_dead_relaunched_and_rerouted(ray_local, tiny_model, tmp_path, engine_args):
    import ray

    from slime.plugins.sglang_engine import _launch
    from slime.ray.health_monitor import EngineHealthMonitor, HealthSettings
    from slime.ray.router import SGLangRouter
    from slime.ray.serving import RolloutServer

    server = RolloutServer.launch(engine_args(tiny_model, tmp_path), _launch, 1, "sglang")
    try:
        server.router = SGLangRouter(server.urls, log_path=tmp_path / "router.log")
        old_url, old_actor = server.urls[0], server.all_engines[0]
        old_processes = _server_processes(ray.get(old_actor.pid.remote()))
        assert len(old_processes) >= 2  # the server and SGLang's scheduler/detokenizer processes
        os.kill(old_processes[0].pid, signal.SIGKILL)  # the engine crashes (its actor lives on)

        monitor = EngineHealthMonitor(server, HealthSettings(interval_s=1.0, timeout_s=5.0, failure_threshold=2))
        assert monitor.check_once() == [old_url]
        assert server.all_engines == [None]
        server.recover()
        new_url = server.urls[0]
        assert new_url != old_url and server.all_engines[0] is not None
        assert _router_workers(server.router.url) == [new_url]
        assert _generate(server.router.url, {"max_new_tokens": 4})["output_ids"]
        time.sleep(2.0)
        assert _alive(old_processes) == [], "the crashed engine's SGLang processes must all be gone"
    finally:
        server.shutdown()


def test_a_model_sglang_cannot_load_is_reported_with_the_command_and_log_tail(
    ray_local, tiny_model, tmp_path, engine_args
):
    from slime.plugins.sglang_engine.launcher import EngineStartError, launch_sglang_engines

    model = tmp_path / "unsupported-model"  # a complete checkpoint of an architecture SGLang does not know
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchArchitectureForCausalLM"]}))
    args = engine_args(model, tmp_path, sglang_engine_startup_timeout=180.0)
    with pytest.raises(EngineStartError) as caught:
        launch_sglang_engines(args, 1)
    message = str(caught.value)
    assert "SGLang engine 1/1 exited with status" in message
    assert f"--model-path {model}" in message and "sglang.launch_server" in message
    assert "last lines of its log" in message and "NoSuchArchitectureForCausalLM" in message


def test_an_engine_that_never_becomes_healthy_is_reported_and_stopped(tiny_model, tmp_path, engine_args):
    from slime.plugins.sglang_engine.launcher import EngineStartError, SGLangEngineActor, server_command
    from slime.plugins.sglang_engine.settings import SGLangEngineSettings

    settings = SGLangEngineSettings.from_args(engine_args(tiny_model, tmp_path))
    actor = SGLangEngineActor(
        server_command(settings, str(tiny_model), 0, 1, on_cpu=True), str(tmp_path / "e.log"), "E"
    )
    with pytest.raises(EngineStartError, match=r"did not answer /health_generate within 3 s") as caught:
        actor.start(timeout_s=3.0, port_attempts=1)
    assert "--sglang-engine-startup-timeout" in str(caught.value) and "command: " in str(caught.value)
    assert actor.pid() is None


def test_a_port_taken_before_the_server_binds_it_is_retried_on_another(tiny_model, tmp_path, monkeypatch, engine_args):
    from slime.plugins.sglang_engine import launcher
    from slime.plugins.sglang_engine.settings import SGLangEngineSettings

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real_free_port = launcher._free_port
    monkeypatch.setattr(launcher, "_free_port", lambda: next(ports, None) or real_free_port())
    settings = SGLangEngineSettings.from_args(engine_args(tiny_model, tmp_path))
    log = tmp_path / "e.log"
    actor = launcher.SGLangEngineActor(launcher.server_command(settings, str(tiny_model), 0, 1, True), str(log), "E")
    try:
        url = actor.start(timeout_s=240.0, port_attempts=2)
        assert url != f"http://127.0.0.1:{taken.getsockname()[1]}"
        assert "address already in use" in log.read_text().lower()
        assert _generate(url, {"max_new_tokens": 2})["output_ids"]
    finally:
        actor.stop()
        taken.close()


def test_sglang_options_are_checked_by_sglangs_parser_when_the_run_is_parsed(capsys):
    from slime.utils.arguments import parse_args

    args = parse_args(["--rollout-engine", "sglang", "--sglang-tp-size", "1", "--sglang-disable-radix-cache"])
    assert args.sglang_server_args == ["--tp-size", "1", "--disable-radix-cache"]
    for argv, expected in (
        (["--sglang-tp-size", "two"], "SGLang's parser refused --sglang-tp-size two: argument --tp-size"),
        (["--sglang-tp-sise", "2"], "--sglang-tp-sise: did you mean --sglang-tp-size?"),
        (["--sglang-host", "0.0.0.0"], "SGLang engines listen on 127.0.0.1 only"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--rollout-engine", "sglang", *argv])
        error = capsys.readouterr().err
        assert "slime-run: error:" in error and expected in error and "Traceback" not in error
    from slime.plugin_manager import PluginSelection, build_plugin_manager
    from slime.utils.arguments import build_parser

    help_text = build_parser(build_plugin_manager(PluginSelection())).format_help()
    assert help_text.count("\n  --sglang-") > 400  # every SGLang server option, under the plugin's group
    assert "--sglang-mem-fraction-static" in help_text and "(SGLang 0.5.19)" in help_text
