"""The math rewards on math-verify (plugins/math_rewards.py): math, deepscaler and dapo (docs/rewards.md)."""

from __future__ import annotations

import asyncio
import sys
import threading
from types import SimpleNamespace

import pytest

from slime.plugins import math_rewards
from slime.plugins.math_rewards import (
    dapo_answer,
    dapo_reward,
    deepscaler_reward,
    last_boxed,
    math_reward,
    normalize_dapo_answer,
)
from slime.rollout import rm_hub
from slime.utils.arguments import parse_args
from slime.utils.types import Sample

ARGS = SimpleNamespace(rm_type="math", custom_rm_path=None, reward_key=None)


def _sample(response, label, index=0):
    return Sample(index=index, response=response, label=label)


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("first 3, so \\boxed{1/2}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\sqrt 2}", "\\sqrt{2}", 1.0),
        ("\\boxed{2^{1/2}}", "\\sqrt{2}", 1.0),
        ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),
        ("\\boxed{(0, 1]}", "(0,1]", 1.0),
        ("\\boxed{[0, 1]}", "(0,1]", 0.0),
        ("so the answer is \\boxed{1,234}", "1234", 1.0),
        ("The answer is 42", "42", 1.0),
        ("I think 41", "42", 0.0),
        ("no number", "42", 0.0),
        ("", "42", 0.0),
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
        ("\\boxed{41} but then \\boxed{42}", "42", 1.0),
        ("\\boxed{42} but then \\boxed{41}", "42", 0.0),
        ("\\boxed{$\\frac{1}{2$", "0.5", 0.0),
        ("\\boxed{7}", "$7$", 1.0),
        ("\\boxed{7}", "\\boxed{7}", 1.0),
        ("\\boxed{3}", ["7", "3"], 1.0),
    ],
)
def test_math_compares_the_final_answer_by_math_verify(response, label, reward):
    assert math_reward(ARGS, _sample(response, label)) == reward


def test_math_needs_a_label_math_verify_parses():
    for label in (None, "", "  ", []):
        with pytest.raises(ValueError, match=r"math reward needs a label \(--label-key\); sample 3 has none"):
            math_reward(ARGS, _sample("\\boxed{1}", label, index=3))
    for label in ("###", "no number", "the answer is forty"):
        with pytest.raises(ValueError, match=f"label '{label}' of sample 4 holds no number or math expression"):
            math_reward(ARGS, _sample("\\boxed{1}", label, index=4))
    assert math_reward(ARGS, _sample("\\boxed{\\text{no solution}}", "\\text{no solution}")) == 1.0


def test_last_boxed_balances_braces():
    assert last_boxed("\\boxed{1} and \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert last_boxed("\\fbox{3}") == "3"
    assert last_boxed("\\boxed{unclosed") is None
    assert last_boxed("nothing") is None


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("<think>maybe \\boxed{3}</think>So \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("<think>it is \\boxed{0.5}</think>I answer 0.5", "0.5", 0.0),
        ("<think>a</think>\\boxed{2}<think>b</think>\\boxed{3}", "3", 1.0),
        ("<think>a</think>\\boxed{3}<think>b</think>\\boxed{2}", "3", 0.0),
        ("no thinking: \\boxed{\\sqrt{2}}", "\\sqrt 2", 1.0),
        ("<think>still thinking \\boxed{5}", "5", 1.0),
        ("The answer is 5", "5", 0.0),
        ("\\boxed{}", "5", 0.0),
        ("\\boxed{4}", "5", 0.0),
        ("\\boxed{%%%}", "5", 0.0),
    ],
)
def test_deepscaler_scores_the_boxed_answer_after_thinking(response, label, reward):
    assert deepscaler_reward(ARGS, _sample(response, label)) == reward


