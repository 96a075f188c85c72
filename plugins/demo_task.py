"""The built-in demo task: copy a short lowercase string.

Prompts look like `copy: kqz =` and the label is `kqz`. The demo copies strings of
`DEMO_TARGET_LENGTH` characters over `DEMO_ALPHABET` with a response budget of the same length, so the
tiny model learns to copy (the reward starts near 0 and reaches about 1) without first having to learn
where to stop; the task itself supports variable lengths and any alphabet. The reward is
prompt-dependent and verifiable: the fraction of label characters the response reproduces at the right
position, minus a small penalty for extra characters, so a policy that starts at random earns partial
credit and can climb.
`write_demo_prompts` writes the task as a JSONL prompt file that the standard prompt data source reads.
"""

from __future__ import annotations

import itertools
import json
import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slime import hookimpl
from slime.specs import RewardFunctionSpec
from slime.utils.atomic_files import write_atomically

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
#: The demo's targets. With variable lengths the tiny model settles on repeating the first characters
#: without ever emitting end-of-sequence (reward about 0.7); with the full alphabet it earns almost nothing
#: in the demo's step budget. `benchmarks/demo_floor.py` is the quick way to try other settings.
DEMO_ALPHABET = "abcd"
DEMO_TARGET_LENGTH = 3
#: `demo_prompt_rows` options of the demo's prompts.
DEMO_ROW_OPTIONS = {"alphabet": DEMO_ALPHABET, "min_len": DEMO_TARGET_LENGTH, "max_len": DEMO_TARGET_LENGTH}
PROMPT_TEMPLATE = "copy: {target} ="


def demo_prompt_rows(
    count: int, *, seed: int, min_len: int = 2, max_len: int = 4, alphabet: str = ALPHABET
) -> list[dict[str, str]]:
    """`count` deterministic prompt rows `{"input", "label"}` with targets drawn from `alphabet`."""
    if count <= 0:
        raise ValueError(f"count must be positive, got {count}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"target lengths must satisfy 1 <= min_len <= max_len, got {min_len} and {max_len}")
    if not alphabet:
        raise ValueError("alphabet must not be empty")
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        target = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
        rows.append({"input": PROMPT_TEMPLATE.format(target=target), "label": target})
    return rows


def task_rows(targets: Iterable[str]) -> list[dict[str, str]]:
    """The prompt rows `{"input", "label"}` of `targets`, in order."""
    return [{"input": PROMPT_TEMPLATE.format(target=target), "label": target} for target in targets]


def demo_eval_rows(training_rows: list[dict[str, str]]) -> dict[str, list[dict[str, str]]]:
    """The demo's eval splits: `copy-unseen`, the task's targets that `training_rows` never ask for (left out
    when there are none), and `copy-all`, every target of the task (`DEMO_ALPHABET` ** `DEMO_TARGET_LENGTH`).
    The task has only 64 targets, so most are in the training prompts: `copy-all` measures the policy,
    `copy-unseen` what it does on prompts it never trained on."""
    every = ["".join(letters) for letters in itertools.product(DEMO_ALPHABET, repeat=DEMO_TARGET_LENGTH)]
    seen = {row["label"] for row in training_rows}
    unseen = [target for target in every if target not in seen]
    splits = {"copy-unseen": task_rows(unseen)} if unseen else {}
    return {**splits, "copy-all": task_rows(every)}


def write_prompt_rows(path: str | os.PathLike, rows: list[dict[str, str]]) -> Path:
    """Write prompt rows as JSONL (atomically: a temp file, fsync, rename); return the path."""
    return write_atomically(
        path, lambda handle: handle.writelines(json.dumps(row) + "\n" for row in rows), binary=False
    )


def write_demo_prompts(path: str | os.PathLike, count: int = 256, *, seed: int = 0, **row_options: Any) -> Path:
    """Write `count` demo prompts (`demo_prompt_rows`: `row_options` are its `min_len`, `max_len`, `alphabet`)
    as JSONL; return the path."""
    return write_prompt_rows(path, demo_prompt_rows(count, seed=seed, **row_options))


def copy_reward(args: Any, sample: Any) -> float:
    """Positional character matches over the label length, minus 0.1 per extra character; in [0, 1]."""
    label = sample.label or ""
    if not label:
        raise ValueError(f"copy reward needs a label; sample {sample.index} has none (set --label-key)")
    response = (sample.response or "").strip()
    matches = sum(1 for expected, got in zip(label, response, strict=False) if expected == got)
    extra = max(0, len(response) - len(label))
    return max(0.0, matches / len(label) - 0.1 * extra)


@hookimpl
def slime_reward_functions() -> Iterable[RewardFunctionSpec]:
    return [RewardFunctionSpec("copy", copy_reward, "demo task: reproduce the prompt's string (partial credit)")]
