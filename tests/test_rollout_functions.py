"""Rollout functions against a tiny SGLang-protocol HTTP server, filters, rewards and the prompt data source."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from slime.data.data_source import RolloutDataSource, RolloutDataSourceWithBuffer
from slime.data.refs import DiskPayloadRef
from slime.data.transport import load_rollout_samples
from slime.plugins.math_rewards import math_reward
from slime.plugins.rollout_builtins import exact_match, nonzero_std
from slime.rollout import rm_hub, sglang_rollout
from slime.rollout.settings import RolloutSettings
from slime.utils.types import Sample


class _Engine(BaseHTTPRequestHandler):
    """Answers `/generate` like an SGLang engine: "flat" prompts always get "0", others alternate "42"/"7"
    per prompt (so each group of two samples of one prompt has one right and one wrong answer)."""

    counters: dict = {}
    lock = threading.Lock()
    requests: list = []

    def log_message(self, *args):  # keep test output quiet
        pass

    def _answer(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/abort_request":
            return self._answer({})
        assert self.path == "/generate", self.path
        type(self).requests.append(body)
        with type(self).lock:
            count = type(self).counters[body["text"]] = type(self).counters.get(body["text"], 0) + 1
        text = "0" if "flat" in body["text"] else ("42" if count % 2 else "7")
        self._answer(
            {
                "text": text,
                "output_ids": [5, 6],
                "meta_info": {
                    "finish_reason": {"type": "stop"},
                    "weight_version": "3",
                    "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
                },
            }
        )


@pytest.fixture
def engine_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Engine.requests = []
    _Engine.counters = {}
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _prompts(tmp_path, rows):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _args(tmp_path, engine_url, **overrides):
    rows = [{"q": "flat one", "a": "42"}, {"q": "good one", "a": "42"}, {"q": "good two", "a": "42"}]
    values = dict(
        prompt_data=_prompts(tmp_path, rows),
        input_key="q",
        label_key="a",
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        over_sampling_batch_size=1,
        rollout_engine_urls=[engine_url],
        rm_type="exact-match",
        dynamic_sampling_filter_path="nonzero-std",
        rollout_sample_filter_path=None,
        rollout_all_samples_process_path=None,
        rollout_data_transport="object-store",
        rollout_max_response_len=8,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def test_generate_rollout_filters_zero_variance_groups_over_http(tmp_path, engine_url):
    args = _args(tmp_path, engine_url)
    source = RolloutDataSourceWithBuffer(args)
    output, aborted = asyncio.run(sglang_rollout.generate_rollout_async(args, 0, source.get_samples))
    assert aborted == []
    groups = output.samples
    assert len(groups) == 2
    assert all("good" in sample.prompt for group in groups for sample in group)
    assert sorted(s.reward for g in groups for s in g) == [0.0, 0.0, 1.0, 1.0]
    sample = groups[0][0]
    assert sample.tokens == [5, 6] and sample.response_length == 2 and sample.loss_mask == [1, 1]
    assert sample.rollout_log_probs == [-0.5, -0.25] and sample.weight_versions == ["3"]
    assert sample.status == Sample.Status.COMPLETED
    assert output.metrics["rollout/dynamic_filter/drop_zero_std"] == 1
    assert _Engine.requests[0]["sampling_params"]["max_new_tokens"] == 8


def test_straw_rollout_publishes_kept_groups(tmp_path, engine_url):
    args = _args(tmp_path, engine_url, rollout_data_transport="straw", rollout_data_dir=str(tmp_path / "pool"))
    source = RolloutDataSourceWithBuffer(args)
    output = sglang_rollout.generate_rollout(args, 0, source)
    assert isinstance(output.samples, DiskPayloadRef)
    restored = load_rollout_samples(output.samples)
    assert [group[0].group_index for group in restored] == [1, 2]


def test_engine_error_is_reported_with_the_url(tmp_path):
    args = _args(tmp_path, "http://127.0.0.1:9", dynamic_sampling_filter_path=None)
    source = RolloutDataSourceWithBuffer(args)
    with pytest.raises(RuntimeError, match="Rollout engine http://127.0.0.1:9/generate failed"):
        asyncio.run(sglang_rollout.generate_rollout_async(args, 0, source.get_samples))


def test_missing_engine_urls_is_a_clear_error(tmp_path):
    args = _args(tmp_path, "unused", rollout_engine_urls=[])
    with pytest.raises(RuntimeError, match="rollout_engine_urls"):
        sglang_rollout.GenerateState(args)


def test_rollout_settings_keep_greedy_sampling_apply_eval_overrides_and_name_bad_flags():
    settings = RolloutSettings.from_args(
        SimpleNamespace(rollout_batch_size=3, rollout_temperature=0.0, eval_top_k=5, eval_max_response_len=32)
    )
    assert settings.over_sampling_batch_size == 3  # defaults to the batch size
    assert settings.sampling_params() == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 16}
    evaluation = {"temperature": 0.0, "top_p": 1.0, "top_k": 5, "max_new_tokens": 32}
    assert settings.sampling_params(evaluation=True) == evaluation
    for attributes, message in (
        ({"rollout_batch_size": 0}, "--rollout-batch-size must be >= 1, got 0"),
        ({"sglang_server_concurrency": 0}, "--sglang-server-concurrency must be >= 1, got 0"),
        ({"rollout_top_p": 1.5}, "--rollout-top-p must be <= 1, got 1.5"),
        ({"rollout_http_timeout": 0}, "--rollout-http-timeout must be > 0.0, got 0.0"),
        ({"n_samples_per_prompt": "two"}, "--n-samples-per-prompt must be int, got 'two'"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            RolloutSettings.from_args(SimpleNamespace(**attributes))


def test_rewards_and_dispatch():
    args = SimpleNamespace(rm_type="math", custom_rm_path=None, reward_key=None)
    assert math_reward(args, Sample(response="first 3, so \\boxed{1/2}", label="0.5")) == 1.0
    assert math_reward(args, Sample(response="I think 41", label="42")) == 0.0
    assert math_reward(args, Sample(response="no number", label="42")) == 0.0
    with pytest.raises(ValueError, match="holds no number"):
        math_reward(args, Sample(response="1", label="no number"))
    assert exact_match(args, Sample(response=" yes ", label="yes")) == 1.0
    with pytest.raises(ValueError, match="needs a label"):
        exact_match(args, Sample(response="yes"))
    assert asyncio.run(rm_hub.batched_async_rm(args, [Sample(response="42", label="42")])) == [1.0]
    custom = SimpleNamespace(custom_rm_path="slime.plugins.rollout_builtins.exact_match", rm_type=None)
    assert asyncio.run(rm_hub.async_rm(custom, Sample(response="a", label="b"))) == 0.0
    with pytest.raises(ValueError, match="No reward function configured"):
        rm_hub.resolve_reward_function(SimpleNamespace())


def test_nonzero_std_filter():
    args = SimpleNamespace(reward_key=None)
    assert nonzero_std(args, [Sample(reward=1), Sample(reward=0)]).keep
    verdict = nonzero_std(args, [Sample(reward=1), Sample(reward=1)])
    assert not verdict.keep and verdict.reason == "zero_std"


def test_data_source_cursor_resumes_across_epochs(tmp_path):
    rows = [{"input": f"p{i}", "label": i, "metadata": {"i": i}} for i in range(3)]
    args = SimpleNamespace(
        prompt_data=_prompts(tmp_path, rows),
        label_key="label",
        n_samples_per_prompt=2,
        rollout_shuffle=True,
        rollout_seed=1,
        save=str(tmp_path / "ckpt"),
        load=str(tmp_path / "ckpt"),
    )
    source = RolloutDataSource(args)
    first = source.get_samples(2)
    assert [s.index for g in first for s in g] == [0, 1, 2, 3]
    assert all(g[0].prompt == g[1].prompt and g[0].group_index == g[1].group_index for g in first)
    assert first[0][0].metadata["i"] == int(first[0][0].label)
    source.save(4)
    assert (tmp_path / "ckpt" / "rollout" / "global_dataset_state_dict_4.pt").is_file()
    expected = [[s.prompt for s in g] for g in source.get_samples(3)]  # crosses into epoch 1
    resumed = RolloutDataSource(args)
    resumed.load(4)
    assert [[s.prompt for s in g] for g in resumed.get_samples(3)] == expected
    assert resumed.epoch_id == 1
    with pytest.raises(FileNotFoundError, match="No data source state"):
        resumed.load(5)


def test_data_source_buffer_and_bad_input(tmp_path):
    args = SimpleNamespace(prompt_data=_prompts(tmp_path, [{"input": "a"}, {"input": "b"}]), apply_chat_template=True)
    source = RolloutDataSourceWithBuffer(args)
    group = source.get_samples(1)[0]
    assert group[0].prompt == [{"role": "user", "content": "a"}]
    source.add_samples([group])
    assert source.get_samples(2)[0] is group
    with pytest.raises(TypeError, match="list of groups"):
        source.add_samples([Sample()])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        RolloutDataSource(SimpleNamespace(prompt_data=str(bad)))
    with pytest.raises(KeyError, match="no 'question' field"):
        RolloutDataSource(SimpleNamespace(prompt_data=str(tmp_path / "prompts.jsonl"), input_key="question"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RolloutDataSource(SimpleNamespace(prompt_data=str(tmp_path / "missing.jsonl")))
    with pytest.raises(ValueError, match="needs --prompt-data"):
        RolloutDataSource(SimpleNamespace())


def test_fully_async_worker_generates_in_the_background(tmp_path, engine_url):
    from slime.rollout import fully_async_rollout

    args = _args(tmp_path, engine_url, sglang_server_concurrency=4)
    source = RolloutDataSourceWithBuffer(args)
    try:
        groups = fully_async_rollout.generate_rollout_fully_async(args, 0, source).samples
        assert len(groups) == 2 and all("good" in g[0].prompt for g in groups)
        worker = source.consumers["fully_async"]
        worker.pause(drain=True)
        assert worker.error is None
        state = worker.state_dict()
        assert all(len(group) == 2 for group in state["ready"])
        with pytest.raises(ValueError, match="no evaluation mode"):
            fully_async_rollout.generate_rollout_fully_async(args, 0, source, evaluation=True)
    finally:
        source.consumers["fully_async"].close()


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ({"text": "a", "output_ids": [5], "meta_info": {}}, "expected a JSON list of 2 answers"),
        ([{"text": "a", "output_ids": [5], "meta_info": {}}], "expected a JSON list of 2 answers"),
        ([{"text": "a", "output_ids": [5], "meta_info": {}}, {"output_ids": ["x"]}], "not a list of token ids"),
    ],
)
def test_a_batched_reply_is_used_only_when_every_answer_is_there_and_valid(answer, message) -> None:
    import httpx

    from slime.rollout.sglang_rollout import _parse_replies

    with pytest.raises(ValueError, match=message):
        _parse_replies(httpx.Response(200, json=answer), 2)
    good = [
        {"text": t, "output_ids": [i], "meta_info": {"finish_reason": {"type": "stop"}}} for i, t in enumerate("ab")
    ]
    assert [reply.text for reply in _parse_replies(httpx.Response(200, json=good), 2)] == ["a", "b"]
