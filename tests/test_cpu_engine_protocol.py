"""The CPU engine's SGLang control and weight-update protocol: pausing, loads, memory release and the weight
transfers (torch.distributed broadcast in both load formats, tensors through shared memory).

The trainer side is played here, the way a trainer talks to a real SGLang 0.5.19 server: `TrainerGroup` and
`serialize_named_tensors` use only torch and HTTP, and `python tests/test_cpu_engine_protocol.py URL` runs the
same exchange against any server (a real SGLang one included).
"""

from __future__ import annotations

import base64
import concurrent.futures
import datetime
import io
import pickle
import socket
import sys
import time

import httpx
import pytest
import torch

from slime.plugins.tiny_model import ensure_tiny_model

GROUP_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
def server(model_dir):
    """A fresh engine per test: these tests change weights, versions and pause state."""
    from slime.plugins.cpu_engine_server import EngineServer

    engine = EngineServer(str(model_dir), seed=3, num_threads=1, weights_group_timeout_s=GROUP_TIMEOUT_S)
    yield engine
    engine.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def shared_client(model_dir):
    """One engine for the tests that only check answers to bad input (they change nothing)."""
    from slime.plugins.cpu_engine_server import EngineServer

    engine = EngineServer(str(model_dir), num_threads=1)
    with httpx.Client(base_url=engine.url, timeout=60) as http:
        yield http
    engine.stop()


def greedy(http, prompt, n=12):
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def in_background(url, path, body, timeout=120):
    """POST from another thread; `.result()` is the response."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(httpx.post, f"{url}{path}", json=body, timeout=timeout)
    pool.shutdown(wait=False)
    return future


def wait_for(condition, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def loads(http):
    return http.get("/v1/loads").json()["loads"][0]


def long_request(url, n=150, prompt=(5, 6, 7), rid=None):
    body = {"input_ids": list(prompt), "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    if rid:
        body["rid"] = rid
    return in_background(url, "/generate", body)


def perturbed(server, seed, scale=0.5):
    """The served parameters (Hugging Face names, tied ones once) plus seeded noise."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: p.detach() + torch.randn(p.shape, generator=generator) * scale
        for name, p in server.engine.model.named_parameters()
    }


def served(server):
    return {name: p.detach().clone() for name, p in server.engine.model.named_parameters()}


# --- the trainer side (torch + HTTP only; also run against a real SGLang server) ----------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TrainerGroup:
    """Rank 0 of a weight update group with one engine (world size 2), as SGLang's engine expects to meet it.

    The engine joins through a TCPStore client and SGLang's store layout with backend gloo:
    PrefixStore("cpu/", PrefixStore(f"{group}/", PrefixStore(group, store))). The trainer is the TCPStore
    master; the master waits for the engine's client in its constructor, so `/init_weights_update_group` is
    posted first, from another thread.
    """

    def __init__(self, url: str, group_name: str = "weight_update_group", timeout_s: float = GROUP_TIMEOUT_S) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        self.url, self.group_name = url, group_name
        port = free_port()
        body = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": group_name,
            "backend": "gloo",
        }
        answer = in_background(url, "/init_weights_update_group", body)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timeout)
        store = PrefixStore("cpu/", PrefixStore(f"{group_name}/", PrefixStore(group_name, self.store)))
        self.group = ProcessGroupGloo(store, 0, 2, timeout)
        self.init_response = answer.result()

    def send(self, named: dict[str, torch.Tensor], load_format: str | None = None, weight_version: str | None = None):
        """Broadcast `named` while `/update_weights_from_distributed` is in flight; returns its response."""
        tensors = [t.detach().contiguous() for t in named.values()]
        body = {
            "names": list(named),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": self.group_name,
            "flush_cache": True,
            "weight_version": weight_version,
            "load_format": load_format,
        }
        answer = in_background(self.url, "/update_weights_from_distributed", body)
        if load_format == "flattened_bucket":
            self.group.broadcast(torch.cat([t.flatten().view(torch.uint8) for t in tensors]), 0).wait()
        else:
            for tensor in tensors:
                self.group.broadcast(tensor, 0).wait()
        return answer.result()

    def destroy(self):
        response = httpx.post(f"{self.url}/destroy_weights_update_group", json={"group_name": self.group_name})
        self.group.shutdown()
        return response


