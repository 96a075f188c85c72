"""The `remote` reward: samples are scored by an HTTP reward server at `--rm-url`.

Request: `POST <rm-url>` with a JSON body `{"samples": [{"index", "group_index", "prompt", "response", "label",
"metadata"}, ...]}` (values that are not JSON are sent as their `str`), and `Authorization: Bearer <key>` when
`--rm-api-key` (or the environment variable SLIME_RM_API_KEY) is set. Response: HTTP 200 with
`{"rewards": [number, ...]}`, one finite number per sample, in order.

A request that fails with a connection error, a timeout (`--rm-timeout`, default `--reward-timeout`), HTTP 429
or HTTP 5xx is retried up to `--rm-max-retries` times, waiting `RETRY_BACKOFF_S` seconds before the first retry
and twice as long before each further one (at most `RETRY_BACKOFF_MAX_S`). Any other HTTP status, or a 200 whose
body is not that JSON (not JSON, no `rewards` list, the wrong count, a value that is not a finite number), is not
retried: the call raises an error naming the URL, which marks the samples as reward errors (`slime.rollout.rm_hub`).

Batching: the rollout functions score one sample per call; `remote_reward` gathers the calls of one event loop
that arrive within `BATCH_WINDOW_S` seconds of the first into one request of at most `--rm-batch-size` samples (a
full batch is sent at once; `--rm-batch-size 1` sends each sample alone, without waiting). A failed request marks
every sample of its batch. Requests run concurrently, at most `MAX_CONNECTIONS` connections per rollout process.
`score_batch` sends a given list of samples as one request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from slime.utils.settings import Settings, option

logger = logging.getLogger(__name__)

API_KEY_ENV = "SLIME_RM_API_KEY"
#: Seconds before the first retry; doubled for each further one, at most `RETRY_BACKOFF_MAX_S`.
RETRY_BACKOFF_S = 0.2
RETRY_BACKOFF_MAX_S = 5.0
#: Connections to the reward server at once, per rollout process (further requests wait for one).
MAX_CONNECTIONS = 64
#: Seconds a batch waits for more samples after its first one (unless it is full first).
BATCH_WINDOW_S = 0.02


class RemoteRewardError(RuntimeError):
    """The reward server at a URL failed or answered something that is not a list of rewards."""


@dataclass(frozen=True)
class RemoteRewardSettings(Settings):
    """See the flags of the same names in `slime-run --help`."""

    url: str | None = option("rm_url")
    #: Seconds per request (None: `reward_timeout_s`).
    request_timeout_s: float | None = option("rm_timeout", convert=float, above=0.0)
    reward_timeout_s: float = option("reward_timeout", 30.0, convert=float, above=0.0)
    max_retries: int = option("rm_max_retries", 3, convert=int, minimum=0)
    batch_size: int = option("rm_batch_size", 16, convert=int, minimum=1)
    api_key: str | None = option("rm_api_key")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--rm-url must be an http:// or https:// URL, got {self.url!r}")

    @property
    def timeout_s(self) -> float:
        return self.request_timeout_s if self.request_timeout_s is not None else self.reward_timeout_s

    def bearer(self) -> str | None:
        return self.api_key or os.environ.get(API_KEY_ENV) or None


def check_remote_reward_options(args: Any, *, remote: bool) -> None:
    """ValueError naming the flag when the remote reward's flags are wrong, or when `remote` is used without
    `--rm-url`."""
    settings = RemoteRewardSettings.from_args(args)
    if remote and not settings.url:
        raise ValueError("--rm-type remote needs --rm-url URL (the reward server, see docs/rewards.md)")


class _Client:
    """One httpx client per event loop (each `asyncio.run` rollout step gets its own)."""

    def __init__(self) -> None:
        self.loop: Any = None
        self.client: Any = None
        self.settings: tuple[Any, RemoteRewardSettings] | None = None

    def get(self) -> Any:
        import httpx

        loop = asyncio.get_running_loop()
        if self.loop is not loop or self.client is None:
            self.loop = loop
            self.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=MAX_CONNECTIONS))
        return self.client

    def settings_of(self, args: Any) -> RemoteRewardSettings:
        if self.settings is None or self.settings[0] is not args:
            self.settings = (args, RemoteRewardSettings.from_args(args))
        return self.settings[1]


_client = _Client()


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def request_body(samples: list[Any]) -> dict[str, Any]:
    """The JSON body that asks for the rewards of `samples`."""
    return {
        "samples": [
            _jsonable(
                {
                    "index": sample.index,
                    "group_index": sample.group_index,
                    "prompt": sample.prompt,
                    "response": sample.response,
                    "label": sample.label,
                    "metadata": sample.metadata,
                }
            )
            for sample in samples
        ]
    }


def parse_rewards(url: str, response: Any, count: int) -> list[float]:
    """The rewards of a 200 answer; RemoteRewardError naming `url` when it is not `count` finite numbers."""
    try:
        body = response.json()
    except ValueError as exc:
        raise RemoteRewardError(f"reward server {url} answered non-JSON: {response.text[:200]!r}") from exc
    rewards = body.get("rewards") if isinstance(body, dict) else None
    if not isinstance(rewards, list):
        raise RemoteRewardError(f'reward server {url} answered no "rewards" list: {response.text[:200]!r}')
    if len(rewards) != count:
        raise RemoteRewardError(f"reward server {url} answered {len(rewards)} reward(s) for {count} sample(s)")
    values = []
    for value in rewards:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RemoteRewardError(f"reward server {url} answered a reward that is not a finite number: {value!r}")
        values.append(float(value))
    return values


def _retryable_status(status: int) -> bool:
    return status == 429 or status >= 500


async def score_batch(args: Any, samples: list[Any]) -> list[float]:
    """The rewards of `samples` from `--rm-url`, retrying failures (see the module's doc)."""
    import httpx

    if not samples:
        return []
    settings = _client.settings_of(args)
    if not settings.url:
        raise RemoteRewardError("--rm-type remote needs --rm-url URL")
    url = settings.url
    headers = {"Content-Type": "application/json"}
    if key := settings.bearer():
        headers["Authorization"] = f"Bearer {key}"
    content = json.dumps(request_body(samples))
    attempts = settings.max_retries + 1
    last = ""
    for attempt in range(attempts):
        if attempt:
            delay = min(RETRY_BACKOFF_S * 2 ** (attempt - 1), RETRY_BACKOFF_MAX_S)
            logger.info("Retrying the reward server %s in %.2f s (%d/%d): %s", url, delay, attempt, attempts - 1, last)
            await asyncio.sleep(delay)
        timeout = httpx.Timeout(settings.timeout_s, pool=None)
        try:
            response = await _client.get().post(url, content=content, headers=headers, timeout=timeout)
        except httpx.TransportError as exc:
            last = f"{type(exc).__name__}: {exc or 'no detail'}"
            continue
        if _retryable_status(response.status_code):
            last = f"HTTP {response.status_code}: {response.text[:200]}"
            continue
        if response.status_code != 200:
            raise RemoteRewardError(f"reward server {url} answered HTTP {response.status_code}: {response.text[:200]}")
        return parse_rewards(url, response, len(samples))
    raise RemoteRewardError(
        f"reward server {url} failed {attempts} time(s) (--rm-max-retries {settings.max_retries}); last failure: {last}"
    )


class _Batcher:
    """Gathers one event loop's `remote_reward` calls into batches (see the module's doc)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        #: Per `args` object: (args, [(sample, future)]) not sent yet, and the timer that will send them.
        self.pending: dict[int, tuple[Any, list[tuple[Any, asyncio.Future]]]] = {}
        self.timers: dict[int, asyncio.TimerHandle] = {}
        self.sending: set[asyncio.Task] = set()

    def submit(self, args: Any, sample: Any) -> asyncio.Future:
        future = self.loop.create_future()
        key = id(args)
        items = self.pending.setdefault(key, (args, []))[1]
        items.append((sample, future))
        if len(items) >= _client.settings_of(args).batch_size:
            self.flush(key)
        elif key not in self.timers:
            self.timers[key] = self.loop.call_later(BATCH_WINDOW_S, self.flush, key)
        return future

    def flush(self, key: int) -> None:
        timer = self.timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        args, items = self.pending.pop(key, (None, []))
        items = [(sample, future) for sample, future in items if not future.done()]  # done: its caller gave up
        if items:
            task = self.loop.create_task(self._send(args, items))
            self.sending.add(task)
            task.add_done_callback(self.sending.discard)

    async def _send(self, args: Any, items: list[tuple[Any, asyncio.Future]]) -> None:
        try:
            rewards = await score_batch(args, [sample for sample, _ in items])
        except Exception as exc:  # noqa: BLE001 - handed to every caller of the batch
            for _, future in items:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), reward in zip(items, rewards, strict=True):
            if not future.done():
                future.set_result(reward)


_batcher: _Batcher | None = None


async def remote_reward(args: Any, sample: Any) -> float:
    """The `remote` reward of one sample (registered as "remote"), sent in a batch with the samples scored at the
    same time."""
    global _batcher
    loop = asyncio.get_running_loop()
    if _batcher is None or _batcher.loop is not loop:
        _batcher = _Batcher(loop)
    return await _batcher.submit(args, sample)
