"""Sending weights to engines without disk (`slime.weight_sync`): buckets, their wire format, and both senders
against the real CPU engine (the SGLang protocol), including refusals, engines that never join and engines that
die mid-update.

The failure paths an engine cannot be made to take on purpose (never joining, refusing to join) use
`_ScriptedEngine`, an HTTP server that answers only endpoints of `ENGINE_ENDPOINTS`, as an SGLang server would.
"""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch

from slime.backend_interfaces import ENGINE_ENDPOINTS
from slime.engine_control import EngineRequestError
from slime.weight_sync import (
    TensorWeightSender,
    WeightSyncError,
    WeightUpdate,
    bucket_metadata,
    canonical_transport,
    flatten_bucket,
    is_this_machine,
    iter_buckets,
    local_address_towards,
    send_weights,
)

# ------------------------------------------------------------------------------------- update and buckets


def test_a_weight_update_is_validated_and_travels_to_ranks_by_pickle():
    update = WeightUpdate(version=7, transport="distributed", engine_urls=["http://127.0.0.1:1"], bucket_bytes=64)
    assert update.engine_urls == ("http://127.0.0.1:1",) and update.group_name == "slime-weights-v7"
    assert pickle.loads(pickle.dumps(update)) == update
    assert canonical_transport("nccl") == "distributed" and canonical_transport("tensor") == "tensor"
    with pytest.raises(ValueError, match="transport must be one of disk, distributed, tensor, got 'nccl'"):
        WeightUpdate(version=1, transport="nccl")
    with pytest.raises(ValueError, match="needs disk_dir"):
        WeightUpdate(version=1, transport="disk")
    with pytest.raises(ValueError, match="--update-weight-buffer-size must be >= 1 byte, got 0"):
        WeightUpdate(version=1, transport="tensor", bucket_bytes=0)


def _named(*sizes_and_dtypes):
    return [(f"w{i}", torch.zeros(size, dtype=dtype)) for i, (size, dtype) in enumerate(sizes_and_dtypes)]


def test_buckets_keep_order_stay_under_the_size_and_a_large_tensor_travels_alone():
    tensors = _named(
        (4, torch.float32),  # 16 B
        (8, torch.bfloat16),  # 16 B
        (10, torch.uint8),  # 10 B
        (30, torch.float32),  # 120 B: larger than a bucket
        (2, torch.float64),  # 16 B
        (1, torch.int64),  # 8 B
        (3, torch.uint8),  # 3 B
        (1, torch.float32),  # 4 B, fits, but 3 bytes before it would misalign it: a new bucket
        (2, torch.bfloat16),  # 4 B
    )
    buckets = list(iter_buckets(iter(tensors), bucket_bytes=40))
    assert [[name for name, _ in bucket] for bucket in buckets] == [
        ["w0", "w1"],
        ["w2"],
        ["w3"],
        ["w4", "w5", "w6"],
        ["w7", "w8"],
    ]
    assert [name for bucket in buckets for name, _ in bucket] == [name for name, _ in tensors]
    assert list(iter_buckets([], 40)) == []
    assert [len(b) for b in iter_buckets(tensors[:2] + tensors[4:6], bucket_bytes=10**9)] == [4]


def test_buckets_read_the_tensors_lazily():
    read = []

    def tensors():
        for name, tensor in _named(*[(4, torch.float32)] * 4):
            read.append(name)
            yield name, tensor

    buckets = iter_buckets(tensors(), bucket_bytes=16)
    assert [name for name, _ in next(buckets)] == ["w0"]
    assert read == ["w0", "w1"]  # one tensor ahead, never the whole model


def test_a_flattened_bucket_is_the_concatenated_bytes_of_its_tensors_in_order():
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    c = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()  # not contiguous: its row-major bytes travel
    b = torch.tensor([1.5, -2.25, 3.0, 0.5], dtype=torch.bfloat16)
    d = torch.tensor(7, dtype=torch.int32)  # a scalar
    tensors = (a, c, b, d)
    bucket = list(zip("acbd", tensors, strict=True))
    assert list(iter_buckets(bucket, bucket_bytes=10**9)) == [bucket]  # aligned: one bucket
    flat = flatten_bucket(bucket)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    expected = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in (a, c, b, d.reshape(1)))
    assert flat.numpy().tobytes() == expected
    assert c.contiguous().numpy().tobytes() == expected[24 : 24 + 96]
    assert bucket_metadata(bucket) == {
        "names": ["a", "c", "b", "d"],
        "dtypes": ["float32", "int64", "bfloat16", "int32"],
        "shapes": [[2, 3], [4, 3], [4], []],
    }
    # An engine reads it back by splitting at the tensors' byte sizes and viewing each part as its dtype.
    offset, back = 0, []
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        back.append(flat[offset : offset + size].view(tensor.dtype).reshape(tensor.shape))
        offset += size
    assert all(torch.equal(x, y) for x, y in zip(back, tensors, strict=True))