def serialize_named_tensors(named: dict[str, torch.Tensor]) -> str:
    """One `serialized_named_tensors` entry: base64 of a ForkingPickler dump of [(name, tensor), ...].

    Needs torch.multiprocessing's "file_system" sharing strategy (`sharing_file_system`); keep `named` alive
    until the request returns.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions with ForkingPickler

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(list(named.items()))
    return base64.b64encode(buffer.getvalue()).decode()


class sharing_file_system:  # noqa: N801 - used like a function
    """torch.multiprocessing's sharing strategy set to "file_system" for the block (it is process-wide)."""

    def __enter__(self):
        self.previous = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")

    def __exit__(self, *exc):
        torch.multiprocessing.set_sharing_strategy(self.previous)


def post_tensors(url, named, weight_version=None):
    with sharing_file_system():
        entry = serialize_named_tensors(named)
        body = {"serialized_named_tensors": [entry], "load_format": None, "flush_cache": True}
        return httpx.post(f"{url}/update_weights_from_tensor", json={**body, "weight_version": weight_version})


# --- info and loads ---------------------------------------------------------------------------------------------


def test_model_info_server_info_and_loads(client):
    info = client.get("/model_info").json()
    assert info["weight_version"] == "default" and info["is_generation"] is True
    assert client.get("/get_weight_version").json() == {"weight_version": "default"}  # kept until slime moves
    server_info = client.get("/server_info").json()
    assert server_info["tp_size"] == 1 and server_info["dp_size"] == 1
    answer = client.get("/v1/loads").json()
    assert answer["loads"] == [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "token_usage": 0.0}]


def test_loads_count_running_and_waiting_requests(server, client):
    running = long_request(server.url)
    wait_for(lambda: loads(client)["num_running_reqs"] == 1, what="a running request")
    assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    queued = long_request(server.url, n=3, prompt=(9,))
    wait_for(lambda: loads(client)["num_waiting_reqs"] == 1, what="a waiting request")
    assert loads(client) == {"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 1, "token_usage": 0.0}
    assert client.post("/continue_generation", json={}).json() == {
        "message": "Generation continued successfully.",
        "status": "ok",
    }
    assert running.result().json()["meta_info"]["finish_reason"]["type"] == "length"
    assert queued.result().json()["meta_info"]["finish_reason"]["type"] == "length"
    assert loads(client)["num_running_reqs"] == loads(client)["num_waiting_reqs"] == 0


# --- pause and continue -----------------------------------------------------------------------------------------


def test_pause_abort_ends_requests_and_holds_new_ones(server, client):
    running = long_request(server.url, n=3000)
    wait_for(lambda: loads(client)["num_running_reqs"] == 1, what="a running request")
    paused = client.post("/pause_generation", json={"mode": "abort"})
    assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
    meta = running.result(timeout=10).json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 3000

    held = long_request(server.url, n=4)
    wait_for(lambda: loads(client)["num_waiting_reqs"] == 1, what="the held request")
    time.sleep(0.2)
    assert not held.done()
    assert client.get("/health_generate").status_code == 200  # answers without generating while paused
    assert client.post("/continue_generation").status_code == 200
    assert held.result(timeout=30).json()["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    # A pause without a body is SGLang's default mode, abort.
    assert client.post("/pause_generation").status_code == 200 and server.engine.gate.mode == "abort"
    client.post("/continue_generation", json={})


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_paused_requests_continue_where_they_stopped(server, client, mode):
    baseline = greedy(client, [5, 6, 7], 150)
    running = long_request(server.url)
    wait_for(lambda: loads(client)["num_running_reqs"] == 1, what="a running request")
    assert client.post("/pause_generation", json={"mode": mode}).status_code == 200
    assert server.engine.gate.held == 1  # the batch stopped between two decode steps
    time.sleep(0.3)
    assert not running.done()
    assert client.post("/continue_generation", json={}).status_code == 200
    resumed = running.result(timeout=60).json()
    assert resumed["output_ids"] == baseline["output_ids"]
    assert resumed["meta_info"]["finish_reason"] == {"type": "length", "length": 150}


def test_weights_update_while_paused_and_the_paused_request_finishes_with_them(server, client, tmp_path):
    from safetensors.torch import save_file

    new = perturbed(server, seed=1)
    save_file(new, str(tmp_path / "model.safetensors"))
    running = long_request(server.url)
    wait_for(lambda: loads(client)["num_running_reqs"] == 1, what="a running request")
    assert client.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    update = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "7"})
    assert update.status_code == 200 and update.json()["success"] is True
    assert update.json()["message"].endswith("Weight version updated to 7.")
    assert not running.done()
    client.post("/continue_generation", json={})
    assert running.result(timeout=60).json()["meta_info"]["weight_version"] == "7"
    assert torch.equal(served(server)["model.layers.0.mlp.up_proj.weight"], new["model.layers.0.mlp.up_proj.weight"])


