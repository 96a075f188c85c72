"""The rollout sample: one prompt/response trajectory and everything training needs from it.

Samples carry dynamic attributes besides their dataclass fields (the queue stamps `_queue_lease`,
`_queue_receipt`, `_queue_source_positions`, ... onto them); `to_dict`/`from_dict` and the durable codec
keep those, so a sample read back from storage is the sample that was written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class Sample:
    """One trajectory: prompt, generated tokens, reward, and optional replay fields."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    @dataclass
    class SpecInfo:
        """Speculative-decoding statistics reported by the engine."""

        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

    @dataclass
    class PrefixCacheInfo:
        """Prefix-cache statistics reported by the engine."""

        cached_tokens: int = 0
        total_prompt_tokens: int = 0

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_topk_token_ids: Any = None
    rollout_topk_log_probs: Any = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_top_p_log_probs: Any = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    train_metadata: dict[str, Any] | None = None
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    session_id: str | None = None
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of every attribute, dynamic ones included (status and infos as plain values)."""
        value = dict(self.__dict__)
        value["status"] = self.status.value
        value["spec_info"] = dataclasses.asdict(self.spec_info)
        value["prefix_cache_info"] = dataclasses.asdict(self.prefix_cache_info)
        return value

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Sample:
        """Inverse of `to_dict`; keys that are not dataclass fields become attributes."""
        data = dict(data)
        known = {f.name for f in dataclasses.fields(Sample)}
        if "status" in data and not isinstance(data["status"], Sample.Status):
            data["status"] = Sample.Status(data["status"])
        if isinstance(data.get("spec_info"), dict):
            data["spec_info"] = Sample.SpecInfo(**data["spec_info"])
        if isinstance(data.get("prefix_cache_info"), dict):
            data["prefix_cache_info"] = Sample.PrefixCacheInfo(**data["prefix_cache_info"])
        sample = Sample(**{key: value for key, value in data.items() if key in known})
        for key, value in data.items():
            if key not in known:
                setattr(sample, key, value)
        return sample

    def discard_generation(self) -> None:
        """Forget what was generated (response, its tokens, log-probs, weight versions, reward): the sample is its
        prompt again, pending. For a group handed back whose partial answer must not shape the next attempt."""
        if self.response_length:
            self.tokens = self.tokens[: len(self.tokens) - self.response_length]
        self.response, self.response_length = "", 0
        self.loss_mask = self.rollout_log_probs = self.reward = None
        self.weight_versions = []
        self.status = Sample.Status.PENDING

    def get_reward_value(self, args: Any) -> float:
        """The scalar reward; `--reward-key` selects one entry of a dict reward."""
        key = getattr(args, "reward_key", None)
        if isinstance(self.reward, dict):
            if key is None:
                raise ValueError("Sample reward is a dict; pass --reward-key to select the scalar to train on")
            return self.reward[key]
        return self.reward

    def materialize_rollout_routed_experts(self, *, replace: bool = True) -> Any:
        """Return routed experts as one tensor (loading a stored TensorRef); optionally keep it on the sample."""
        import torch

        value = self.rollout_routed_experts
        if value is None:
            return None
        if hasattr(value, "load") and not isinstance(value, torch.Tensor):
            tensor = value.load()
        elif isinstance(value, torch.Tensor):
            tensor = value.view(value.shape).clone()
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            tensor = torch.cat(list(value))
        else:
            tensor = torch.as_tensor(value, dtype=torch.int32)
        if replace:
            self.rollout_routed_experts = tensor
        return tensor

    def get_rollout_routed_experts_length(self) -> int:
        """Number of token rows of routed-expert data, without loading a stored reference."""
        value = self.rollout_routed_experts
        if value is None:
            return 0
        shape = getattr(value, "shape", None)
        if shape is not None:
            return int(shape[0]) if len(shape) else 0
        return len(value)
