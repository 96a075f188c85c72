"""Built-in math rewards on the math-verify package (extra `math`): `math` (the final answer, equivalent to the
label), `deepscaler` (the boxed answer after the model's thinking) and `dapo` (the last "Answer:" line, +1/-1);
docs/rewards.md describes each rule.

math-verify's own timeouts use SIGALRM, which works in the main thread only, while rm_hub runs synchronous
rewards in worker threads; they are turned off here, and rm_hub's `--reward-timeout` bounds each call instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from slime import hookimpl
from slime.specs import RewardFunctionSpec

#: The rewards of this module; each needs math-verify.
MATH_REWARDS = ("math", "deepscaler", "dapo")
INSTALL_HINT = 'pip install "slime-rl[math]"'

_THINK_END = "</think>"
_ANSWER_LINE = re.compile(r"\banswer\s*:", re.IGNORECASE)
_PROSE = re.compile(r"[A-Za-z]{2,}\s+[A-Za-z]{2,}")
_GROUPED_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


class _LabelError(ValueError):
    """A label that is no math answer."""


def _math_verify() -> tuple[Any, Any]:
    """math-verify's `parse` and `verify`, or a ValueError saying how to install them."""
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ValueError(f"the math rewards need the math-verify package: {INSTALL_HINT}") from exc
    return parse, verify


def _parse(text: str) -> list:
    parse, _ = _math_verify()
    return parse(text, parsing_timeout=None)


def _equivalent(gold: list, answer: list) -> bool:
    _, verify = _math_verify()
    return bool(answer) and bool(verify(gold, answer, timeout_seconds=None))


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) of `text` with balanced braces, else None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    begin = text.index("{", start) + 1
    depth = 0
    for position in range(begin, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            if depth == 0:
                return text[begin:position]
            depth -= 1
    return None


def _labels(name: str, sample: Any) -> list[str]:
    """The sample's label(s) as text: a list or tuple label holds several accepted answers."""
    label = sample.label
    labels = list(label) if isinstance(label, (list, tuple)) else [label]
    texts = [str(item).strip() for item in labels if item is not None and str(item).strip()]
    if not texts:
        raise ValueError(f"{name} reward needs a label (--label-key); sample {sample.index} has none")
    return texts


def _parse_gold(name: str, sample: Any, label: str) -> list:
    """A label parsed by math-verify: as LaTeX math unless it holds its own `$` or `\\boxed{}`. A label of prose
    (two words in a row, outside LaTeX) is no math answer: math-verify would read it as a product of symbols."""
    delimited = "$" in label or "\\boxed" in label
    prose = not delimited and "\\" not in label and _PROSE.search(label)
    gold = [] if prose else _parse(label if delimited else f"${label}$")
    if gold and not any(not isinstance(value, str) for value in gold):
        gold = [value for value in _parse(label) if not isinstance(value, str)]
    if not gold:
        raise _LabelError(
            f"{name} reward: label {label!r} of sample {sample.index} holds no number or math expression "
            "that math-verify parses"
        )
    return gold


def _matches_label(name: str, sample: Any, answer: list) -> bool:
    return any(_equivalent(_parse_gold(name, sample, label), answer) for label in _labels(name, sample))


def math_reward(args: Any, sample: Any) -> float:
    """1.0 when the response's final answer (its last `\\boxed{}`, else what math-verify extracts from the whole
    response) is mathematically equivalent to the label by math-verify, else 0.0."""
    _labels("math", sample)
    response = sample.response or ""
    boxed = last_boxed(response)
    answer = _parse(f"\\boxed{{{boxed}}}" if boxed is not None else response)
    return float(_matches_label("math", sample, answer))


def deepscaler_reward(args: Any, sample: Any) -> float:
    """DeepScaleR's rule: the last `\\boxed{}` answer after the last `</think>` (the whole response without one),
    1.0 when math-verify finds it equivalent to the label, else 0.0 (also without a boxed answer)."""
    _labels("deepscaler", sample)
    response = sample.response or ""
    if _THINK_END in response:
        response = response.rsplit(_THINK_END, 1)[1]
    boxed = last_boxed(response)
    if boxed is None or not boxed.strip():
        return 0.0
    return float(_matches_label("deepscaler", sample, _parse(f"\\boxed{{{boxed}}}")))


def normalize_dapo_answer(text: str) -> str:
    """An answer as DAPO compares it: stripped of whitespace, a trailing period, surrounding `$`, a `\\boxed{}`
    wrapper, and the thousands separators of a number (`$1,234$.` -> `1234`)."""
    answer = text.strip()
    while True:
        before = answer
        answer = answer.strip().rstrip(".").strip()
        if len(answer) >= 2 and answer.startswith("$") and answer.endswith("$"):
            answer = answer.strip("$")
        boxed = last_boxed(answer)
        if boxed is not None and answer.startswith(("\\boxed{", "\\fbox{")) and answer.endswith("}"):
            answer = boxed
        if answer == before:
            break
    if _GROUPED_NUMBER.fullmatch(answer):
        answer = answer.replace(",", "")
    return answer


def dapo_answer(text: str) -> str | None:
    """The text after the last `Answer:` of `text` up to the end of its line (normalised), else None."""
    matches = list(_ANSWER_LINE.finditer(text))
    if not matches:
        return None
    answer = normalize_dapo_answer(text[matches[-1].end() :].split("\n", 1)[0])
    return answer or None


def dapo_reward(args: Any, sample: Any) -> float:
    """DAPO's rule: +1.0 when the last `Answer:` line's answer equals a label after normalisation or is
    equivalent to it by math-verify, else -1.0 (also without an `Answer:` line)."""
    labels = _labels("dapo", sample)
    answer = dapo_answer(sample.response or "")
    if answer is None:
        return -1.0
    if any(answer == normalize_dapo_answer(label) for label in labels):
        return 1.0
    parsed = _parse(f"${answer}$")
    for label in labels:
        try:
            gold = _parse_gold("dapo", sample, label)
        except _LabelError:  # not math: the exact comparison above was the only one
            continue
        if _equivalent(gold, parsed):
            return 1.0
    return -1.0


def _selected_math_rewards(args: Any) -> list[str]:
    names = [name.strip() for name in str(getattr(args, "rm_type", None) or "").split(",")]
    custom = getattr(args, "custom_rm_path", None)
    if custom:
        names = [str(custom).strip()]
    return [name for name in names if name in MATH_REWARDS]


@hookimpl
def slime_configure(args: Any) -> None:
    """Refuse, while the arguments are parsed, a math reward without the math-verify package."""
    selected = _selected_math_rewards(args)
    if not selected:
        return
    try:
        import math_verify  # noqa: F401
    except ImportError:
        flag = "--custom-rm-path" if getattr(args, "custom_rm_path", None) else "--rm-type"
        raise ValueError(
            f"{flag} {','.join(selected)}: the math rewards need the math-verify package: {INSTALL_HINT}"
        ) from None


@hookimpl
def slime_reward_functions() -> Iterable[RewardFunctionSpec]:
    return [
        RewardFunctionSpec("math", math_reward, "final (\\boxed{}) answer equivalent to the label (math-verify)"),
        RewardFunctionSpec(
            "deepscaler", deepscaler_reward, "DeepScaleR: \\boxed{} answer after </think> equivalent to the label"
        ),
        RewardFunctionSpec("dapo", dapo_reward, "DAPO: +1 if the last 'Answer:' line matches the label, else -1"),
    ]