def test_abort_request_ends_a_paused_request(server, client):
    running = long_request(server.url, rid="held-one")
    wait_for(lambda: loads(client)["num_running_reqs"] == 1, what="a running request")
    client.post("/pause_generation", json={"mode": "in_place"})
    assert client.post("/abort_request", json={"rid": "held-one"}).json()["aborted"] == 1
    assert running.result(timeout=10).json()["meta_info"]["finish_reason"]["type"] == "abort"
    client.post("/continue_generation", json={})


# --- weight version ---------------------------------------------------------------------------------------------


def test_update_weight_version_aborts_running_requests_by_default(server, client):
    running = long_request(server.url, n=3000)
    wait_for(lambda: loads(client)["num_running_reqs"] == 1, what="a running request")
    answer = client.post("/update_weight_version", json={"new_version": "12"})
    assert answer.json() == {"success": True, "message": "Weight version updated to 12", "new_version": "12"}
    assert running.result(timeout=10).json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert client.get("/model_info").json()["weight_version"] == "12"
    kept = long_request(server.url, n=20)
    client.post("/update_weight_version", json={"new_version": "13", "abort_all_requests": False})
    assert kept.result(timeout=30).json()["meta_info"]["finish_reason"]["type"] == "length"


# --- memory release -----------------------------------------------------------------------------------------------


def test_release_frees_the_weights_and_resume_restores_them(server, client):
    before = greedy(client, [4, 5, 6])
    params = served(server)
    assert client.post("/release_memory_occupation", json={"tags": None}).status_code == 200
    assert client.post("/release_memory_occupation", json={}).status_code == 200  # already released: no change
    assert sum(p.numel() for p in server.engine.model.parameters()) == 0
    refused = client.post("/generate", json={"input_ids": [4], "sampling_params": {"max_new_tokens": 2}})
    assert refused.status_code == 400 and "weights are released" in refused.json()["error"]["message"]
    assert client.get("/health_generate").status_code == 200
    update = client.post("/update_weights_from_disk", json={"model_path": server.engine.model_path})
    assert update.status_code == 400 and "weights are released" in update.json()["message"]

    resumed = client.post("/resume_memory_occupation", json={"tags": ["kv_cache", "weights"]})
    assert resumed.status_code == 200 and resumed.json() is None
    assert all(torch.equal(p, params[name]) for name, p in served(server).items())
    again = greedy(client, [4, 5, 6])
    assert (again["output_ids"], again["text"]) == (before["output_ids"], before["text"])
    assert client.post("/resume_memory_occupation").status_code == 200  # nothing released: no change

    # Only the "weights" tag holds memory on the CPU engine: releasing the KV cache keeps generation working.
    assert client.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert greedy(client, [4, 5, 6])["output_ids"] == before["output_ids"]


