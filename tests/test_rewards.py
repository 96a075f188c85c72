"""Rewards: error isolation and timeouts, combined rewards, the f1 and remote rewards, and the reward flags."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from slime.data.data_source import RolloutDataSourceWithBuffer
from slime.plugins.rollout_builtins import f1_reward, token_f1
from slime.rollout import remote_reward, rm_hub, sglang_rollout
from slime.utils.arguments import parse_args
from slime.utils.types import Sample

# --- reward functions used through dotted paths (--custom-rm-path / --rm-type accept them) ---


def raising_reward(args, sample):
    raise RuntimeError(f"broken reward for {sample.response}")


async def hanging_reward(args, sample):
    await asyncio.sleep(30)
    return 1.0


def blocking_reward(args, sample):
    time.sleep(2.0)
    return 1.0


def nan_reward(args, sample):
    return float("nan")


def none_reward(args, sample):
    return None


def half_reward(args, sample):
    return 0.5


async def async_one(args, sample):
    await asyncio.sleep(0)
    return 1


def dict_reward(args, sample):
    return {"score": 0.25}


class AsyncCallable:
    async def __call__(self, args, sample):
        await asyncio.sleep(30)


async_callable = AsyncCallable()


def _args(**values):
    base = {"rm_type": None, "custom_rm_path": None, "reward_timeout": 30.0, "reward_error": None}
    return SimpleNamespace(**{**base, **values})


def _path(function) -> str:
    return f"{__name__}.{function.__name__}"


def _score(args, *samples):
    return asyncio.run(rm_hub.batched_async_rm(args, list(samples)))


# --- 1. errors and timeouts ---


def test_a_raising_reward_gives_zero_marks_the_sample_and_logs_the_first_traceback_once(caplog):
    args = _args(custom_rm_path=_path(raising_reward))
    samples = [Sample(index=i, response=f"r{i}") for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="slime.rollout.rm_hub"):
        assert _score(args, *samples) == [0.0, 0.0, 0.0]
    for sample in samples:
        assert rm_hub.reward_error(sample).startswith(f"{_path(raising_reward)}: RuntimeError: broken reward")
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].exc_info is not None and warnings[0].exc_info[0] is RuntimeError
    assert "raising_reward" in warnings[0].getMessage() and "sample 0" in warnings[0].getMessage()
    assert rm_hub.reward_metrics(args, [samples]) == {"rollout/reward_errors": 3}
    # The next step (a new event loop) logs its first error again.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slime.rollout.rm_hub"):
        _score(args, Sample(index=7))
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_a_hanging_async_reward_times_out():
    args = _args(custom_rm_path=_path(hanging_reward), reward_timeout=0.2)
    sample = Sample(index=0)
    started = time.monotonic()
    assert _score(args, sample) == [0.0]
    assert time.monotonic() - started < 2
    assert "took longer than --reward-timeout 0.2 s" in rm_hub.reward_error(sample)


def test_an_object_with_an_async_call_is_awaited_on_the_loop_and_times_out():
    sample = Sample(index=0)
    assert _score(_args(custom_rm_path=f"{__name__}.async_callable", reward_timeout=0.1), sample) == [0.0]
    assert "--reward-timeout 0.1 s" in rm_hub.reward_error(sample)


def test_a_blocking_sync_reward_runs_off_the_event_loop_and_times_out():
    args = _args(custom_rm_path=_path(blocking_reward), reward_timeout=0.2)
    sample = Sample(index=0)
    ticks = []

    async def main():
        async def ticker():
            for _ in range(5):
                ticks.append(time.monotonic())
                await asyncio.sleep(0.02)

        return await asyncio.gather(rm_hub.async_rm(args, sample), ticker())

    started = time.monotonic()
    reward, _ = asyncio.run(main())
    assert reward == 0.0 and "--reward-timeout" in rm_hub.reward_error(sample)
    assert len(ticks) == 5 and ticks[-1] - started < 1.5  # the loop kept running while the reward slept
    assert time.monotonic() - started < 1.5  # the step does not wait for the abandoned call to return


@pytest.mark.parametrize("function", [nan_reward, none_reward])
def test_a_reward_that_is_not_a_finite_number_is_an_error(function):
    sample = Sample(index=0)
    assert _score(_args(custom_rm_path=_path(function)), sample) == [0.0]
    assert "not a finite number" in rm_hub.reward_error(sample)


def test_good_rewards_are_unchanged_and_leave_no_mark():
    sample = Sample(index=0)
    assert _score(_args(custom_rm_path=_path(async_one)), sample) == [1.0]
    assert rm_hub.reward_error(sample) is None and sample.metadata == {}
    # A single reward may return a dict (for --reward-key).
    assert _score(_args(custom_rm_path=_path(dict_reward)), Sample()) == [{"score": 0.25}]


def test_a_missing_configuration_still_fails_loudly():
    with pytest.raises(ValueError, match="No reward function configured"):
        _score(_args(), Sample())


def test_a_mark_does_not_leak_to_samples_sharing_a_metadata_dict():
    shared = {"task": "t"}
    broken, fine = Sample(index=0, response="x", metadata=shared), Sample(index=1, response="y", metadata=shared)
    asyncio.run(rm_hub.async_rm(_args(custom_rm_path=_path(raising_reward)), broken))
    assert rm_hub.reward_error(broken) and broken.metadata["task"] == "t"
    assert rm_hub.reward_error(fine) is None and shared == {"task": "t"}


def test_drop_group_verdict_and_sample_round_trip():
    args = _args(reward_error="drop-group")
    bad = [Sample(index=0, metadata={"reward_error": "x: boom"}), Sample(index=1)]
    verdict = rm_hub.group_verdict(args, bad)
    assert verdict.keep is False and verdict.reason == "reward_error"
    assert rm_hub.group_verdict(args, [Sample(), Sample()]) is None
    assert rm_hub.group_verdict(_args(), bad) is None  # the default policy keeps the group (rewards 0.0)
    restored = Sample.from_dict(json.loads(json.dumps(Sample.to_dict(bad[0]) | {"status": "completed"})))
    assert rm_hub.reward_error(restored) == "x: boom"


# --- drop-group and the metrics through the sglang rollout function ---


class _Engine(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_error(404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/abort_request":
            data = b"{}"
        else:
            answer = {"text": "42", "output_ids": [5], "meta_info": {"finish_reason": {"type": "stop"}}}
            batch = body.get("text", body.get("input_ids"))
            batched = isinstance(batch, list) and all(isinstance(item, (str, list)) for item in batch)
            data = json.dumps([answer] * len(batch) if batched else answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _serve(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    server.block_on_close = False
    server.handle_error = lambda request, address: None  # a client that timed out closed its end: expected
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def engine_url():
    server, url = _serve(_Engine)
    yield url
    server.shutdown()
    server.server_close()


def _rollout_args(tmp_path, engine_url, **overrides):
    path = tmp_path / "prompts.jsonl"
    rows = [{"q": "bad", "a": "no number"}, {"q": "good", "a": "42"}, {"q": "good too", "a": "42"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    values = dict(
        prompt_data=str(path),
        input_key="q",
        label_key="a",
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        over_sampling_batch_size=1,
        rollout_engine_urls=[engine_url],
        rm_type="math",
        deterministic=True,
        dynamic_sampling_filter_path=None,
        rollout_sample_filter_path=None,
        rollout_all_samples_process_path=None,
        rollout_data_transport="object-store",
    )
    return SimpleNamespace(**{**values, **overrides})


@pytest.mark.parametrize("policy", ["zero", "drop-group"])
def test_reward_errors_through_the_rollout_function(tmp_path, engine_url, policy):
    args = _rollout_args(tmp_path, engine_url, reward_error=policy)
    source = RolloutDataSourceWithBuffer(args)
    output, _ = asyncio.run(sglang_rollout.generate_rollout_async(args, 0, source.get_samples))
    prompts = [group[0].prompt for group in output.samples]
    assert output.metrics["rollout/reward_errors"] == 2
    if policy == "zero":
        assert prompts == ["bad", "good"]
        assert [s.reward for s in output.samples[0]] == [0.0, 0.0]
        assert all("holds no number" in rm_hub.reward_error(s) for s in output.samples[0])
        assert "rollout/dynamic_filter/drop_reward_error" not in output.metrics
    else:
        assert prompts == ["good", "good too"]
        assert output.metrics["rollout/dynamic_filter/drop_reward_error"] == 1
    assert all(s.reward == 1.0 for group in output.samples if group[0].prompt != "bad" for s in group)


# --- 2. combined rewards ---


def test_combined_rewards_weighted_sum_components_and_metrics():
    names = f"{_path(half_reward)},{_path(async_one)}"
    weighted = _args(rm_type=names, rm_weights="0.7,0.3")
    sample = Sample(index=0)
    assert _score(weighted, sample) == [pytest.approx(0.7 * 0.5 + 0.3)]
    assert sample.metadata["rewards"] == {_path(half_reward): 0.5, _path(async_one): 1.0}
    equal = _args(rm_type=names)
    other = Sample(index=1)
    assert _score(equal, other) == [pytest.approx(0.75)]
    metrics = rm_hub.reward_metrics(equal, [[sample, other]])
    assert metrics == {
        "rollout/reward_errors": 0,
        f"rollout/reward/{_path(half_reward)}": 0.5,
        f"rollout/reward/{_path(async_one)}": 1.0,
    }
    # One failing component fails the sample.
    broken = Sample(index=2)
    assert _score(_args(rm_type=f"{_path(half_reward)},{_path(raising_reward)}"), broken) == [0.0]
    assert rm_hub.reward_error(broken).startswith(_path(raising_reward))
    # The parts run concurrently: two slow ones take one timeout, not two.
    slow = _args(rm_type=f"{_path(hanging_reward)},{__name__}.async_callable", reward_timeout=0.5)
    started = time.monotonic()
    assert _score(slow, Sample()) == [0.0]
    assert time.monotonic() - started < 0.95
    # A dict is not a number to weigh.
    assert _score(_args(rm_type=f"{_path(half_reward)},{_path(dict_reward)}"), Sample()) == [0.0]


def test_single_reward_metrics_have_no_per_reward_entries():
    assert rm_hub.reward_metrics(_args(rm_type="math"), [[Sample(metadata=None)]]) == {"rollout/reward_errors": 0}


def _parse_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit):
        parse_args(list(argv))
    err = capsys.readouterr().err
    assert "slime-run: error:" in err
    return err


def test_reward_flags_are_validated_at_parse_time(capsys):
    args = parse_args(["--rm-type", "f1,math", "--rm-weights", "0.7,0.3", "--reward-timeout", "5"])
    settings = rm_hub.RewardSettings.from_args(args)
    assert settings.rm_types == ("f1", "math") and settings.reward_weights == (0.7, 0.3)
    assert settings.timeout_s == 5.0 and settings.error_policy == "zero"
    assert rm_hub.RewardSettings.from_args(parse_args(["--rm-type", "f1,math"])).reward_weights == (0.5, 0.5)
    err = _parse_error(capsys, "--rm-type", "f1,math", "--rm-weights", "1")
    assert "--rm-weights" in err and "--rm-type" in err
    err = _parse_error(capsys, "--rm-type", "f1,nope")
    assert "'nope'" in err and "exact-match, f1, math, remote" in err
    assert "--rm-type names f1 more than once" in _parse_error(capsys, "--rm-type", "f1,math,f1")
    assert "empty reward name" in _parse_error(capsys, "--rm-type", "f1,,math")
    err = _parse_error(capsys, "--rm-type", "f1", "--rm-weights", "x")
    assert "--rm-weights must be comma-separated numbers" in err
    assert "--reward-timeout must be > 0" in _parse_error(capsys, "--rm-type", "f1", "--reward-timeout", "0")
    assert "invalid choice" in _parse_error(capsys, "--reward-error", "ignore")
    err = _parse_error(capsys, "--reward-error", "drop-group", "--rollout-function-path", "fully-async")
    assert "--reward-error drop-group" in err
    assert "needs --rm-url" in _parse_error(capsys, "--rm-type", "remote")
    assert "--rm-url must be an http" in _parse_error(capsys, "--rm-type", "remote", "--rm-url", "localhost:1")
    err = _parse_error(capsys, "--rm-type", "remote", "--rm-url", "http://h", "--rm-timeout", "-1")
    assert "--rm-timeout must be > 0" in err
    err = _parse_error(capsys, "--rm-type", "remote", "--rm-url", "http://h", "--rm-max-retries", "-1")
    assert "--rm-max-retries must be >= 0" in err
    err = _parse_error(capsys, "--rm-type", "remote", "--rm-url", "http://h", "--rm-batch-size", "0")
    assert "--rm-batch-size must be >= 1" in err
    assert "drop one" in _parse_error(capsys, "--custom-rm-path", "f1", "--rm-weights", "1")


# --- 3. f1 ---


def test_token_f1():
    assert token_f1("The cat sat.", "the CAT sat") == 1.0
    assert token_f1("the cat", "the cat sat on the mat") == pytest.approx(0.5)
    assert token_f1("dog", "cat") == 0.0
    assert token_f1("a a b", "a b b") == pytest.approx(2 / 3)  # tokens count with multiplicity
    assert token_f1("", "...") == 1.0 and token_f1("", "cat") == 0.0 and token_f1("cat", "") == 0.0
    assert token_f1("don't", "dont") == 0.0  # punctuation separates: "don t" vs "dont"
    args = _args()
    assert f1_reward(args, Sample(response="thinking... \\boxed{New York}", label="new york")) == 1.0
    assert f1_reward(args, Sample(response="so \\fbox{new york!}", label="New York")) == 1.0
    with pytest.raises(ValueError, match="f1 reward needs a label"):
        f1_reward(args, Sample(response="x"))


# --- 4. the remote reward against a real HTTP server ---


class _RewardServer(BaseHTTPRequestHandler):
    calls: list = []
    flaky_failures = 0

    def log_message(self, *args):
        pass

    def _send(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        cls.calls.append((self.path, body, self.headers.get("Authorization")))
        rewards = [len(sample["response"]) / 10 for sample in body["samples"]]
        if self.path == "/flaky":
            cls.flaky_failures += 1
            if cls.flaky_failures <= 2:
                return self._send(503, b"busy")
        elif self.path == "/not-json":
            return self._send(200, b"<html>oops</html>")
        elif self.path == "/short":
            rewards = rewards[:-1]
        elif self.path == "/strings":
            rewards = ["high" for _ in rewards]
        elif self.path == "/bad-request":
            return self._send(400, b"no")
        elif self.path == "/hang":
            time.sleep(1.5)
        self._send(200, json.dumps({"rewards": rewards}).encode())


@pytest.fixture
def reward_server(monkeypatch):
    monkeypatch.setattr(remote_reward, "RETRY_BACKOFF_S", 0.01)
    monkeypatch.delenv(remote_reward.API_KEY_ENV, raising=False)
    _RewardServer.calls, _RewardServer.flaky_failures = [], 0
    server, url = _serve(_RewardServer)
    yield url
    server.shutdown()
    server.server_close()


def _remote(url, **values):
    return _args(rm_type="remote", rm_url=url, **values)


def _samples(*responses):
    return [Sample(index=i, prompt="p", response=r, label="l", metadata={"k": i}) for i, r in enumerate(responses)]


def test_remote_batch_request_and_bearer_key(reward_server):
    samples = _samples("ab", "abcd")
    args = _remote(f"{reward_server}/ok", rm_api_key="secret")
    assert asyncio.run(remote_reward.score_batch(args, samples)) == [0.2, 0.4]
    path, body, auth = _RewardServer.calls[0]
    assert path == "/ok" and auth == "Bearer secret"
    assert body["samples"][1] == {
        "index": 1,
        "group_index": None,
        "prompt": "p",
        "response": "abcd",
        "label": "l",
        "metadata": {"k": 1},
    }


def test_remote_reward_through_rm_hub_with_the_env_key(reward_server, monkeypatch):
    monkeypatch.setenv(remote_reward.API_KEY_ENV, "from-env")
    samples = _samples("a", "abc")
    assert _score(_remote(f"{reward_server}/ok"), *samples) == [0.1, pytest.approx(0.3)]
    assert {auth for _, _, auth in _RewardServer.calls} == {"Bearer from-env"}
    assert all(rm_hub.reward_error(s) is None for s in samples)


@pytest.mark.parametrize(("batch_size", "requests"), [(16, [3]), (2, [2, 1]), (1, [1, 1, 1])])
def test_remote_reward_batches_concurrent_samples(reward_server, batch_size, requests):
    samples = _samples("a", "ab", "abc")
    assert _score(_remote(f"{reward_server}/ok", rm_batch_size=batch_size), *samples) == pytest.approx([0.1, 0.2, 0.3])
    assert sorted((len(body["samples"]) for _, body, _ in _RewardServer.calls), reverse=True) == requests
    sent = sorted(s["response"] for _, body, _ in _RewardServer.calls for s in body["samples"])
    assert sent == ["a", "ab", "abc"]  # each once (concurrent requests may arrive in any order)


def test_a_failed_batch_marks_each_of_its_samples(reward_server):
    url = f"{reward_server}/short"
    samples = _samples("a", "ab")
    assert _score(_remote(url), *samples) == [0.0, 0.0]
    assert len(_RewardServer.calls) == 1
    assert all("answered 1 reward(s) for 2 sample(s)" in rm_hub.reward_error(s) for s in samples)


def test_remote_retries_then_succeeds(reward_server):
    args = _remote(f"{reward_server}/flaky", rm_max_retries=3)
    assert asyncio.run(remote_reward.score_batch(args, _samples("abc"))) == [pytest.approx(0.3)]
    assert len(_RewardServer.calls) == 3


def test_remote_gives_up_after_the_retries(reward_server):
    args = _remote(f"{reward_server}/flaky", rm_max_retries=1)
    with pytest.raises(remote_reward.RemoteRewardError, match=r"failed 2 time\(s\).*HTTP 503"):
        asyncio.run(remote_reward.score_batch(args, _samples("abc")))


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/not-json", "answered non-JSON"),
        ("/short", r"answered 1 reward\(s\) for 2 sample\(s\)"),
        ("/strings", "not a finite number: 'high'"),
        ("/bad-request", "answered HTTP 400"),
    ],
)
def test_remote_garbage_is_an_error_naming_the_url_and_is_not_retried(reward_server, path, message):
    url = f"{reward_server}{path}"
    with pytest.raises(remote_reward.RemoteRewardError, match=message) as caught:
        asyncio.run(remote_reward.score_batch(_remote(url), _samples("a", "b")))
    assert url in str(caught.value)
    assert len(_RewardServer.calls) == 1
    sample = _samples("a")[0]
    assert _score(_remote(url), sample) == [0.0]
    assert url in rm_hub.reward_error(sample)


def test_remote_request_timeout_is_retried_then_reported(reward_server):
    args = _remote(f"{reward_server}/hang", rm_timeout=0.2, rm_max_retries=1)
    started = time.monotonic()
    with pytest.raises(remote_reward.RemoteRewardError, match="ReadTimeout"):
        asyncio.run(remote_reward.score_batch(args, _samples("a")))
    assert time.monotonic() - started < 1.4 and len(_RewardServer.calls) == 2
    # --reward-timeout bounds the whole call.
    sample = _samples("a")[0]
    assert _score(_remote(f"{reward_server}/hang", reward_timeout=0.3), sample) == [0.0]
    assert "--reward-timeout 0.3 s" in rm_hub.reward_error(sample)


def test_remote_unreachable_server(reward_server):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RewardServer)
    port = server.server_address[1]
    server.server_close()  # nothing listens there any more
    sample = _samples("a")[0]
    assert _score(_remote(f"http://127.0.0.1:{port}/", rm_max_retries=1), sample) == [0.0]
    assert f"127.0.0.1:{port}" in rm_hub.reward_error(sample) and "ConnectError" in rm_hub.reward_error(sample)
