"""Reward dispatch: `--custom-rm-path` or `--rm-type`, each a registered reward function name (registry kind
"reward_functions") or a dotted path. A reward function is `fn(args, sample) -> float`; async functions are
awaited. Scoring a batch needs no special function: `batched_async_rm` scores samples concurrently.

`--rm-type a,b --rm-weights 0.7,0.3` combines several rewards into their weighted sum (equal weights by
default); each one's value is kept in `sample.metadata["rewards"]` and reported as `rollout/reward/<name>`.

A reward call that raises, returns something that is not a finite number (a dict is accepted from a single
reward, for `--reward-key`) or takes longer than `--reward-timeout` seconds does not fail the step: the sample
gets reward 0.0 and `sample.metadata["reward_error"]` says which reward failed and why; with
`--reward-error drop-group` the rollout function drops the sample's whole group instead (`group_verdict`).
Errors are counted in `rollout/reward_errors`; the first one of a step is logged with its traceback.

Async reward functions run on the event loop and are cancelled at the timeout. Synchronous ones run in a pool of
`SYNC_REWARD_THREADS` worker threads so that they do not block generation and the timeout can fire; a thread that
overruns cannot be killed: it is abandoned (its result ignored) and keeps its worker until it returns, so a
synchronous reward must be thread-safe and should not hang for ever (while every worker is held by a hung call,
further synchronous rewards time out too, each one counted).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any

from slime.utils.settings import Settings, option
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

#: `sample.metadata` key of a reward error ("NAME: ExceptionType: message").
REWARD_ERROR_KEY = "reward_error"
#: `sample.metadata` key of the components of a combined reward (`{name: value}`).
REWARD_COMPONENTS_KEY = "rewards"
#: `--reward-error` policies.
REWARD_ERROR_POLICIES = ("zero", "drop-group")
#: The reason a group dropped for a reward error is discarded with (and its `rollout/dynamic_filter/drop_*`).
DROP_REASON = "reward_error"


def split_names(value: Any) -> tuple[str, ...]:
    """`"a, b"` -> `("a", "b")`; ValueError on an empty name."""
    if isinstance(value, (list, tuple)):
        return tuple(str(name) for name in value)
    names = tuple(name.strip() for name in str(value).split(","))
    if not all(names):
        raise ValueError(f"empty reward name in {value!r} (comma-separated names: a,b)")
    return names


def parse_weights(value: Any) -> tuple[float, ...]:
    """`"0.7,0.3"` -> `(0.7, 0.3)`; ValueError on a value that is not a finite number."""
    if isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [item.strip() for item in str(value).split(",")]
    try:
        weights = tuple(float(item) for item in items)
    except ValueError as exc:
        raise ValueError(f"--rm-weights must be comma-separated numbers, got {value!r}") from exc
    if not all(math.isfinite(weight) for weight in weights):
        raise ValueError(f"--rm-weights must be finite numbers, got {value!r}")
    return weights


@dataclass(frozen=True)
class RewardSettings(Settings):
    """See the flags of the same names in `slime-run --help`."""

    rm_types: tuple[str, ...] = option("rm_type", (), convert=split_names)
    #: One weight per `rm_types` entry (empty: equal weights).
    weights: tuple[float, ...] = option("rm_weights", (), convert=parse_weights)
    timeout_s: float = option("reward_timeout", 30.0, convert=float, above=0.0)
    error_policy: str = option("reward_error", "zero", choices=REWARD_ERROR_POLICIES)

    def __post_init__(self) -> None:
        super().__post_init__()
        repeated = sorted({name for name in self.rm_types if self.rm_types.count(name) > 1})
        if repeated:
            raise ValueError(f"--rm-type names {', '.join(repeated)} more than once; weigh it with --rm-weights")
        if self.weights and len(self.weights) != len(self.rm_types):
            raise ValueError(
                f"--rm-weights gives {len(self.weights)} weight(s) for the {len(self.rm_types)} reward(s) of "
                f"--rm-type {','.join(self.rm_types) or '(none)'}; give one weight per reward"
            )

    @property
    def reward_weights(self) -> tuple[float, ...]:
        """The weights to combine `rm_types` with (equal, summing to 1, unless `--rm-weights` says otherwise)."""
        return self.weights or tuple(1.0 / len(self.rm_types) for _ in self.rm_types)


_settings_cache: tuple[Any, RewardSettings] | None = None


def reward_settings(args: Any) -> RewardSettings:
    """The reward settings of `args`, built once per `args` object."""
    global _settings_cache
    if _settings_cache is None or _settings_cache[0] is not args:
        _settings_cache = (args, RewardSettings.from_args(args))
    return _settings_cache[1]


def _load(name: str, args: Any) -> Any:
    from slime.utils import misc

    return misc.load_function(misc.plugin_name("reward_functions", name, args))


def resolve_reward_functions(args: Any, sample: Sample | None = None) -> list[tuple[str, Any, float]]:
    """`(name, function, weight)` of each reward that scores `sample`: its own `custom_rm_path`, else
    `--custom-rm-path`, else each `--rm-type` name with its `--rm-weights` weight."""
    path = getattr(sample, "custom_rm_path", None) or getattr(args, "custom_rm_path", None)
    if path:
        return [(path, _load(path, args), 1.0)]
    settings = reward_settings(args)
    if not settings.rm_types:
        raise ValueError("No reward function configured: set --rm-type NAME (a registered reward) or --custom-rm-path")
    return [(name, _load(name, args), w) for name, w in zip(settings.rm_types, settings.reward_weights, strict=True)]


def resolve_reward_function(args: Any, sample: Sample | None = None) -> Any:
    """The reward function for `sample`: its own `custom_rm_path`, `--custom-rm-path`, else `--rm-type` (a
    combined `--rm-type a,b` gives an async function returning the weighted sum, without error isolation)."""
    rewards = resolve_reward_functions(args, sample)
    if len(rewards) == 1:
        return rewards[0][1]

    async def combined(args: Any, sample: Sample) -> float:
        total = 0.0
        for _, function, weight in rewards:
            value = function(args, sample)
            total += weight * float(await value if inspect.isawaitable(value) else value)
        return total

    return combined


def _is_async(function: Any) -> bool:
    """An `async def` function, or an object whose `__call__` is one."""
    if inspect.iscoroutinefunction(function):
        return True
    return callable(function) and inspect.iscoroutinefunction(type(function).__call__)


#: Worker threads of synchronous rewards (not the loop's default executor: `asyncio.run` waits for that one at the
#: end of a step, so a hung reward would hold the step up after its timeout fired).
SYNC_REWARD_THREADS = 32
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def _sync_executor() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(SYNC_REWARD_THREADS, thread_name_prefix="slime-reward")
    return _executor


async def _invoke(function: Any, args: Any, sample: Sample) -> Any:
    if _is_async(function):
        value = function(args, sample)
    else:
        call = functools.partial(contextvars.copy_context().run, function, args, sample)
        value = await asyncio.get_running_loop().run_in_executor(_sync_executor(), call)
    if inspect.isawaitable(value):
        value = await value
    return value


def _checked(name: str, value: Any, *, allow_dict: bool) -> Any:
    if allow_dict and isinstance(value, dict):
        return value
    if not isinstance(value, (str, bytes)) and hasattr(value, "__float__"):  # numbers, numpy and 0-d tensors
        number = float(value)
        if math.isfinite(number):
            return number
    raise TypeError(f"reward {name!r} returned {value!r}, not a finite number")


class _FirstErrorLog:
    """Logs the first reward error of a step (one event loop run, until `reward_metrics` closes the step)."""

    def __init__(self) -> None:
        self.loop: Any = None
        self.logged = False

    def report(self, sample: Sample, name: str, exc: BaseException) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not self.loop:
            self.loop, self.logged = loop, False
        if self.logged:
            return
        self.logged = True
        logger.warning(
            "Reward %r failed on sample %s (group %s): %s; the sample is marked %r (further reward errors of this "
            "step are counted in rollout/reward_errors, not logged)",
            name,
            sample.index,
            sample.group_index,
            _describe(exc),
            REWARD_ERROR_KEY,
            exc_info=(type(exc), exc, exc.__traceback__),
        )

    def close_step(self) -> None:
        self.logged = False


_first_error = _FirstErrorLog()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _mark(sample: Sample, key: str, value: Any) -> None:
    """Set `sample.metadata[key]` on a new dict: a data source may share one metadata dict between the samples of a
    group, and one sample's reward must not mark its siblings."""
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    sample.metadata = {**metadata, key: value}