def test_release_refuses_while_a_batch_is_paused_mid_generation(server, client):
    running = long_request(server.url)
    wait_for(lambda: loads(client)["num_running_reqs"] == 1, what="a running request")
    client.post("/pause_generation", json={"mode": "in_place"})
    refused = client.post("/release_memory_occupation", json={"tags": ["weights"]})
    assert refused.status_code == 400 and "paused mid-generation" in refused.json()["error"]["message"]
    client.post("/continue_generation", json={})
    assert running.result(timeout=60).json()["meta_info"]["finish_reason"]["type"] == "length"


# --- weights over torch.distributed -------------------------------------------------------------------------------


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_update_weights_from_distributed(server, client, load_format):
    before = greedy(client, [5, 6, 7, 8], 16)
    trainer = TrainerGroup(server.url)
    assert trainer.init_response.status_code == 200 and trainer.init_response.json()["success"] is True
    new = perturbed(server, seed=2)
    # Mixed dtypes in one update (and one bucket): bfloat16 tensors are converted to the served float32.
    new["model.layers.1.mlp.down_proj.weight"] = new["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16)
    new["model.norm.weight"] = new["model.norm.weight"].to(torch.bfloat16)
    answer = trainer.send(new, load_format, weight_version="3")
    assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
    assert answer.json()["message"].endswith("Weight version updated to 3.")
    now = served(server)
    assert all(torch.equal(now[name], tensor.float()) for name, tensor in new.items())
    assert torch.equal(server.engine.model.lm_head.weight, new["model.embed_tokens.weight"])  # tied
    after = greedy(client, [5, 6, 7, 8], 16)
    assert after["output_ids"] != before["output_ids"] and after["meta_info"]["weight_version"] == "3"
    assert client.get("/model_info").json()["weight_version"] == "3"

    # A subset of the weights, in a second update over the same group.
    part = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)}
    assert trainer.send(part, load_format).json()["success"] is True
    assert not server.engine.model.model.layers[0].self_attn.q_proj.weight.any()
    assert client.get("/model_info").json()["weight_version"] == "3"

    # An unknown name or a wrong shape: received (the group stays in step), refused, nothing changed.
    snapshot = served(server)
    for bad, needle in (
        ({"model.embed_tokens.weight": torch.ones(61, 64), "model.nope.weight": torch.ones(2)}, "model.nope.weight"),
        ({"model.norm.weight": torch.ones(65)}, "model.norm.weight has shape [65]"),
    ):
        refused = trainer.send(bad, load_format, weight_version="4")
        assert refused.status_code == 400 and refused.json()["success"] is False
        assert needle in refused.json()["message"]
        assert all(torch.equal(p, snapshot[name]) for name, p in served(server).items())
    assert client.get("/model_info").json()["weight_version"] == "3"

    # Release and resume bring back exactly the weights received over the group.
    assert client.post("/release_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    assert client.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    assert all(torch.equal(p, snapshot[name]) for name, p in served(server).items())

    destroyed = trainer.destroy()
    assert destroyed.status_code == 200 and destroyed.json()["success"] is True
    again = client.post("/destroy_weights_update_group", json={"group_name": "weight_update_group"})
    assert again.status_code == 400 and "does not exist" in again.json()["message"]
    late = client.post(
        "/update_weights_from_distributed",
        json={"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]},
    )
    assert late.status_code == 400 and "call /init_weights_update_group first" in late.json()["message"]


def test_init_weights_update_group_refusals(server, client):
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
    nccl = client.post("/init_weights_update_group", json=body)  # SGLang's default backend is nccl
    assert nccl.status_code == 400 and nccl.json()["success"] is False and "'nccl'" in nccl.json()["message"]

    server.engine.weight_groups.timeout_s = 1.0
    started = time.monotonic()
    pending = in_background(server.url, "/init_weights_update_group", {**body, "backend": "gloo", "group_name": "g"})
    assert client.get("/health").status_code == 200  # the event loop is free while the engine waits to join
    lonely = pending.result()
    assert lonely.status_code == 400 and "could not join weight update group 'g'" in lonely.json()["message"]
    assert time.monotonic() - started < 20
    # The failed join left nothing behind: the name can be used again.
    server.engine.weight_groups.timeout_s = GROUP_TIMEOUT_S
    trainer = TrainerGroup(server.url, group_name="g")
    assert trainer.init_response.json()["success"] is True
    taken = client.post("/init_weights_update_group", json={**body, "backend": "gloo", "group_name": "g"})
    assert taken.status_code == 400 and "already exists" in taken.json()["message"]
    assert trainer.destroy().json()["success"] is True


# --- weights from tensors -----------------------------------------------------------------------------------------


def test_update_weights_from_tensor(server, client):
    before = greedy(client, [5, 6, 7, 8], 16)
    new = perturbed(server, seed=4)
    new["model.norm.weight"] = new["model.norm.weight"].to(torch.bfloat16)
    answer = post_tensors(server.url, new, weight_version="5")
    assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
    now = served(server)
    assert all(torch.equal(now[name], tensor.float()) for name, tensor in new.items())
    after = greedy(client, [5, 6, 7, 8], 16)
    assert after["output_ids"] != before["output_ids"] and after["meta_info"]["weight_version"] == "5"

    refused = post_tensors(server.url, {"model.norm.weight": torch.ones(64), "lm_head.bias": torch.ones(61)})
    assert refused.status_code == 400 and "lm_head.bias" in refused.json()["message"]
    assert torch.equal(served(server)["model.norm.weight"], now["model.norm.weight"])
    assert client.get("/model_info").json()["weight_version"] == "5"


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("echo should-not-run",))


def test_update_weights_from_tensor_refuses_what_is_not_a_tensor_list(shared_client):
    def post(entry):
        return shared_client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [entry]})

    exploit = base64.b64encode(pickle.dumps([("x", _Exploit())])).decode()
    refused = post(exploit)
    assert refused.status_code == 400 and "refusing to unpickle posix.system" in refused.json()["message"]
    assert "not base64" in post("%%%").json()["message"]
    assert "(name, tensor) pairs" in post(base64.b64encode(pickle.dumps({"a": 1})).decode()).json()["message"]

    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    try:
        tensors = {"model.norm.weight": torch.ones(64)}
        fd_shared = post(serialize_named_tensors(tensors))
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    assert fd_shared.status_code == 400 and "set_sharing_strategy('file_system')" in fd_shared.json()["message"]