def test_send_weights_sends_tensors_only_and_nothing_without_engines():
    with pytest.raises(ValueError, match="exported to update.disk_dir by the backend"):
        send_weights(WeightUpdate(version=1, transport="disk", disk_dir="/w/weight_v000001"), [])

    def never_read():
        raise AssertionError("no engines: the weights must not be read")
        yield

    send_weights(WeightUpdate(version=1, transport="distributed"), never_read())


def test_addresses_of_this_machine():
    assert local_address_towards("http://127.0.0.1:30000") == "127.0.0.1"
    assert is_this_machine("127.0.0.1") and is_this_machine("localhost")
    assert not is_this_machine("192.0.2.1")  # TEST-NET-1: never an address of this machine
    assert not is_this_machine("no-such-host.invalid")


def test_tensor_updates_refuse_engines_on_other_machines():
    update = WeightUpdate(version=1, transport="tensor", engine_urls=("http://127.0.0.1:1", "http://192.0.2.1:30000"))
    with pytest.raises(WeightSyncError, match=r"engine\(s\) http://192.0.2.1:30000 run elsewhere; use --update-w"):
        TensorWeightSender(update)


# --------------------------------------------------------------------------------- against the CPU engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from slime.plugins.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def _start_engine(model_dir):
    from slime.plugins.cpu_engine_server import EngineServer

    return EngineServer(str(model_dir), num_threads=1)


@pytest.fixture(scope="module")
def engine(model_dir):
    server = _start_engine(model_dir)
    yield server
    server.stop()


