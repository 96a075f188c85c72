"""Built-in rollout plugin: the SGLang-protocol rollout functions, the prompt data source, the
zero-variance dynamic filter and the built-in rewards (exact match, token F1, a remote reward server; the math
rewards are plugins/math_rewards.py); docs/rewards.md describes each reward's rule."""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Iterable
from typing import Any

from slime import hookimpl
from slime.plugins.math_rewards import last_boxed
from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.rollout.settings import RolloutSettings
from slime.specs import BatchFilterSpec, DataSourceSpec, RewardFunctionSpec, RolloutFunctionSpec


def nonzero_std(args: Any, group: list) -> DynamicFilterOutput:
    """Keep a group only if its rewards differ (a zero-variance group carries no GRPO signal)."""
    rewards = [sample.get_reward_value(args) for sample in group]
    if len(rewards) > 1 and any(r != rewards[0] for r in rewards):
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason="zero_std")


def _response(sample: Any) -> str:
    return (sample.response or "").strip()


def exact_match(args: Any, sample: Any) -> float:
    """1.0 when the response equals the label (surrounding whitespace ignored), else 0.0."""
    if sample.label is None:
        raise ValueError(f"exact-match reward needs a label (--label-key); sample {sample.index} has none")
    return float(_response(sample) == str(sample.label).strip())


def _f1_tokens(text: str) -> list[str]:
    """Lower-cased whitespace tokens of `text` with every punctuation character (Unicode category P*) removed."""
    kept = "".join(" " if unicodedata.category(char).startswith("P") else char for char in text.lower())
    return kept.split()


def token_f1(prediction: str, reference: str) -> float:
    """Token-level F1 of `prediction` against `reference` (tokens as `_f1_tokens`, counted with multiplicity);
    1.0 when both hold no token, 0.0 when only one does."""
    predicted, expected = _f1_tokens(prediction), _f1_tokens(reference)
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def f1_reward(args: Any, sample: Any) -> float:
    """Token F1 between the response's answer (its last `\\boxed{}` or `\\fbox{}`, else the whole response) and
    the label."""
    if sample.label is None:
        raise ValueError(f"f1 reward needs a label (--label-key); sample {sample.index} has none")
    response = sample.response or ""
    boxed = last_boxed(response)
    return token_f1(boxed if boxed is not None else response, str(sample.label))


def _check_deterministic_sglang_rollout(args: Any) -> None:
    """The "sglang" rollout function seeds every request itself; a custom generate function sends its own requests,
    and nothing tells whether it passes each sample's `sampling_seed` on."""
    path = RolloutSettings.from_args(args).custom_generate_function_path
    if path:
        raise ValueError(
            f"--deterministic: --custom-generate-function-path {path} sends its own requests, and the sglang rollout "
            "function cannot tell whether it passes each sample's sampling_seed on; drop one of the two"
        )


@hookimpl
def slime_rollout_functions() -> Iterable[RolloutFunctionSpec]:
    from slime.rollout.fully_async_rollout import generate_rollout_fully_async
    from slime.rollout.sglang_rollout import generate_rollout

    return [
        RolloutFunctionSpec(
            "sglang",
            generate_rollout,
            "async HTTP client of SGLang-protocol engines (default)",
            deterministic=_check_deterministic_sglang_rollout,
        ),
        RolloutFunctionSpec(
            "fully-async", generate_rollout_fully_async, "background generation that overlaps training steps"
        ),
    ]


@hookimpl
def slime_data_sources() -> Iterable[DataSourceSpec]:
    from slime.data.data_source import RolloutDataSourceWithBuffer

    return [DataSourceSpec("prompts", RolloutDataSourceWithBuffer, "--prompt-data JSONL/Parquet with a buffer")]


@hookimpl
def slime_batch_filters() -> Iterable[BatchFilterSpec]:
    return [BatchFilterSpec("nonzero-std", nonzero_std, "drop groups whose rewards have zero variance")]


@hookimpl
def slime_reward_functions() -> Iterable[RewardFunctionSpec]:
    from slime.rollout.remote_reward import remote_reward

    return [
        RewardFunctionSpec("exact-match", exact_match, "response equals the label"),
        RewardFunctionSpec("f1", f1_reward, "token F1 of the (\\boxed{}) answer against the label"),
        RewardFunctionSpec("remote", remote_reward, "scored by the reward server at --rm-url"),
    ]