# --- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/update_weight_version", {}, "needs 'new_version'"),
        ("/update_weight_version", {"new_version": 3}, "'new_version' must be a string, got 3"),
        ("/update_weight_version", {"new_version": "3", "abort_all_requests": "yes"}, "'abort_all_requests' must be"),
        ("/pause_generation", {"mode": "freeze"}, "'mode' must be one of ['abort', 'retract', 'in_place']"),
        ("/pause_generation", [], "body must be a JSON object"),
        ("/continue_generation", {"now": True}, "unsupported /continue_generation fields ['now']"),
        ("/release_memory_occupation", {"tags": ["gpu"]}, "unknown tags ['gpu']"),
        ("/resume_memory_occupation", {"tags": "weights"}, "'tags' must be null or a list"),
        ("/init_weights_update_group", {"master_address": "h", "rank_offset": 1, "world_size": 2}, "'master_port'"),
        (
            "/init_weights_update_group",
            {"master_address": "h", "master_port": 70000, "rank_offset": 1, "world_size": 2},
            "'master_port' must be a port number",
        ),
        (
            "/init_weights_update_group",
            {"master_address": "h", "master_port": 7000, "rank_offset": 0, "world_size": 2},
            "'rank_offset' must be in [1, world_size)",
        ),
        (
            "/init_weights_update_group",
            {"master_address": "h", "master_port": 7000, "rank_offset": 1, "world_size": 1},
            "'world_size' must be >= 2",
        ),
        ("/destroy_weights_update_group", {"group_name": 3}, "'group_name' must be a non-empty string"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"]}, "needs 'shapes'"),
        (
            "/update_weights_from_distributed",
            {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]]},
            "one entry per tensor, got 2, 1 and 1",
        ),
        (
            "/update_weights_from_distributed",
            {"names": ["a"], "dtypes": ["float33"], "shapes": [[1]]},
            "'float33', which is not a torch dtype name",
        ),
        (
            "/update_weights_from_distributed",
            {"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]]},
            "'shapes' must be a list of shapes",
        ),
        (
            "/update_weights_from_distributed",
            {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "load_format": "direct"},
            "'load_format' must be null or 'flattened_bucket'",
        ),
        (
            "/update_weights_from_distributed",
            {"names": ["a", "a"], "dtypes": ["float32"] * 2, "shapes": [[1]] * 2},
            "lists ['a'] more than once",
        ),
        ("/update_weights_from_tensor", {"serialized_named_tensors": []}, "'serialized_named_tensors' must be"),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": ["AA=="], "load_format": "flattened_bucket"},
            "'load_format' must be null or 'direct'",
        ),
        (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": ["AA=="], "weight_version": 2},
            "'weight_version'",
        ),
    ],
)
def test_bad_control_input_is_rejected_naming_the_field(shared_client, path, body, message):
    response = shared_client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["code"] == 400