def _trainer_model(model_dir, seed: int):
    """The served model with every weight moved a little: what a trained policy sends."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


def _engine_matches(url: str, model) -> tuple[float, str]:
    """(max |engine log-prob - model log-prob| over a greedy continuation, the version the answer carries)."""
    prompt = [5, 17, 42, 9, 33, 7]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True}
    meta = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
    tokens = [token for _, token, *_ in meta["output_token_logprobs"]]
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0], -1)
    mine = [log_probs[len(prompt) - 1 + i, token].item() for i, token in enumerate(tokens)]
    engine = [log_prob for log_prob, *_ in meta["output_token_logprobs"]]
    return max(abs(x - y) for x, y in zip(engine, mine, strict=True)), meta["weight_version"]


def _version(url: str) -> str:
    return httpx.get(f"{url}/model_info", timeout=30).json()["weight_version"]


@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_the_cpu_engine_serves_exactly_the_sent_weights_as_the_new_version(model_dir, engine, transport):
    for version, seed in ((11, 1), (12, 2)):  # twice: the first update's group is gone, the second makes its own
        model = _trainer_model(model_dir, seed)
        version += 10 * (transport == "tensor")
        update = WeightUpdate(version, transport, (engine.url,), bucket_bytes=16 * 1024, timeout_s=60)
        send_weights(update, model.state_dict().items())
        difference, served = _engine_matches(engine.url, model)
        assert served == str(version) == _version(engine.url)
        assert difference < 1e-4


def test_an_engine_refusal_names_the_engine_the_endpoint_and_its_message(model_dir, engine):
    model = _trainer_model(model_dir, 3)
    send_weights(WeightUpdate(30, "distributed", (engine.url,), timeout_s=60), model.state_dict().items())
    wrong = [("model.norm.weight", torch.ones(3)), *model.state_dict().items()]
    for transport in ("distributed", "tensor"):
        update = WeightUpdate(31, transport, (engine.url,), bucket_bytes=1024, timeout_s=60)
        endpoint = "/update_weights_from_distributed" if transport == "distributed" else "/update_weights_from_tensor"
        with pytest.raises(EngineRequestError, match=f"rollout engine {engine.url} refused POST {endpoint} \\(400\\)"):
            send_weights(update, wrong)
        assert _version(engine.url) == "30"  # the version is only set with the last bucket
    # The failed update's group was torn down on both sides: the next update makes its own and succeeds.
    send_weights(WeightUpdate(32, "distributed", (engine.url,), timeout_s=60), model.state_dict().items())
    assert _version(engine.url) == "32" and _engine_matches(engine.url, model)[0] < 1e-4


def test_an_engine_that_dies_mid_update_stops_it_naming_the_engine(model_dir):
    engine = _start_engine(model_dir)
    model = _trainer_model(model_dir, 4)

    def weights_then_engine_death():
        for index, item in enumerate(model.state_dict().items()):
            if index == 3:
                engine.stop()
            yield item

    update = WeightUpdate(40, "distributed", (engine.url,), bucket_bytes=1, timeout_s=20)  # one tensor per bucket
    started = time.monotonic()
    # The broadcast fails (the engine's connection closed) or the announcing request does: either names the engine.
    with pytest.raises((EngineRequestError, WeightSyncError), match=engine.url) as failure:
        send_weights(update, weights_then_engine_death())
    assert "/update_weights_from_distributed" in str(failure.value) or "broadcast of bucket" in str(failure.value)
    assert time.monotonic() - started < 15  # the dead engine's refused connection ends the update at once


# -------------------------------------------------------- engines that never join (scripted SGLang answers)


class _ScriptedEngine(BaseHTTPRequestHandler):
    """Answers `GET /server_info` and the weight-group endpoints as an SGLang server would; the test sets
    `server_info` and `join` (what `/init_weights_update_group` answers: "hang", never joining, or "refuse")."""

    server_info: dict = {"tp_size": 1, "dp_size": 1}
    join = "hang"
    calls: list

    def log_message(self, *args):
        pass

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the trainer stopped waiting for this answer long ago

    def do_GET(self):
        assert self.path == "/server_info"
        self.calls.append(("GET", self.path, None))
        self._send(200, type(self).server_info)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append(("POST", self.path, body))
        if self.path == "/init_weights_update_group":
            if type(self).join == "refuse":
                return self._send(400, {"success": False, "message": "Failed to initialize: group exists"})
            time.sleep(5)  # never joins; answers, as SGLang does, once its rendezvous fails
            return self._send(400, {"success": False, "message": "Failed to initialize custom process group"})
        if self.path == "/destroy_weights_update_group":
            return self._send(400, {"success": False, "message": "The group to be destroyed does not exist."})
        self._send(404, {"detail": "Not Found"})


@pytest.fixture
def scripted():
    handler = type("Engine", (_ScriptedEngine,), {"calls": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield handler
    server.shutdown()
    server.server_close()


def test_the_scripted_engine_answers_only_engine_endpoints():
    paths = {endpoint.path for endpoint in ENGINE_ENDPOINTS}
    assert {"/server_info", "/init_weights_update_group", "/destroy_weights_update_group"} <= paths


def test_an_engine_that_never_joins_times_out_and_the_group_is_torn_down(scripted):
    update = WeightUpdate(50, "distributed", (scripted.url,), timeout_s=1)
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=rf"{scripted.url} did not join weight update group 'slime-weights-v50' "):
        send_weights(update, [("w", torch.ones(4))])
    assert time.monotonic() - started < 1 + 5  # the join's timeout, then the teardown's wait for the engine
    (init,) = [body for method, path, body in scripted.calls if path == "/init_weights_update_group"]
    assert init == {
        "master_address": "127.0.0.1",
        "master_port": init["master_port"],
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "slime-weights-v50",
        "backend": "gloo",
    }
    assert ("POST", "/destroy_weights_update_group", {"group_name": "slime-weights-v50"}) in scripted.calls
    with pytest.raises(ConnectionRefusedError):  # the trainer's store is closed: a late engine cannot join
        socket.create_connection(("127.0.0.1", init["master_port"]), timeout=2).close()


def test_an_engine_that_refuses_to_join_is_named_with_its_message(scripted):
    scripted.join = "refuse"
    with pytest.raises(EngineRequestError, match=rf"{scripted.url} refused POST /init_weights_update_group \(400\): "):
        send_weights(WeightUpdate(51, "distributed", (scripted.url,), timeout_s=1), [("w", torch.ones(4))])


def test_engines_must_report_how_many_ranks_receive(scripted):
    scripted.server_info = {"tp_size": 1, "dp_size": 2}
    with pytest.raises(EngineRequestError, match="runs dp_size 2"):
        send_weights(WeightUpdate(52, "distributed", (scripted.url,)), [("w", torch.ones(4))])
    scripted.server_info = {"dp_size": 1}
    with pytest.raises(EngineRequestError, match="GET /server_info has no positive 'tp_size'"):
        send_weights(WeightUpdate(53, "tensor", (scripted.url,)), [("w", torch.ones(4))])
    assert not [call for call in scripted.calls if call[0] == "POST"]  # refused before anything was sent
