"""`slime-run runs compare A B`: two runs' metrics, trained samples and final weights, step by step.

The unit tests build synthetic save directories (a `metrics.jsonl`, checkpoints written with safetensors, and
for trained samples a stand-in for `run_comparison.trained_samples`); the end-to-end test compares real demo runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from slime.cli import main
from slime.data import run_comparison
from slime.data.run_comparison import SampleIdentity, TrainedSamples, compare_samples, is_timing_metric

#: What the demo writes to metrics.jsonl (besides "step"), from `slime-run --plugin straw --num-rollout 3`.
DEMO_KEYS = [
    "checkpoint/committed",
    "perf/convert_time",
    "perf/generate_time",
    "perf/save_time",
    "perf/step_time",
    "perf/store_time",
    "perf/train_data_load_time",
    "perf/train_time",
    "perf/update_weights_time",
    "rollout/num_samples",
    "rollout/response_length",
    "rollout/reward",
    "rollout/time",
    "time",
    "train/clipfrac",
    "train/entropy",
    "train/grad_norm",
    "train/kl",
    "train/loss",
    "train/lr",
    "train/pg_loss",
    "train/ppo_ratio",
    "train/rollout_id",
    "train/rollout_logprob_abs_diff",
    "train/skipped_steps",
    "train/steps",
]


def _lines(steps: int = 3) -> list[dict]:
    """A run's metrics lines: rollout, train and timing lines per step, like the demo's."""
    lines = []
    for step in range(steps):
        lines.append({"step": step, "rollout/reward": 0.25 * step, "rollout/time": 1.0 + step, "time": 100.0 + step})
        lines.append({"step": step, "train/loss": 0.2134 + step, "train/grad_norm": 0.5, "perf/train_time": 0.3})
        lines.append({"step": step, "checkpoint/committed": step})
    return lines


def _tensors(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=generator),
        "lm_head.weight": torch.randn(8, 4, generator=generator),
    }


def _run(save: Path, lines: list[dict] | None = None, steps: int = 3, torn: bool = False) -> Path:
    """A save directory like an object-store run's: metrics.jsonl, a tracker and `iter_<step>/model.safetensors`."""
    save.mkdir(parents=True)
    text = "".join(json.dumps(line) + "\n" for line in (lines if lines is not None else _lines(steps)))
    (save / "metrics.jsonl").write_text(text + ('{"step": 2, "rollout/rew' if torn else ""))
    for step in range(steps):
        directory = save / f"iter_{step:07d}"
        directory.mkdir()
        save_file(_tensors(step), str(directory / "model.safetensors"))
    (save / "latest_checkpointed_iteration.txt").write_text(str(steps - 1))
    return save