async def _score_one(name: str, function: Any, args: Any, sample: Sample, timeout_s: float, allow_dict: bool) -> Any:
    try:
        value = await asyncio.wait_for(_invoke(function, args, sample), timeout_s)
    except asyncio.TimeoutError as exc:
        raise TimeoutError(f"reward {name!r} took longer than --reward-timeout {timeout_s:g} s") from exc
    return _checked(name, value, allow_dict=allow_dict)


async def async_rm(args: Any, sample: Sample) -> float | dict:
    """Score one sample; a reward error gives 0.0 and marks the sample (see the module's doc)."""
    rewards = resolve_reward_functions(args, sample)
    timeout_s = reward_settings(args).timeout_s
    single = len(rewards) == 1
    # A combined reward's parts run concurrently, each within the timeout.
    results = await asyncio.gather(
        *(_score_one(name, function, args, sample, timeout_s, allow_dict=single) for name, function, _ in rewards),
        return_exceptions=True,
    )
    for (name, _, _), result in zip(rewards, results, strict=True):
        if isinstance(result, Exception):  # any failure of user code marks the sample, not the step
            _mark(sample, REWARD_ERROR_KEY, f"{name}: {_describe(result)}")
            _first_error.report(sample, name, result)
            return 0.0
        if isinstance(result, BaseException):  # cancellation and the like are not the reward's fault
            raise result
    if single:
        return results[0]
    _mark(sample, REWARD_COMPONENTS_KEY, {name: value for (name, _, _), value in zip(rewards, results, strict=True)})
    return sum(weight * value for (_, _, weight), value in zip(rewards, results, strict=True))


