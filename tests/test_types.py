"""Sample: dict round trips keep dynamic attributes; reward and routed-expert helpers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slime.utils.types import Sample


def test_dict_round_trip_keeps_dynamic_attributes_and_enums():
    sample = Sample(index=3, tokens=[1, 2, 3], response_length=2, reward=0.5, status=Sample.Status.TRUNCATED)
    sample._queue_lease = {"task_id": "t", "attempt_id": "a"}
    sample.spec_info.spec_verify_ct = 4
    data = sample.to_dict()
    assert data["status"] == "truncated" and data["spec_info"]["spec_verify_ct"] == 4
    restored = Sample.from_dict(data)
    assert restored.status is Sample.Status.TRUNCATED
    assert restored._queue_lease == {"task_id": "t", "attempt_id": "a"}
    assert restored.spec_info == sample.spec_info
    assert restored.tokens == [1, 2, 3] and restored.index == 3


def test_reward_value_selects_a_key_or_fails_clearly():
    assert Sample(reward=1.5).get_reward_value(SimpleNamespace()) == 1.5
    assert Sample(reward={"acc": 1.0}).get_reward_value(SimpleNamespace(reward_key="acc")) == 1.0
    with pytest.raises(ValueError, match="--reward-key"):
        Sample(reward={"acc": 1.0}).get_reward_value(SimpleNamespace())


def test_routed_experts_materialize_from_lists_and_tensors():
    sample = Sample(rollout_routed_experts=[[1, 2], [3, 4]])
    tensor = sample.materialize_rollout_routed_experts(replace=False)
    assert tensor.dtype == torch.int32 and tensor.shape == (2, 2)
    assert isinstance(sample.rollout_routed_experts, list)
    parts = Sample(rollout_routed_experts=[torch.ones(1, 2), torch.zeros(2, 2)])
    assert parts.materialize_rollout_routed_experts().shape == (3, 2)
    assert parts.get_rollout_routed_experts_length() == 3
    assert Sample().get_rollout_routed_experts_length() == 0
