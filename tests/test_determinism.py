"""`--deterministic`: per-sample seeds, issue-order groups, the components that may take part, the resume record."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime.data.data_source import RolloutDataSourceWithBuffer
from slime.determinism import RECORD_FILE, check_deterministic_run, check_reproducible_resume, sample_seed
from slime.plugin_manager import PluginSelection, build_plugin_manager, collect_registry
from slime.rollout import sglang_rollout
from slime.utils.arguments import parse_args
from slime.utils.types import Sample


def test_sample_seeds_depend_on_what_identifies_a_sample_and_nothing_else() -> None:
    seed = sample_seed(42, 3, 25, 7)
    assert seed == sample_seed(42, 3, 25, 7) and 0 <= seed < 2**63
    others = {
        sample_seed(43, 3, 25, 7),
        sample_seed(42, 4, 25, 7),
        sample_seed(42, 3, 26, 7),
        sample_seed(42, 3, 25, 8),
    }
    assert seed not in others and len(others) == 4
    # Pinned: a seed that changed between versions would make an old run's resume diverge.
    assert sample_seed(0, 0, 0, 0) == 0x1B9367A9C54EE6BE


# ------------------------------------------------------------------------------------- the rollout function


class _SlowFirstEngine(BaseHTTPRequestHandler):
    """An SGLang-protocol engine that answers prompts containing "slow" late (so the first group submitted finishes
    last) and records every request body; a batched body (a list of texts) gets a list of answers."""

    requests: list = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/generate":
            type(self).requests.append(body)
            if "slow" in str(body["text"]):
                time.sleep(0.3)
        answer = {
            "text": "42",
            "output_ids": [5],
            "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 5, None]]},
        }
        reply = [answer] * len(body["text"]) if isinstance(body.get("text"), list) else answer
        data = json.dumps(reply if self.path == "/generate" else {}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def slow_first_engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowFirstEngine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _SlowFirstEngine.requests = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _rollout_args(tmp_path: Path, url: str, deterministic: bool) -> SimpleNamespace:
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"q": "slow one", "a": "42"}, {"q": "fast two", "a": "42"}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return SimpleNamespace(
        prompt_data=str(prompts),
        input_key="q",
        label_key="a",
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        rollout_engine_urls=[url],
        rm_type="exact-match",
        rollout_data_transport="object-store",
        deterministic=deterministic,
        rollout_seed=9,
    )


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_rollouts_seed_each_sample_and_keep_the_first_issued_groups(
    tmp_path: Path, slow_first_engine: str, deterministic: bool
) -> None:
    """One group kept of two generated: the first issued under --deterministic (the slow one), else the first done."""
    args = _rollout_args(tmp_path, slow_first_engine, deterministic)
    args.rollout_batch_size, args.over_sampling_batch_size = 1, 2
    source = RolloutDataSourceWithBuffer(args)
    output, aborted = asyncio.run(sglang_rollout.generate_rollout_async(args, 3, source.get_samples))
    (kept,) = output.samples
    (handed_back,) = aborted
    requests = _SlowFirstEngine.requests
    if deterministic:
        # One batched request per group, each input with its own seed.
        assert sorted(request["text"] for request in requests) == [["fast two"] * 2, ["slow one"] * 2]
        seeds = [params["sampling_seed"] for request in requests for params in request["sampling_params"]]
        assert kept[0].prompt == "slow one" and handed_back[0].prompt == "fast two"
        samples = [*kept, *handed_back]
        assert sorted(seeds) == sorted(sample_seed(9, s.group_index, s.index, 3) for s in samples)
        assert len(set(seeds)) == 4
        # The handed-back group finished, but whether it had is timing: its answers are dropped.
        assert all(s.response == "" and s.status == Sample.Status.PENDING for s in handed_back)
    else:
        assert kept[0].prompt == "fast two" and handed_back[0].prompt == "slow one"
        assert sorted(request["text"] for request in requests) == ["fast two"] * 2 + ["slow one"] * 2
        assert [request["sampling_params"].get("sampling_seed") for request in requests] == [None] * 4


def test_handed_back_samples_forget_their_partial_answers_under_deterministic() -> None:
    sample = Sample(tokens=[1, 2, 3, 7, 8], response="ab", response_length=2, loss_mask=[1, 1], reward=0.5)
    sample.rollout_log_probs, sample.weight_versions = [-0.1, -0.2], ["4"]
    sample.status = Sample.Status.ABORTED
    sample.discard_generation()
    assert sample.tokens == [1, 2, 3] and (sample.response, sample.response_length) == ("", 0)
    assert sample.loss_mask is None and sample.rollout_log_probs is None and sample.reward is None
    assert sample.weight_versions == [] and sample.status == Sample.Status.PENDING


# ------------------------------------------------------------------------------------- who may take part


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rollout-function-path", "fully-async"], r"the rollout function 'fully-async' .* does not declare"),
        (
            ["--rollout-function-path", "json.loads"],
            r"rollout function 'json.loads' \(--rollout-function-path\) is not",
        ),
        (["--custom-generate-function-path", "json.loads"], r"--custom-generate-function-path json.loads sends its"),
        (["--cpu-engine-batch-wait-ms", "4"], r"drop --cpu-engine-batch-wait-ms 4"),
    ],
)
def test_components_that_cannot_honour_deterministic_are_refused_at_parse_time(
    tmp_path: Path, capsys: pytest.CaptureFixture, extra: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--plugin", "straw", "--save", str(tmp_path / "run"), "--deterministic", *extra])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "--deterministic" in error
    assert re.search(message, error), error


def test_the_demos_deterministic_default_is_dropped_with_a_warning_where_it_cannot_hold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="slime.determinism"):
        args = parse_args(
            ["--plugin", "straw", "--save", str(tmp_path / "run"), "--rollout-function-path", "fully-async"]
        )
    assert args.deterministic is False
    assert "--deterministic (a plugin's default) is off for this run" in caplog.text
    assert "the rollout function 'fully-async'" in caplog.text


@pytest.mark.parametrize(
    ("option", "value", "label"),
    [("rollout_engine", "sglang", "rollout engine"), ("train_backend", "megatron", "train backend")],
)
def test_engines_and_backends_without_a_deterministic_check_are_refused(option: str, value: str, label: str) -> None:
    registry = collect_registry(build_plugin_manager(PluginSelection()))
    args = SimpleNamespace(deterministic=True, explicit_options=frozenset({"deterministic"}), **{option: value})
    with pytest.raises(
        ValueError, match=rf"--deterministic: the {label} '{value}' \(plugin '[\w.]+'\) does not declare"
    ):
        check_deterministic_run(args, registry)
    check_deterministic_run(SimpleNamespace(deterministic=False, **{option: value}), registry)


def test_the_demo_is_deterministic_and_a_user_may_turn_it_off(tmp_path: Path) -> None:
    assert parse_args(["--plugin", "straw", "--save", str(tmp_path / "a")]).deterministic is True
    args = parse_args(
        [
            "--plugin",
            "straw",
            "--save",
            str(tmp_path / "b"),
            "--no-deterministic",
            "--rollout-function-path",
            "fully-async",
        ]
    )
    assert args.deterministic is False


# ------------------------------------------------------------------------------------- the resume record


def test_a_deterministic_save_directory_refuses_a_changed_seed_or_batch_shape(tmp_path: Path) -> None:
    save = tmp_path / "run"
    args = parse_args(["--plugin", "straw", "--save", str(save)])
    check_reproducible_resume(save, args)
    record = json.loads((save / RECORD_FILE).read_text())
    assert record["options"]["rollout_seed"] == 42 and record["options"]["rollout_batch_size"] == 16
    check_reproducible_resume(save, args)  # the same command resumes

    changed = parse_args(
        ["--plugin", "straw", "--save", str(save), "--rollout-seed", "7", "--n-samples-per-prompt", "4"]
    )
    with pytest.raises(ValueError) as refused:
        check_reproducible_resume(save, changed)
    text = str(refused.value)
    assert "--rollout-seed 7 (recorded: 42)" in text and "--n-samples-per-prompt 4 (recorded: 8)" in text
    assert str(save / RECORD_FILE) in text and "--no-deterministic" in text

    relaxed = parse_args(["--plugin", "straw", "--save", str(save), "--rollout-seed", "7", "--no-deterministic"])
    check_reproducible_resume(save, relaxed)  # not reproducible any more, by the user's choice
    assert json.loads((save / RECORD_FILE).read_text()) == record


def test_a_damaged_record_names_the_file(tmp_path: Path) -> None:
    save = tmp_path / "run"
    save.mkdir()
    (save / RECORD_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=f"{save / RECORD_FILE} is not a readable reproducibility record"):
        check_reproducible_resume(save, parse_args(["--plugin", "straw", "--save", str(save)]))


def test_slime_run_refuses_a_changed_seed_before_ray_starts(tmp_path: Path) -> None:
    import subprocess
    import sys

    save = tmp_path / "run"
    check_reproducible_resume(save, parse_args(["--plugin", "straw", "--save", str(save)]))
    result = subprocess.run(
        [sys.executable, "-m", "slime.cli", "--plugin", "straw", "--save", str(save), "--rollout-seed", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert "slime-run: error: this --deterministic run cannot continue" in result.stderr
    assert "Traceback" not in result.stderr and "Started a local Ray instance" not in result.stderr + result.stdout