def test_sglang_request_fields_are_accepted(client):
    """Every field of SGLang's request objects is accepted, including the routing ones every request carries."""
    assert client.post("/pause_generation", json={"mode": "in_place", "rid": None}).status_code == 200
    assert client.post("/continue_generation", json={"torch_empty_cache": False}).status_code == 200
    answer = client.post("/destroy_weights_update_group", json={"group_name": "nope", "http_worker_ipc": None})
    assert answer.status_code == 400 and answer.json() == {
        "success": False,
        "message": "weight update group 'nope' does not exist on this engine",
    }


# --- the same trainer side against any server ---------------------------------------------------------------------


def check_server(url: str) -> None:
    """Run the trainer side against the server at `url` (a CPU engine or a real SGLang server with the tiny model):
    both distributed load formats, then tensors. Prints what each step answered."""
    names = ["model.norm.weight", "model.layers.0.mlp.up_proj.weight"]
    shapes = {"model.norm.weight": (64,), "model.layers.0.mlp.up_proj.weight": (128, 64)}
    probe = {"name": "model.norm.weight", "truncate_size": 3}

    def show(step, response):
        print(f"{step}: {response.status_code} {response.text[:300]}", flush=True)

    with httpx.Client(base_url=url, timeout=120) as http:
        show("model_info", http.get("/model_info"))
        trainer = TrainerGroup(url)
        show("init_weights_update_group", trainer.init_response)
        for version, load_format in (("101", None), ("102", "flattened_bucket")):
            named = {name: torch.full(shapes[name], float(version) / 1000) for name in names}
            named["model.norm.weight"] = named["model.norm.weight"].to(torch.bfloat16)
            show(f"update_weights_from_distributed {load_format}", trainer.send(named, load_format, version))
            show("model_info weight_version", http.get("/model_info"))
            show("get_weights_by_name (SGLang only)", http.post("/get_weights_by_name", json=probe))
        show("destroy_weights_update_group", trainer.destroy())
        named = {name: torch.full(shapes[name], 0.103) for name in names}
        show("update_weights_from_tensor", post_tensors(url, named, "103"))
        show("model_info weight_version", http.get("/model_info"))
        show("get_weights_by_name (SGLang only)", http.post("/get_weights_by_name", json=probe))
        for path, body in (("/pause_generation", {"mode": "retract"}), ("/continue_generation", {})):
            show(path, http.post(path, json=body))
        show("v1/loads", http.get("/v1/loads"))


if __name__ == "__main__":
    check_server(sys.argv[1])
