"""The demo task: deterministic prompts, a prompt-dependent partial-credit reward."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from slime.plugin_manager import registry_for
from slime.plugins.demo_task import copy_reward, demo_prompt_rows, write_demo_prompts
from slime.utils.types import Sample


def test_prompts_are_deterministic_and_labelled(tmp_path):
    path = write_demo_prompts(tmp_path / "prompts.jsonl", 16, seed=3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == demo_prompt_rows(16, seed=3) and len(rows) == 16
    assert all(row["input"] == f"copy: {row['label']} =" for row in rows)
    assert len({row["label"] for row in rows}) > 1
    assert not list(tmp_path.glob("*.partial"))


def test_reward_is_partial_credit_and_depends_on_the_prompt():
    args = SimpleNamespace()
    assert copy_reward(args, Sample(label="abc", response="abc")) == 1.0
    assert copy_reward(args, Sample(label="abc", response=" abx ")) == pytest.approx(2 / 3)
    assert copy_reward(args, Sample(label="abc", response="abcdd")) == pytest.approx(0.8)
    assert copy_reward(args, Sample(label="xyz", response="abc")) == 0.0
    with pytest.raises(ValueError, match="needs a label"):
        copy_reward(args, Sample(index=4, response="abc"))


def test_reward_is_registered():
    assert registry_for(None).get("reward_functions", "copy").target is copy_reward
    with pytest.raises(ValueError, match="positive"):
        demo_prompt_rows(0, seed=0)


def test_alphabet_restricts_targets():
    rows = demo_prompt_rows(32, seed=1, alphabet="ab")
    assert set("".join(row["label"] for row in rows)) <= {"a", "b"}
    with pytest.raises(ValueError, match="alphabet"):
        demo_prompt_rows(1, seed=0, alphabet="")