def test_deepscaler_needs_a_label():
    with pytest.raises(ValueError, match=r"deepscaler reward needs a label \(--label-key\); sample 2 has none"):
        deepscaler_reward(ARGS, _sample("\\boxed{1}", None, index=2))


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("Work...\nAnswer: 42", "42"),
        ("Answer: 41\nthen again\nAnswer: $1,234$.", "1234"),
        ("answer:  \\boxed{17} \nbye", "17"),
        ("ANSWER: $\\frac{1}{2}$", "\\frac{1}{2}"),
        ("Answer:", None),
        ("no marker 42", None),
    ],
)
def test_dapo_answer_is_the_last_answer_line_normalised(text, answer):
    assert dapo_answer(text) == answer


def test_dapo_normalisation():
    assert normalize_dapo_answer(" $$42$$. ") == "42"
    assert normalize_dapo_answer("1,234,567") == "1234567"
    assert normalize_dapo_answer("(1,2)") == "(1,2)"


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("Let me see.\nAnswer: 42", "42", 1.0),
        ("Answer: $42$.", "42", 1.0),
        ("Answer: 1,234", "1234", 1.0),
        ("Answer: 0.5", "\\frac{1}{2}", 1.0),
        ("Answer: 41", "42", -1.0),
        ("Answer: 42\nwait, no.\nAnswer: 41", "42", -1.0),
        ("The answer is \\boxed{42}", "42", -1.0),
        ("", "42", -1.0),
        ("Answer: ###", "42", -1.0),
        ("Answer: hello", "hello", 1.0),
        ("Answer: no solution.", "No solution", -1.0),
        ("Answer: no solution.", "no solution", 1.0),
        ("Answer: 3", ["no solution", "3"], 1.0),
    ],
)
def test_dapo_is_plus_one_or_minus_one(response, label, reward):
    assert dapo_reward(ARGS, _sample(response, label)) == reward


def test_dapo_needs_a_label():
    with pytest.raises(ValueError, match=r"dapo reward needs a label \(--label-key\); sample 5 has none"):
        dapo_reward(ARGS, _sample("Answer: 1", None, index=5))


def test_rewards_run_in_worker_threads():
    """rm_hub runs synchronous rewards in threads, where math-verify's SIGALRM timeouts would fail."""
    results = []
    thread = threading.Thread(
        target=lambda: results.append(
            (
                math_reward(ARGS, _sample("\\boxed{1/2}", "0.5")),
                deepscaler_reward(ARGS, _sample("</think>\\boxed{2}", "2")),
                dapo_reward(ARGS, _sample("Answer: 1/2", "0.5")),
            )
        )
    )
    thread.start()
    thread.join()
    assert results == [(1.0, 1.0, 1.0)]


@pytest.mark.parametrize("name", ["math", "deepscaler", "dapo"])
def test_registered_and_scored_through_rm_hub(name):
    args = SimpleNamespace(rm_type=name, custom_rm_path=None, reward_key=None)
    response = {"math": "\\boxed{6}", "deepscaler": "<think>hm</think>\\boxed{6}", "dapo": "Answer: 6"}[name]
    assert asyncio.run(rm_hub.batched_async_rm(args, [Sample(response=response, label="6")])) == [1.0]


def test_parse_time_check_accepts_math_rewards_when_installed():
    assert parse_args(["--rm-type", "f1,dapo"]).rm_type == "f1,dapo"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--rm-type", "math"], "--rm-type math"),
        (["--rm-type", "f1,deepscaler,dapo"], "--rm-type deepscaler,dapo"),
        (["--custom-rm-path", "dapo"], "--custom-rm-path dapo"),
    ],
)
def test_parse_time_check_refuses_math_rewards_without_math_verify(monkeypatch, capsys, argv, flag):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` raises ImportError
    with pytest.raises(SystemExit):
        parse_args(argv)
    err = capsys.readouterr().err
    assert (
        f'slime-run: error: {flag}: the math rewards need the math-verify package: pip install "slime-rl[math]"' in err
    )


def test_other_rewards_need_no_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    assert parse_args(["--rm-type", "f1"]).rm_type == "f1"
    with pytest.raises(ValueError, match=r'math-verify package: pip install "slime-rl\[math\]"'):
        math_rewards.math_reward(ARGS, _sample("\\boxed{1}", "1"))
