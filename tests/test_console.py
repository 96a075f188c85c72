"""What `slime-run` prints: per-step metrics at DEBUG, a summary line every `--log-interval` steps, `--verbose`."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime.observability import logging_utils
from slime.observability.logging_utils import CHATTY_LOGGERS, configure_logger, log_metrics, verbose_requested
from slime.plugins.demo import configure_demo
from slime.plugins.demo_report import ReportSettings, RunReport, summary_line
from slime.utils.arguments import parse_args

LOGGERS = ("", "slime", "httpx", *CHATTY_LOGGERS)


@pytest.fixture
def restore_levels() -> Iterator[None]:
    levels = {name: logging.getLogger(name).level for name in LOGGERS}
    handlers = list(logging.getLogger().handlers)
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger().handlers[:] = handlers


def test_log_metrics_logs_at_debug_and_still_writes_the_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    args = SimpleNamespace(metrics_dir=str(tmp_path), save=None)
    with caplog.at_level(logging.DEBUG, logger=logging_utils.__name__):
        log_metrics(args, 3, {"train/loss": 0.5})
    logging_utils.finish_tracking(args)
    assert [(record.levelno, record.getMessage()) for record in caplog.records] == [
        (logging.DEBUG, "step 3: {'train/loss': 0.5}")
    ]
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert {"step": 3, "train/loss": 0.5}.items() <= json.loads(line).items()


def _report(tmp_path: Path, num_rollout: int, log_interval: int) -> RunReport:
    save = str(tmp_path)
    args = SimpleNamespace(
        num_rollout=num_rollout, start_rollout_id=0, save=save, metrics_dir=save, log_interval=log_interval
    )
    return RunReport(args)


def test_the_report_prints_a_summary_every_log_interval_steps(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    report = _report(tmp_path, num_rollout=5, log_interval=2)
    summaries = []
    for step in range(5):
        report.after_rollout(step, {"rollout/reward": 0.1 * step})
        report.after_train_step(step, {"loss": 1.0 + step, "grad_norm": 0.5, "train/entropy": 2.0})
        if step == 2:
            report.checkpoint_committed(step, str(tmp_path))
        report.step_end(step, {"perf/step_time": 1.0 + step})
        summaries.append([line for line in capsys.readouterr().err.splitlines() if line.startswith("step")])
    assert summaries[0] == [] and summaries[2] == []
    assert summaries[1] == ["steps 0-1 | reward 0.050 | 1.5s/step | loss 2 grad_norm 0.5 entropy 2 | no commit yet"]
    assert summaries[3] == ["steps 2-3 | reward 0.250 | 3.5s/step | loss 4 grad_norm 0.5 entropy 2 | last commit 2"]
    # The last step closes a partial interval.
    assert summaries[4] == ["step 4 | reward 0.400 | 5.0s/step | loss 5 grad_norm 0.5 entropy 2 | last commit 2"]
    assert report.finished


def test_evals_show_in_their_intervals_summary_the_closing_lines_and_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    report = _report(tmp_path, num_rollout=4, log_interval=2)

    def evaluate(step: int, reward: float) -> None:
        metrics = {"eval/held/reward": reward, "eval/held/pass@1": reward / 2}
        log_metrics(report.args, step, metrics)  # as the rollout manager does
        report.after_eval(step, metrics)

    evaluate(0, 0.125)
    for step in range(4):
        log_metrics(report.args, step, {"rollout/reward": 0.5})
        report.after_rollout(step, {"rollout/reward": 0.5})
        if step == 3:
            evaluate(3, 0.75)
        report.step_end(step, {})
    logging_utils.finish_tracking(report.args)
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if line.startswith("step")] == [
        "steps 0-1 | reward 0.500 | eval held 0.125 | no commit yet",
        "steps 2-3 | reward 0.500 | eval held 0.750 | no commit yet",
    ]
    assert "  eval held: 0.125 (step 0) -> 0.750 (step 3)" in out
    assert (tmp_path / "reward_curve.png").stat().st_size > 0


def test_a_summary_leaves_out_what_the_interval_did_not_report() -> None:
    assert summary_line((0, 9), [], [], {"train/kl": 0.0}, None) == "steps 0-9 | reward ? | no commit yet"


def test_a_summary_shows_the_kl_penalty_and_the_critics_value_loss_when_the_run_has_them() -> None:
    ppo = {"train/loss": -0.5, "critic/value_loss": 0.0123, "train/kl_reward": 0.02, "critic/values": 0.3}
    line = summary_line((10, 19), [0.5], [1.0], ppo, 19)
    shown = "loss -0.5 kl_reward 0.02 value_loss 0.0123"
    assert line == f"steps 10-19 | reward 0.500 | 1.0s/step | {shown} | last commit 19"


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_log_interval_below_one_is_refused_when_the_arguments_are_parsed(
    capsys: pytest.CaptureFixture, value: str
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--plugin", "straw", "--log-interval", value])
    assert "slime-run: error: argument --log-interval: must be" in capsys.readouterr().err


def test_log_interval_defaults_to_ten_and_the_settings_check_it() -> None:
    args = parse_args(["--plugin", "straw"])
    assert args.log_interval == 10 and args.verbose is False
    with pytest.raises(ValueError, match="^--log-interval must be >= 1, got 0$"):
        ReportSettings.from_args(SimpleNamespace(log_interval=0))


def test_verbose_requested_reads_the_flag_before_parsing() -> None:
    assert verbose_requested(["--plugin", "straw", "--verbose"]) and not verbose_requested(["--plugin", "straw"])


@pytest.mark.usefixtures("restore_levels")
def test_verbose_shows_the_runs_debug_lines_and_library_info() -> None:
    configure_logger()
    assert not logging.getLogger("slime.observability.logging_utils").isEnabledFor(logging.DEBUG)
    assert all(logging.getLogger(name).getEffectiveLevel() == logging.WARNING for name in CHATTY_LOGGERS)
    configure_logger(verbose=True)
    assert logging.getLogger("slime.observability.logging_utils").isEnabledFor(logging.DEBUG)
    assert all(logging.getLogger(name).getEffectiveLevel() == logging.INFO for name in CHATTY_LOGGERS)
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING


def test_quiet_progress_bars_keeps_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TQDM_DISABLE", "0")
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    logging_utils.quiet_progress_bars()
    assert logging_utils.os.environ["TQDM_DISABLE"] == "0"
    assert logging_utils.os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


def test_the_demo_logs_one_info_line_for_its_options(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    args = SimpleNamespace(save=str(tmp_path), explicit_options=frozenset({"save", "lr"}))
    with caplog.at_level(logging.DEBUG, logger="slime.plugins.demo"):
        configure_demo(args)
    info = [record.getMessage() for record in caplog.records if record.levelno == logging.INFO]
    debug = [record.getMessage() for record in caplog.records if record.levelno == logging.DEBUG]
    assert len(info) == 1 and info[0].startswith(f"demo: set {len(debug)} options")
    assert "demo sets --rm-type=copy" in debug and not any("--lr=" in line for line in debug)


RAY_START = """
import logging, sys
from slime.cli import request_ray_token_auth
request_ray_token_auth()
import os, ray
ray.init(num_cpus=1, logging_level=logging.WARNING)
assert ray.get(ray.remote(lambda: 1).remote()) == 1
ray.shutdown()
print("auth mode", os.environ.get("RAY_AUTH_MODE"))
"""


def _start_ray_in_a_new_process(env: dict[str, str]) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    return subprocess.run(
        [sys.executable, "-c", RAY_START], env={**environment, **env}, capture_output=True, text=True, timeout=180
    )


@pytest.mark.slow
def test_a_runs_local_ray_cluster_keeps_token_auth_without_rays_warning() -> None:
    result = _start_ray_in_a_new_process({})
    assert result.returncode == 0, result.stderr
    assert "auth mode token" in result.stdout
    assert "Token authentication is enabled" not in result.stderr


@pytest.mark.slow
def test_a_users_ray_auth_mode_is_kept() -> None:
    result = _start_ray_in_a_new_process({"RAY_AUTH_MODE": "disabled"})
    assert result.returncode == 0, result.stderr
    assert "auth mode disabled" in result.stdout
