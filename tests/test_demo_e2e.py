"""The main job: the demo's configuration, its report, and `slime-run --plugin straw` end to end.

The end-to-end tests start the real command in its own process group (its own local Ray instance) and judge
the run from what it left on disk: joint commit markers, the batch builder's consumer records, the metrics.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime.observability.phase_timer import PhaseTimer
from slime.plugins.demo import DEMO_GLOBAL_BATCH_SIZE, prepare_demo_files
from slime.plugins.demo_report import RunReport, plot_reward_curve, read_metrics, reward_by_step
from slime.testing import run_records
from slime.utils.arguments import parse_args
from slime.utils.external_utils.slime_run_process import SlimeRunProcess

NUM_ROLLOUT = 4
RUN_TIMEOUT_S = 240


def _start(save: Path, log: Path, *extra: str) -> SlimeRunProcess:
    args = ["--plugin", "straw", "--num-rollout", str(NUM_ROLLOUT), "--save-interval", "1", "--save", str(save)]
    return SlimeRunProcess([*args, *extra], log, cwd=save.parent)


def test_demo_configures_a_run_without_model_or_prompts(tmp_path: Path) -> None:
    save = tmp_path / "out"
    args = parse_args(["--plugin", "straw", "--save", str(save), "--num-rollout", "3", "--rollout-batch-size", "2"])
    assert args.hf_checkpoint == str(save / "model") and args.prompt_data == str(save / "prompts.jsonl")
    assert not save.exists(), "parsing arguments must not write files"
    prepare_demo_files(args)
    assert (save / "model" / "slime_tiny_model.json").exists() and (save / "prompts.jsonl").exists()
    eval_files = {"copy-unseen": str(save / "eval_copy-unseen.jsonl"), "copy-all": str(save / "eval_copy-all.jsonl")}
    assert args.eval_prompt_data == [part for split in eval_files.items() for part in split]
    assert all(Path(path).exists() for path in eval_files.values())
    assert (args.eval_interval, args.n_samples_per_eval_prompt, args.eval_function_path) == (20, 4, "sglang")
    unseen = {json.loads(line)["label"] for line in Path(eval_files["copy-unseen"]).read_text().splitlines()}
    trained = {json.loads(line)["label"] for line in (save / "prompts.jsonl").read_text().splitlines()}
    assert unseen and not unseen & trained, "the unseen split holds only prompts the run never trains on"
    assert len(Path(eval_files["copy-all"]).read_text().splitlines()) == 64
    assert (args.input_key, args.label_key, args.rm_type) == ("input", "label", "copy")
    assert args.num_rollout == 3 and args.rollout_batch_size == 2  # given explicitly: kept
    assert args.global_batch_size == 2 * args.n_samples_per_prompt
    assert args.save_interval == 10 and args.update_weight_disk_dir == str(save / "weights") and args.lr == 2e-3
    assert args.entropy_coef == 0.05 and args.lr_decay_style == "constant"
    assert args.rollout_data_dir is None  # the straw transport places its pool when it resolves the restore
    from slime.interfaces import run_transport

    run_transport(args).resolve_restore()
    assert args.rollout_data_dir == str(save / "rollout_data")
    assert args.metrics_dir == str(save)

    prompts = (save / "prompts.jsonl").stat().st_mtime_ns
    again = parse_args(["--plugin", "straw", "--save", str(save)])
    prepare_demo_files(again)
    assert (save / "prompts.jsonl").stat().st_mtime_ns == prompts, "a rerun must reuse the demo prompts"
    assert again.num_rollout == 150 and again.global_batch_size == DEMO_GLOBAL_BATCH_SIZE


def test_demo_leaves_a_users_run_alone(tmp_path: Path) -> None:
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"q": "x", "a": "y"}\n')
    argv = ["--plugin", "straw", "--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(prompts)]
    args = parse_args([*argv, "--rm-type", "copy", "--input-key", "q"])
    assert args.save is None and args.num_rollout is None and args.label_key is None
    assert args.update_weight_disk_dir is None and args.rollout_data_dir is None
    assert not (tmp_path / "model").exists()


def test_report_reads_torn_metrics_and_keeps_the_latest_reward_per_step(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "rollout/reward": 0.1}, {"step": 1, "rollout/reward": 0.2}, {"step": 1, "train/loss": 1.0}]
    lines.append({"step": 1, "rollout/reward": 0.3})  # step 1 trained again after a resume
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 2, "rollout/rew')
    records = read_metrics(metrics)
    assert len(records) == 4
    assert reward_by_step(records) == {0: 0.1, 1: 0.3}
    curve = plot_reward_curve(reward_by_step(records), tmp_path / "reward_curve.png")
    assert curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_phase_timer_adds_up_repeated_phases_and_names_them_as_metrics() -> None:
    timer = PhaseTimer()
    with timer.phase("store"):
        time.sleep(0.01)
    with pytest.raises(RuntimeError), timer.phase("store"):
        raise RuntimeError("the time was spent all the same")
    with timer.phase("train"):
        pass
    metrics = timer.metrics()
    assert set(metrics) == {"perf/store_time", "perf/train_time"}
    assert metrics["perf/store_time"] >= 0.01 and metrics["perf/train_time"] >= 0.0


def test_report_logs_phase_times_and_closes_at_the_last_step(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = SimpleNamespace(num_rollout=2, start_rollout_id=0, save=str(tmp_path), metrics_dir=str(tmp_path))
    report = RunReport(args)
    report.after_rollout(0, {"rollout/reward": 0.25})
    report.after_train_step(0, {"train/loss": 0.5, "note": "not a number"})
    report.step_end(0, {"perf/step_time": 1.5, "perf/train_time": 1.0})
    assert not report.finished
    report.after_rollout(1, {"rollout/reward": 0.75})
    report.checkpoint_committed(1, str(tmp_path))
    report.step_end(1, {"perf/step_time": 1.25})
    assert report.finished
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert {"step": 0, "perf/step_time": 1.5, "perf/train_time": 1.0}.items() <= records[1].items()
    assert "note" not in records[0] and records[0]["train/loss"] == 0.5
    output = capsys.readouterr().out
    assert "slime-run finished" in output and "last commit:  step 1  (complete" in output


@pytest.mark.e2e
@pytest.mark.slow
def test_demo_runs_end_to_end_and_evaluates_without_touching_the_training_data(tmp_path: Path) -> None:
    save = tmp_path / "run"
    log = tmp_path / "run.log"
    _start(save, log, "--eval-interval", "2").finish(RUN_TIMEOUT_S)

    # Evaluations before step 0 and after steps 1 and 3 drew nothing from the training prompts or the queue.
    run_records.assert_trained_once(save, list(range(NUM_ROLLOUT)))
    run_records.assert_audit_clean(save)
    evals = [record for record in read_metrics(save / "metrics.jsonl") if "eval/copy-all/reward" in record]
    assert [record["step"] for record in evals] == [0, 1, 3]
    for record in evals:
        assert 0.0 <= record["eval/copy-all/pass@1"] <= record["eval/copy-all/pass@4"] <= 1.0
        assert "eval/copy-unseen/reward" in record
    steps = [step for step, _ in run_records.rewards(save)]
    assert steps == list(range(NUM_ROLLOUT))
    assert (save / "reward_curve.png").stat().st_size > 0
    assert (save / "model" / "slime_tiny_model.json").exists()
    output = log.read_text()
    assert "slime-run finished" in output and str(save / "reward_curve.png") in output
    assert "| eval copy-unseen " in output and "  eval copy-all: " in output

    # Eval-only: the committed weights of step 3 evaluated again (the demo's seeded sampling: the same scores), and
    # nothing trained or committed.
    _start(save, tmp_path / "eval.log", "--eval-only").finish(RUN_TIMEOUT_S)
    again = [record for record in read_metrics(save / "metrics.jsonl") if "eval/copy-all/reward" in record][-1]
    assert again["step"] == 3 and again["eval/copy-all/reward"] == evals[-1]["eval/copy-all/reward"]
    run_records.assert_trained_once(save, list(range(NUM_ROLLOUT)))
    assert "slime-run evaluated the weights of step 3" in (tmp_path / "eval.log").read_text()