def _compare(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    status = main(["runs", "compare", *map(str, argv)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return status, captured.out


def _verdict(text: str) -> str:
    return text.rstrip().splitlines()[-1]


def test_identical_runs_exit_0(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    status, text = _compare(capsys, a, b)
    assert status == 0, text
    assert _verdict(text) == "IDENTICAL: 3 steps, every metric and weight tensor equal (sample ids not recorded)"
    assert "weights: step 2 in both: 2 tensors equal" in text
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("1 "))
    assert row == ["1", "0.25", "0.25", "1.2134", "1.2134", "-", "-"]


def test_a_metric_that_differs_at_step_2_is_the_divergence(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lines = _lines()
    lines[7]["train/loss"] = 2.2135  # step 2's train line: A has 2.2134
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b", lines)
    status, text = _compare(capsys, a, b)
    assert status == 1
    assert _verdict(text) == "DIVERGE at step 2: train/loss 2.2134 vs 2.2135"
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("2 "))
    assert row[-1] == "train/loss"

    assert main(["runs", "compare", str(a), str(b), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["identical"] is False
    assert report["first_divergence"] == {"step": 2, "differences": ["train/loss 2.2134 vs 2.2135"]}
    assert [step["differing_metrics"] for step in report["steps"]] == [{}, {}, {"train/loss": [2.2134, 2.2135]}]
    assert report["samples"] == {"a": run_comparison.NOT_RECORDED, "b": run_comparison.NOT_RECORDED}


def test_a_metric_only_one_run_logged_at_a_step_differs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lines = [line for line in _lines() if not (line["step"] == 1 and "train/loss" in line)]
    status, text = _compare(capsys, _run(tmp_path / "a"), _run(tmp_path / "b", lines))
    assert status == 1
    assert _verdict(text).startswith("DIVERGE at step 1: train/loss 1.2134 vs (absent)")


def test_a_rerun_of_a_step_counts_with_its_last_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A killed run logged step 1 (and part of step 2) with other values; the rerun logged them again."""
    killed = [line for line in _lines(2)]
    killed[3] = {**killed[3], "rollout/reward": 0.9}
    killed[4] = {**killed[4], "train/loss": 7.0}
    rerun = [line for line in _lines() if line["step"] >= 1]
    a = _run(tmp_path / "a", [*killed, {"step": 2, "rollout/reward": 0.1}, *rerun], torn=True)
    status, text = _compare(capsys, a, _run(tmp_path / "b"))
    assert status == 0, text
    assert _verdict(text).startswith("IDENTICAL: 3 steps")


def test_timing_keys_are_not_compared(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lines = _lines()
    for line in lines:
        for key in ("time", "rollout/time", "perf/train_time"):
            if key in line:
                line[key] *= 3
    status, text = _compare(capsys, _run(tmp_path / "a"), _run(tmp_path / "b", lines))
    assert status == 0, text
    assert "not compared (timing): perf/*, rollout/time, time" in text
    timing = [key for key in DEMO_KEYS if is_timing_metric(key)]
    assert timing == [key for key in DEMO_KEYS if key.startswith("perf/")] + ["rollout/time", "time"]
    for key in ("tokens_per_s", "rollout/throughput", "wall_seconds", "train/step_ms"):
        assert is_timing_metric(key), key


def test_weights_that_differ_in_one_tensor(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    tensors = _tensors(2)
    tensors["lm_head.weight"][3, 1] += 0.5
    save_file(tensors, str(b / "iter_0000002" / "model.safetensors"))
    status, text = _compare(capsys, a, b)
    assert status == 1
    verdict = _verdict(text)
    assert verdict.startswith("DIVERGE at step 2: weights of step 2: tensor lm_head.weight differs (max abs diff 0.5")
    assert "weights: step 2 in both: 1 of 2 tensors differ: lm_head.weight (max abs diff 0.5" in text


def test_sharded_weights_and_a_tensor_only_one_run_has(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    tensors = _tensors(2)
    for directory in (a / "iter_0000002", b / "iter_0000002"):
        (directory / "model.safetensors").unlink()
        save_file({"lm_head.weight": tensors["lm_head.weight"]}, str(directory / "model-00001-of-00002.safetensors"))
        save_file(
            {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"]},
            str(directory / "model-00002-of-00002.safetensors"),
        )
    status, text = _compare(capsys, a, b)
    assert status == 0 and "weights: step 2 in both: 2 tensors equal" in text, text
    save_file({"extra.bias": torch.zeros(2)}, str(b / "iter_0000002" / "model-extra.safetensors"))
    status, text = _compare(capsys, a, b)
    assert status == 1
    assert _verdict(text) == "DIVERGE at step 2: weights of step 2: tensor extra.bias exists only in B"


def test_last_checkpoints_at_different_steps_compare_the_latest_common_one(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    shutil.rmtree(b / "iter_0000002")
    (b / "latest_checkpointed_iteration.txt").write_text("1")
    status, text = _compare(capsys, a, b)
    assert status == 0, text
    assert (
        "weights: step 1 in both: 2 tensors equal (the last checkpoints differ (A: step 2, B: step 1); compared at "
        "step 1, the latest step both runs have a checkpoint of)" in text
    )


def test_weights_not_in_safetensors_form_are_not_compared(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    for save in (a, b):
        (save / "iter_0000002" / "model.safetensors").unlink()
        (save / "iter_0000002" / "dist").mkdir()
    status, text = _compare(capsys, a, b)
    assert status == 0, text
    note = (
        f"A's checkpoint of step 2 ({a / 'iter_0000002'}) holds no Hugging Face safetensors weights (a Megatron dist "
        "checkpoint): not comparable"
    )
    assert f"weights: not compared: {note}" in text
    assert (
        _verdict(text)
        == f"IDENTICAL: 3 steps, every metric equal (sample ids not recorded; weights not compared: {note})"
    )


def test_an_object_store_run_has_no_sample_records(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    (a / "rollout").mkdir()
    (a / "rollout" / "global_dataset_state_dict_2.pt").write_bytes(b"")  # what an object-store run keeps there
    assert run_comparison.trained_samples(a) == TrainedSamples(recorded=False)
    status, text = _compare(capsys, a, b)
    assert status == 0
    assert "sample ids: not recorded (the object-store transport keeps no durable record of trained samples)" in text


def _identities(step: int, count: int = 4, changed: int | None = None) -> list[SampleIdentity]:
    samples = []
    for offset in range(count):
        index = step * count + offset
        parts = ("t", "r", "w") if index != changed else ("T", "r", "w")
        samples.append(SampleIdentity(index, index // 2, "".join(parts), parts))
    return samples


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict[str, TrainedSamples]:
    """Trained samples per save directory name, in place of the straw records."""
    by_name: dict[str, TrainedSamples] = {}
    monkeypatch.setattr(run_comparison, "trained_samples", lambda save: by_name[Path(save).name])
    return by_name


def test_equal_trained_samples(tmp_path: Path, capsys: pytest.CaptureFixture, recorded: dict) -> None:
    recorded["a"] = recorded["b"] = TrainedSamples({step: _identities(step) for step in range(3)})
    status, text = _compare(capsys, _run(tmp_path / "a"), _run(tmp_path / "b"))
    assert status == 0, text
    assert _verdict(text) == "IDENTICAL: 3 steps, every metric, sample and weight tensor equal"
    assert "sample ids: recorded by both" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("0 "))
    assert "equal (4)" in row


def test_samples_with_equal_ids_and_other_tokens_diverge(
    tmp_path: Path, capsys: pytest.CaptureFixture, recorded: dict
) -> None:
    recorded["a"] = TrainedSamples({step: _identities(step) for step in range(3)})
    recorded["b"] = TrainedSamples({step: _identities(step, changed=5) for step in range(3)})
    status, text = _compare(capsys, _run(tmp_path / "a"), _run(tmp_path / "b"))
    assert status == 1
    assert _verdict(text) == "DIVERGE at step 1: sample 5 (group 2) tokens differ (1 of 4 samples differ)"
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("1 "))
    assert row[-2:] == ["DIFFER", "-"]


def test_a_run_with_samples_and_one_without(tmp_path: Path, capsys: pytest.CaptureFixture, recorded: dict) -> None:
    recorded["a"] = TrainedSamples({step: _identities(step) for step in range(3)})
    recorded["b"] = TrainedSamples(recorded=False)
    status, text = _compare(capsys, _run(tmp_path / "a"), _run(tmp_path / "b"))
    assert status == 0
    assert "sample ids: not recorded in B (the object-store transport keeps no durable record" in text


def test_compare_samples_names_what_differs() -> None:
    a = _identities(0, count=4)
    assert compare_samples(a, a) == []
    assert compare_samples(a, a[:3]) == ["sample 3 (group 1) trained only in A"]
    assert compare_samples(a, [*a[:3], SampleIdentity(9, 4, "x", ("t", "r", "w"))]) == [
        "sample 3 (group 1) trained only in A",
        "sample 9 (group 4) trained only in B",
    ]
    other = [SampleIdentity(s.index, s.group_index, "y", ("t", "R", "W")) if s.index == 2 else s for s in a]
    assert compare_samples(a, other) == ["sample 2 (group 1) response, reward differ (1 of 4 samples differ)"]
    assert compare_samples(a, list(reversed(a))) == [
        "the same samples trained in another order (position 0: sample 0 (group 0) in A, sample 3 (group 1) in B)"
    ]


def test_sample_identity_covers_tokens_response_and_reward() -> None:
    from slime.utils.types import Sample

    sample = Sample(index=37, group_index=4, tokens=[1, 2, 3], response="abc", reward=1.0)
    identity = run_comparison.sample_identity(sample)
    assert (identity.index, identity.group_index, identity.label()) == (37, 4, "sample 37 (group 4)")
    for change in ({"tokens": [1, 2, 4]}, {"response": "abd"}, {"reward": 0.0}):
        other = run_comparison.sample_identity(Sample(**{**sample.__dict__, **change}))
        assert other.sha256 != identity.sha256
        assert [x != y for x, y in zip(identity.parts, other.parts, strict=True)].count(True) == 1


@pytest.mark.parametrize("swap", [False, True])
def test_a_directory_that_is_not_a_save_directory(tmp_path: Path, capsys: pytest.CaptureFixture, swap: bool) -> None:
    run = _run(tmp_path / "run")
    other = tmp_path / "notes"
    other.mkdir()
    (other / "notes.txt").write_text("not a run")
    argv = [other, run] if swap else [run, other]
    status = main(["runs", "compare", *map(str, argv)])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert captured.err.startswith(f"slime-run: error: {other}: is not a slime-run save directory")
    assert "Traceback" not in captured.err
    assert main(["runs", "compare", str(run), str(tmp_path / "missing")]) == 2
    assert f"slime-run: error: {tmp_path / 'missing'}: no such directory" in capsys.readouterr().err


def test_help_explains_compare(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["runs", "compare", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "slime-run runs compare DIR_A DIR_B [--json]" in text and "slime-run runs compare A B" in text
    assert "compare: the runs diverge" in text


# ------------------------------------------------------------------------------------------- end to end


@pytest.mark.e2e
@pytest.mark.slow
def test_demo_runs_with_other_seeds_diverge_at_step_0_and_a_copy_is_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from slime.data.lineage_audit import audit_run
    from slime.utils.external_utils.slime_run_process import SlimeRunProcess

    saves = []
    for seed in (1, 2):
        save = tmp_path / f"seed{seed}" / "run"
        save.parent.mkdir()
        args = ["--plugin", "straw", "--num-rollout", "2", "--save-interval", "1", "--rollout-seed", str(seed)]
        SlimeRunProcess([*args, "--save", str(save)], save.parent / "run.log", save.parent).finish(300)
        saves.append(save)

    samples = run_comparison.trained_samples(saves[0])
    assert samples.problems == [] and sorted(samples.by_step) == [0, 1]
    indices = [sample.index for step in samples.by_step.values() for sample in step]
    assert len(indices) == len(set(indices)) == audit_run(saves[0]).counts["samples trained"]

    status, text = _compare(capsys, *saves)
    assert status == 1, text
    verdict = _verdict(text)
    assert verdict.startswith("DIVERGE at step 0: sample "), verdict
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("0 "))
    assert "DIFFER" in row

    copy = tmp_path / "copy"
    shutil.copytree(saves[0], copy, symlinks=True)
    status, text = _compare(capsys, saves[0], copy)
    assert status == 0, text
    assert _verdict(text) == "IDENTICAL: 2 steps, every metric, sample and weight tensor equal"
