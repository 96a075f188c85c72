"""Evaluation data (`--eval-prompt-data`): parsing, held-out samples, eval metrics and pass@k, bad input."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime.data.eval_data import EvalDatasets, EvalSettings, eval_metrics, parse_eval_prompt_data, pass_at_k
from slime.observability import logging_utils
from slime.utils.types import Sample


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _args(tmp_path: Path, **overrides) -> SimpleNamespace:
    held_out = _write(tmp_path / "held.jsonl", [{"input": "copy: ab =", "label": "ab"}, {"input": "x", "label": "y"}])
    values = {"eval_prompt_data": ["held", str(held_out)], "label_key": "label", "n_samples_per_eval_prompt": 3}
    return SimpleNamespace(**{**values, **overrides})


def test_pairs_parse_into_named_datasets():
    assert [(d.name, d.path) for d in parse_eval_prompt_data(["a", "a.jsonl", "b", "b.parquet"])] == [
        ("a", "a.jsonl"),
        ("b", "b.parquet"),
    ]
    assert EvalSettings.from_args(SimpleNamespace()).datasets == ()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["a", "a.jsonl", "b"], r"--eval-prompt-data got 3 values \(a a.jsonl b\); give NAME PATH pairs"),
        (["a", "x.jsonl", "a", "y.jsonl"], "--eval-prompt-data names 'a' twice"),
        (["math/hard", "x.jsonl"], "'math/hard' is not a dataset name"),
    ],
)
def test_malformed_pairs_are_refused_naming_the_flag(values, message):
    with pytest.raises(ValueError, match=message):
        parse_eval_prompt_data(values)


def test_each_prompt_is_repeated_with_its_row_as_group(tmp_path):
    datasets = EvalDatasets(_args(tmp_path)).eval_datasets
    samples = datasets["held"]
    assert [(s.group_index, s.index, s.label) for s in samples] == [
        (0, 0, "ab"),
        (0, 1, "ab"),
        (0, 2, "ab"),
        (1, 3, "y"),
        (1, 4, "y"),
        (1, 5, "y"),
    ]
    assert samples[0] is not samples[1] and samples[0].prompt == "copy: ab ="
    assert not EvalDatasets(SimpleNamespace())


def test_a_missing_eval_file_names_the_flag_the_dataset_and_the_path(tmp_path):
    args = _args(tmp_path, eval_prompt_data=["held", str(tmp_path / "absent.jsonl")])
    with pytest.raises(FileNotFoundError, match=f"--eval-prompt-data held {tmp_path / 'absent.jsonl'} does not exist"):
        EvalDatasets(args)


def test_an_eval_row_without_the_label_field_names_file_and_line(tmp_path):
    bad = _write(tmp_path / "bad.jsonl", [{"input": "a", "label": "b"}, {"input": "c"}])
    with pytest.raises(KeyError, match=r"bad.jsonl:2: the row has no 'label' field \(--label-key label\)"):
        EvalDatasets(_args(tmp_path, eval_prompt_data=["bad", str(bad)]))


@pytest.mark.parametrize(
    ("n", "correct", "k", "expected"),
    [(4, 0, 1, 0.0), (4, 4, 1, 1.0), (4, 1, 1, 0.25), (4, 2, 2, 1 - 1 / 6), (4, 1, 4, 1.0), (5, 2, 3, 1 - 1 / 10)],
)
def test_pass_at_k_is_the_unbiased_estimate(n, correct, k, expected):
    assert pass_at_k(n, correct, k) == pytest.approx(expected)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(2, 1, 3)


def _scored(group_rewards: list[list[float]]) -> tuple[list[Sample], list[float]]:
    samples, rewards = [], []
    for group, values in enumerate(group_rewards):
        for value in values:
            samples.append(Sample(group_index=group, index=len(samples), reward=value))
            rewards.append(value)
    return samples, rewards


def test_eval_metrics_report_the_mean_and_pass_at_powers_of_two_up_to_n():
    samples, rewards = _scored([[1.0, 0.0, 0.5], [0.0, 0.0, 0.0]])
    metrics = eval_metrics("held", samples, rewards)
    assert metrics["eval/held/reward"] == pytest.approx(1.5 / 6)
    # Prompt 0 has one full-reward sample in 3 (0.5 is partial credit, not a pass); prompt 1 none.
    assert metrics["eval/held/pass@1"] == pytest.approx((1 / 3 + 0) / 2)
    assert metrics["eval/held/pass@2"] == pytest.approx((1 - 1 / 3 + 0) / 2)
    assert metrics["eval/held/pass@3"] == pytest.approx(0.5)
    assert sorted(metrics) == ["eval/held/pass@1", "eval/held/pass@2", "eval/held/pass@3", "eval/held/reward"]


def test_one_sample_per_prompt_reports_only_the_mean():
    samples, rewards = _scored([[1.0], [0.0]])
    assert eval_metrics("held", samples, rewards) == {"eval/held/reward": 0.5}


def test_the_eval_metrics_line_carries_every_dataset(tmp_path):
    args = SimpleNamespace(metrics_dir=str(tmp_path), save=None)
    logging_utils.init_tracking(args)
    samples, rewards = _scored([[1.0, 1.0], [1.0, 0.0]])
    record = logging_utils.log_eval_rollout_data(
        7, args, {"a": {"rewards": rewards, "samples": samples}, "b": {"rewards": [0.25]}}, {"eval/custom": 3}
    )
    logging_utils.finish_tracking(args)
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["step"] == 7 and {key: line[key] for key in record} == record
    assert record["eval/a/reward"] == 0.75 and record["eval/a/pass@1"] == 0.75 and record["eval/a/pass@2"] == 1.0
    assert record["eval/b/reward"] == 0.25 and record["eval/custom"] == 3
