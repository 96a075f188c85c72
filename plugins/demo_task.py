"""The built-in demo task: copy a short lowercase string.

Prompts look like `copy: kqz =` and the label is `kqz`. The reward is prompt-dependent and verifiable:
the fraction of label characters the response reproduces at the right position, minus a small penalty
for extra characters, so a policy that starts at random earns partial credit and can climb.
`write_demo_prompts` writes the task as a JSONL prompt file that the standard prompt data source reads.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slime import hookimpl
from slime.specs import RewardFunctionSpec
from slime.utils.durable import write_atomically

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
#: The demo's targets: with a random 60-symbol tiny model, full-alphabet targets almost never earn reward.
DEMO_ALPHABET = "ab"
PROMPT_TEMPLATE = "copy: {target} ="


def demo_prompt_rows(
    count: int, *, seed: int, min_len: int = 2, max_len: int = 4, alphabet: str = ALPHABET
) -> list[dict[str, str]]:
    """`count` deterministic prompt rows `{"input", "label"}` with targets drawn from `alphabet`."""
    if count <= 0:
        raise ValueError(f"count must be positive, got {count}")
    if not alphabet:
        raise ValueError("alphabet must not be empty")
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        target = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
        rows.append({"input": PROMPT_TEMPLATE.format(target=target), "label": target})
    return rows


def write_demo_prompts(path: str | os.PathLike, count: int = 256, *, seed: int = 0, alphabet: str = ALPHABET) -> Path:
    """Write the demo prompts as JSONL (atomically: a temp file, fsync, rename); return the path."""
    rows = demo_prompt_rows(count, seed=seed, alphabet=alphabet)
    return write_atomically(
        path, lambda handle: handle.writelines(json.dumps(row) + "\n" for row in rows), binary=False
    )


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
