"""The built-in CPU engine: tiny model checkpoint, SGLang HTTP protocol, batching, weight reloads, sglang-router."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from slime.plugins.tiny_model import MARKER_FILE, ensure_tiny_model, is_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir):
    from slime.plugins.cpu_engine_server import EngineServer

    engine = EngineServer(str(model_dir), seed=7, num_threads=1)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


def generate(client, **body):
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def greedy(client, input_ids, n=6, **params):
    return generate(client, input_ids=input_ids, sampling_params={"max_new_tokens": n, "temperature": 0, **params})


# --- the tiny model -------------------------------------------------------------------------------


def test_tiny_model_is_a_real_hf_checkpoint(model_dir):
    from transformers import AutoConfig, AutoTokenizer

    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER_FILE} <= names
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("Hello 12+3=?")["input_ids"]
    assert len(ids) == len("Hello 12+3=?")
    assert tokenizer.decode(ids) == "hello 12+3=?"
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == "hello 12+3=?"
    assert AutoConfig.from_pretrained(model_dir).vocab_size == len(tokenizer)
    assert not [p for p in model_dir.parent.iterdir() if ".building-" in p.name]


def test_ensure_tiny_model_is_idempotent_and_refuses_foreign_directories(model_dir, tmp_path):
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(model_dir) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before

    half_built = tmp_path / "half"
    half_built.mkdir()
    (half_built / "config.json").write_text("{}")
    assert not is_tiny_model_dir(half_built)
    with pytest.raises(FileExistsError, match="not a slime tiny model"):
        ensure_tiny_model(half_built)
    assert sorted(p.name for p in half_built.iterdir()) == ["config.json"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert ensure_tiny_model(empty) == empty and is_tiny_model_dir(empty)


def test_tiny_model_build_is_deterministic(model_dir, tmp_path):
    other = ensure_tiny_model(tmp_path / "again")
    assert (other / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_concurrent_builders_publish_one_complete_directory(tmp_path):
    target = tmp_path / "raced"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: ensure_tiny_model(target), range(2)))
    assert results == [target, target] and is_tiny_model_dir(target)
    assert [p.name for p in tmp_path.iterdir()] == ["raced"]


# --- the protocol -----------------------------------------------------------------------------------


def test_generate_from_input_ids_with_logprobs(client):
    out = generate(client, input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 5}, return_logprob=True)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 3
    assert meta["completion_tokens"] == len(out["output_ids"]) <= 5
    assert meta["weight_version"] == "default"
    assert meta["finish_reason"]["type"] in ("length", "stop")
    logprobs = meta["output_token_logprobs"]
    assert [token for _, token, _ in logprobs] == out["output_ids"]
    assert all(lp <= 0 and extra is None for lp, _, extra in logprobs)
    assert (
        "output_token_logprobs"
        not in generate(client, input_ids=[5], sampling_params={"max_new_tokens": 2})["meta_info"]
    )


def test_generate_from_text_and_batches(client):
    from transformers import AutoTokenizer

    out = generate(client, text="12+3=", sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert out["meta_info"]["prompt_tokens"] == 5
    tokenizer = AutoTokenizer.from_pretrained(client.get("/model_info").json()["tokenizer_path"])
    assert out == {**greedy(client, tokenizer("12+3=")["input_ids"], 4), "meta_info": out["meta_info"]}

    batch = generate(client, input_ids=[[5, 6], [7, 8, 9]], sampling_params={"max_new_tokens": 3})
    assert isinstance(batch, list) and [b["meta_info"]["prompt_tokens"] for b in batch] == [2, 3]
    texts = generate(client, text=["ab", "c"], sampling_params=[{"max_new_tokens": 1}, {"max_new_tokens": 2}])
    assert [t["meta_info"]["completion_tokens"] <= n for t, n in zip(texts, [1, 2], strict=True)] == [True, True]


def test_sampling_is_reproducible_with_a_seed(client):
    params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    first = generate(client, input_ids=[9, 10], sampling_params={**params, "sampling_seed": 3})
    again = generate(client, input_ids=[9, 10], sampling_params={**params, "sampling_seed": 3})
    other = generate(client, input_ids=[9, 10], sampling_params={**params, "sampling_seed": 4})
    assert first["output_ids"] == again["output_ids"]
    assert first["output_ids"] != other["output_ids"]
    top1 = generate(client, input_ids=[9, 10], sampling_params={**params, "top_k": 1})
    assert top1["output_ids"] == greedy(client, [9, 10], 12, ignore_eos=True)["output_ids"]


def test_finish_reasons_stop_tokens_and_trimming(client):
    base = greedy(client, [11, 12], 6, ignore_eos=True)
    assert base["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    first = base["output_ids"][0]

    stopped = greedy(client, [11, 12], 6, stop_token_ids=[first])
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert stopped["output_ids"] == [first] and stopped["text"] == ""
    untrimmed = greedy(client, [11, 12], 6, stop_token_ids=[first], no_stop_trim=True)
    assert untrimmed["text"] == base["text"][:1]

    stop_text = base["text"][:2]
    by_string = greedy(client, [11, 12], 6, stop=[stop_text, "never matched"])
    assert by_string["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_text}
    assert by_string["output_ids"] == base["output_ids"][:2] and by_string["text"] == ""
    assert greedy(client, [11, 12], 6, stop=stop_text, no_stop_trim=True)["text"] == stop_text

    held = greedy(client, [11, 12], 3, stop_token_ids=[first], min_new_tokens=2)
    assert held["output_ids"][0] != first and len(held["output_ids"]) >= 2
    assert greedy(client, [11], 0)["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_concurrent_requests_are_batched(server, client):
    before = client.get("/server_info").json()["internal_states"][0]
    count = 12
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        outs = list(
            pool.map(
                lambda i: generate(client, input_ids=[5 + i, 6], sampling_params={"max_new_tokens": 8 + i}),
                range(count),
            )
        )
    after = client.get("/server_info").json()["internal_states"][0]
    assert after["num_requests"] - before["num_requests"] == count
    assert after["num_batches"] - before["num_batches"] < count
    assert all(o["meta_info"]["completion_tokens"] <= 8 + i for i, o in enumerate(outs))


def test_batch_per_request_runs_each_requests_inputs_alone_and_reproducibly(model_dir):
    """`batch_per_request` (the engine under --deterministic): one body's inputs form the batches, in chunks of
    `max_batch_size`, never joined by another body's; so a body's answer is the same with or without traffic."""
    from slime.plugins.cpu_engine_server import EngineServer

    group = {
        "input_ids": [[5, 6, 7]] * 4,
        "sampling_params": [{"max_new_tokens": 6, "sampling_seed": seed} for seed in range(4)],
        "return_logprob": True,
    }
    other = {"input_ids": [9, 10], "sampling_params": {"max_new_tokens": 12}}
    engine = EngineServer(str(model_dir), seed=7, num_threads=1, max_batch_size=3, batch_per_request=True)
    try:
        with httpx.Client(base_url=engine.url, timeout=60) as http:
            alone = generate(http, **group)
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                others = [pool.submit(generate, http, **other) for _ in range(5)]
                busy = generate(http, **group)
                assert all(len(future.result()["output_ids"]) > 0 for future in others)
            info = http.get("/server_info").json()
        assert info["batch_per_request"] is True
        assert [answer["output_ids"] for answer in busy] == [answer["output_ids"] for answer in alone]
        logprobs = [answer["meta_info"]["output_token_logprobs"] for answer in alone]
        assert [answer["meta_info"]["output_token_logprobs"] for answer in busy] == logprobs
        # Each group: a chunk of 3 and one of 1; each lone input: a batch of its own.
        assert info["internal_states"][0] == {"num_batches": 2 * 2 + 5, "num_requests": 2 * 4 + 5}
    finally:
        engine.stop()


def test_health_info_and_cache_endpoints(server, client, model_dir):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    assert client.get("/model_info").json() == {
        "model_path": str(model_dir),
        "tokenizer_path": str(model_dir),
        "is_generation": True,
        "weight_version": client.get("/get_weight_version").json()["weight_version"],
    }
    info = client.get("/server_info").json()
    assert info["model_path"] == str(model_dir) and info["random_seed"] == 7
    assert client.post("/flush_cache").status_code == 200


def test_abort_running_request(client):
    result = {}

    def long_request():
        result["out"] = generate(
            client, input_ids=[5], sampling_params={"max_new_tokens": 3000, "ignore_eos": True}, rid="long-one"
        )

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(0.4)
    assert client.post("/abort_request", json={"rid": "long-one"}).json() == {"success": True, "aborted": 1}
    worker.join(timeout=30)
    meta = result["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["completion_tokens"] < 3000
    assert client.post("/abort_request", json={}).status_code == 400


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [1], "text": "a"}, "exactly one of"),
        ({}, "exactly one of"),
        ({"input_ids": []}, "non-empty list"),
        ({"input_ids": [1, 10_000]}, "token ids must be integers in [0,"),
        ({"input_ids": [1, "a"]}, "token ids must be integers"),
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 1.0}}, "unsupported sampling_params"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature must be >= 0"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "3"}}, "max_new_tokens must be int"),
        ({"input_ids": [1], "stream": True}, "does not support ['stream']"),
        ({"input_ids": [1], "frobnicate": 1}, "unsupported /generate fields ['frobnicate']"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "list of 1 entries but the batch has 2"),
        ({"input_ids": [1] * 5000}, "context length is 4096"),
    ],
)
def test_bad_generate_input_is_rejected_clearly(client, body, message):
    response = client.post("/generate", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_invalid_json_is_rejected(client):
    response = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_weight_update_from_disk_changes_outputs_and_version(model_dir, tmp_path):
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from slime.plugins.cpu_engine_server import EngineServer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    updated = tmp_path / "weight_v000001"
    model.save_pretrained(updated)

    engine = EngineServer(str(model_dir), num_threads=1)
    try:
        with httpx.Client(base_url=engine.url, timeout=60) as http:
            prompt = [5, 6, 7, 8]
            before = greedy(http, prompt, 16, ignore_eos=True)
            answer = http.post("/update_weights_from_disk", json={"model_path": str(updated), "weight_version": "1"})
            assert answer.status_code == 200 and answer.json()["success"] is True
            after = greedy(http, prompt, 16, ignore_eos=True)
            assert after["output_ids"] != before["output_ids"]
            assert after["meta_info"]["weight_version"] == "1"
            assert http.get("/get_weight_version").json() == {"weight_version": "1"}
            assert http.get("/model_info").json()["model_path"] == str(updated)

            broken = tmp_path / "broken"
            broken.mkdir()
            (broken / "model.safetensors").write_bytes(b"garbage")
            failed = http.post("/update_weights_from_disk", json={"model_path": str(broken), "weight_version": "2"})
            assert failed.status_code == 400 and failed.json()["success"] is False
            assert "cannot read weights" in failed.json()["message"]
            foreign = tmp_path / "foreign"
            foreign.mkdir()
            save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(foreign / "model.safetensors"))
            mismatch = http.post("/update_weights_from_disk", json={"model_path": str(foreign)})
            assert mismatch.status_code == 400 and "do not match the served model" in mismatch.json()["message"]
            empty = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
            assert empty.status_code == 400 and "no *.safetensors" in empty.json()["message"]
            assert greedy(http, prompt, 16, ignore_eos=True)["output_ids"] == after["output_ids"]
            assert http.get("/get_weight_version").json() == {"weight_version": "1"}

            back = http.post("/update_weights_from_disk", json={"model_path": str(model_dir), "weight_version": "2"})
            assert back.json()["success"] is True
            assert greedy(http, prompt, 16, ignore_eos=True)["output_ids"] == before["output_ids"]
            bumped = http.post("/update_weight_version", json={"new_version": "3"})
            assert bumped.json()["success"] is True
            assert greedy(http, prompt, 1)["meta_info"]["weight_version"] == "3"
    finally:
        engine.stop()


def test_plugin_registers_the_cpu_engine():
    from slime.plugin_manager import registry_for
    from slime.plugins.cpu_engine import launch_cpu_engines

    assert registry_for(SimpleNamespace()).get("rollout_engines", "cpu").target is launch_cpu_engines


@pytest.mark.slow
def test_sglang_router_in_front_of_two_engines(model_dir, server):
    from slime.plugins.cpu_engine_server import EngineServer
    from slime.ray.router import SGLangRouter, sglang_router_available

    if not sglang_router_available():
        pytest.skip("sglang-router is not installed (pip install 'slime-rl[router]')")
    second = EngineServer(str(model_dir), num_threads=1)
    router = SGLangRouter([server.url, second.url])
    try:
        with httpx.Client(base_url=router.url, timeout=60) as http:
            outs = [
                generate(http, input_ids=[5, 6], sampling_params={"max_new_tokens": 3}, return_logprob=True)
                for _ in range(4)
            ]
            text = generate(http, text="1+1=", sampling_params={"max_new_tokens": 2, "temperature": 0})
            # A batched body goes to one engine and gets a list back; the router takes one sampling_params for it.
            batch = generate(http, input_ids=[[5, 6], [5, 6]], sampling_params={"max_new_tokens": 2})
        assert isinstance(batch, list) and len(batch) == 2
        assert all(len(o["meta_info"]["output_token_logprobs"]) == len(o["output_ids"]) for o in outs)
        assert text["meta_info"]["prompt_tokens"] == 4
        assert second.engine.num_requests >= 2
        assert router.routed_requests() == 6
    finally:
        router.close()
        second.stop()


@pytest.mark.slow
def test_launch_cpu_engines_on_ray(model_dir):
    import ray

    from slime.plugins.cpu_engine import launch_cpu_engines

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        urls = launch_cpu_engines(SimpleNamespace(hf_checkpoint=str(model_dir), rollout_seed=1), 2)
        assert len(urls) == 2 and len(set(urls)) == 2
        for url in urls:
            out = httpx.post(f"{url}/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})
            assert out.status_code == 200 and out.json()["meta_info"]["prompt_tokens"] == 1
        assert httpx.get(f"{urls[0]}/server_info").json()["random_seed"] == 1
        urls.shutdown()
    finally:
        ray.shutdown()
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        launch_cpu_engines(SimpleNamespace(hf_checkpoint=str(model_dir.parent / "nope")), 1)