async def batched_async_rm(args: Any, samples: list[Sample]) -> list[float]:
    """Score samples concurrently, in order."""
    return list(await asyncio.gather(*(async_rm(args, sample) for sample in samples)))


def reward_error(sample: Any) -> str | None:
    """The reward error recorded on `sample`, or None."""
    metadata = getattr(sample, "metadata", None)
    return metadata.get(REWARD_ERROR_KEY) if isinstance(metadata, dict) else None


def group_verdict(args: Any, group: list) -> Any:
    """Under `--reward-error drop-group`, a "drop" verdict (reason `reward_error`) for a group with a reward
    error; None otherwise (the group goes on to the dynamic filter)."""
    from slime.rollout.base_types import iter_samples
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput

    if reward_settings(args).error_policy != "drop-group":
        return None
    if any(reward_error(sample) for sample in iter_samples(group)):
        return DynamicFilterOutput(keep=False, reason=DROP_REASON)
    return None


def reward_metrics(args: Any, groups: list) -> dict[str, float]:
    """`rollout/reward_errors` (samples whose reward failed) and, for a combined `--rm-type`, the mean of each
    reward `rollout/reward/<name>` over the samples it scored; closes the step for the first-error log."""
    from slime.rollout.base_types import iter_samples

    _first_error.close_step()
    errors = 0
    sums: dict[str, list[float]] = {}
    for group in groups:
        for sample in iter_samples(group):
            if reward_error(sample):
                errors += 1
                continue
            components = sample.metadata.get(REWARD_COMPONENTS_KEY) if isinstance(sample.metadata, dict) else None
            for name, value in (components or {}).items():
                sums.setdefault(name, []).append(value)
    metrics: dict[str, float] = {"rollout/reward_errors": errors}
    if len(reward_settings(args).rm_types) > 1:
        for name, values in sums.items():
            metrics[f"rollout/reward/{name}"] = sum(values) / len(values)
    return metrics
