"""Evaluation data: `--eval-prompt-data NAME PATH [NAME PATH ...]` read into held-out prompts, and their metrics.

`EvalDatasets(args)` reads each file once (JSONL or Parquet, with the run's `--input-key`, `--label-key`,
`--metadata-key`) and repeats every prompt `--n-samples-per-eval-prompt` times. The rollout manager hands it to
the eval rollout function as that call's data source (its `eval_datasets` attribute, `{name: [Sample]}`, is
what eval rollout functions read), so an evaluation neither draws from nor moves the training data source, its
cursor or the durable queue.

`eval_metrics` turns one dataset's scored samples into `eval/<name>/reward` (the mean) and, when each prompt
was sampled more than once, `eval/<name>/pass@k`: the unbiased estimate of the chance that at least one of k
samples of a prompt earns the full reward (`PASS_REWARD`), averaged over prompts.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from math import comb
from typing import Any

from slime.data.data_source import record_to_sample
from slime.data.prompt_settings import PromptSettings
from slime.data.prompt_sources import EVAL_SPLIT, read_prompt_records
from slime.utils.settings import Settings, option
from slime.utils.types import Sample

#: A sample "passes" (for pass@k) when its reward is at least this: full credit on the built-in rewards.
PASS_REWARD = 1.0

_PAIRS_FIX = "give NAME PATH pairs, e.g. --eval-prompt-data aime aime.jsonl gsm8k gsm8k.parquet"


@dataclass(frozen=True)
class EvalDataset:
    """One `--eval-prompt-data` pair: the name its metrics carry (`eval/<name>/...`) and where its prompts are
    (a JSONL or Parquet file, a `datasets` directory or a Hub dataset id)."""

    name: str
    path: str


def parse_eval_prompt_data(values: Sequence[str]) -> tuple[EvalDataset, ...]:
    """The NAME PATH pairs of `--eval-prompt-data`; ValueError naming the flag for an odd count, an empty or
    repeated name, or a name with a "/" (it is part of a metric key)."""
    values = list(values)
    if len(values) % 2:
        raise ValueError(f"--eval-prompt-data got {len(values)} values ({' '.join(values)}); {_PAIRS_FIX}")
    datasets = tuple(EvalDataset(name, path) for name, path in zip(values[::2], values[1::2], strict=True))
    seen: set[str] = set()
    for dataset in datasets:
        if not dataset.name or "/" in dataset.name:
            raise ValueError(f"--eval-prompt-data: {dataset.name!r} is not a dataset name (no '/', not empty)")
        if dataset.name in seen:
            raise ValueError(f"--eval-prompt-data names {dataset.name!r} twice; each dataset needs its own name")
        seen.add(dataset.name)
    return datasets


@dataclass(frozen=True)
class EvalSettings(Settings):
    """See the flags of the same names in `slime-run --help`."""

    datasets: tuple[EvalDataset, ...] = option("eval_prompt_data", (), convert=parse_eval_prompt_data)
    n_samples_per_prompt: int = option("n_samples_per_eval_prompt", 1, convert=int, minimum=1)
    #: The split read from a `datasets` directory or Hub dataset that has several (None: `test`).
    split: str | None = option("eval_prompt_data_split")


def read_eval_records(args: Any) -> dict[str, list[dict]]:
    """Every eval dataset's rows (each row checked for the run's prompt fields); errors name the flag, the
    dataset and its path. Run by the start-up check, before Ray starts, and by `EvalDatasets`."""
    settings = EvalSettings.from_args(args)
    required = PromptSettings.from_args(args).record_keys()
    return {
        dataset.name: read_prompt_records(
            dataset.path,
            required_keys=required,
            source=f"--eval-prompt-data {dataset.name}",
            split=settings.split,
            preferred_split=EVAL_SPLIT,
        )
        for dataset in settings.datasets
    }


class EvalDatasets:
    """The held-out prompts of a run, each repeated `--n-samples-per-eval-prompt` times: a prompt's copies share
    a `group_index` (its row number), and `index` counts the samples of the dataset."""

    def __init__(self, args: Any) -> None:
        self.settings = EvalSettings.from_args(args)
        prompts = PromptSettings.from_args(args)
        self.eval_datasets: dict[str, list[Sample]] = {}
        for name, records in read_eval_records(args).items():
            samples = []
            for row, record in enumerate(records):
                prompt = record_to_sample(record, prompts)
                for _ in range(self.settings.n_samples_per_prompt):
                    sample = copy.deepcopy(prompt)
                    sample.group_index = row
                    sample.index = len(samples)
                    samples.append(sample)
            self.eval_datasets[name] = samples

    def __bool__(self) -> bool:
        return bool(self.eval_datasets)


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `correct` passing samples out of `n` (Chen et al., 2021):
    1 - C(n - c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= correct <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= correct <= n; got n={n}, correct={correct}, k={k}")
    return 1.0 - comb(n - correct, k) / comb(n, k)


def _report_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [1 << power for power in range(n.bit_length()) if 1 << power <= n]
    return ks if ks[-1] == n else [*ks, n]


def eval_metrics(name: str, samples: Sequence[Sample], rewards: Sequence[float]) -> dict[str, float]:
    """`eval/<name>/reward` and, when every prompt (`group_index`) has the same n > 1 samples,
    `eval/<name>/pass@k` for k = 1, 2, 4, ... n."""
    if not rewards:
        return {}
    metrics = {f"eval/{name}/reward": sum(rewards) / len(rewards)}
    by_prompt: dict[Any, list[float]] = defaultdict(list)
    for sample, reward in zip(samples, rewards, strict=True):
        by_prompt[sample.group_index].append(reward)
    sizes = {len(group) for group in by_prompt.values()}
    if len(sizes) != 1 or (n := sizes.pop()) < 2:
        return metrics
    passed = [sum(reward >= PASS_REWARD for reward in group) for group in by_prompt.values()]
    for k in _report_ks(n):
        metrics[f"eval/{name}/pass@{k}"] = sum(pass_at_k(n, c, k) for c in passed) / len(passed)
    return metrics
