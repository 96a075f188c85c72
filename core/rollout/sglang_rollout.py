"""The default rollout function: an async HTTP client of SGLang-protocol engines (httpx, no SGLang import).

Everything it reads from `args` comes from one `slime.rollout.settings.RolloutSettings`, built once per
`args` object. Engines are reached at `args.rollout_router_url` when set, else round robin over
`args.rollout_engine_urls` (the manager fills these in). Groups of `n_samples_per_prompt` samples are
generated concurrently (`--sglang-server-concurrency` requests at a time), scored (`slime.rollout.rm_hub`),
filtered (`--dynamic-sampling-filter-path`) and handed to the run's transport session *while generation
continues* (`slime.interfaces.current_session`: the straw transport publishes each kept group durably right
away).

Under `--deterministic` (`slime.determinism`) each sample is generated with its own `sampling_seed`, derived from
the run seed, its prompt group, its index and the rollout step, and finished groups are taken in the order they
were submitted (the data source's order) rather than the order they finished, so the kept groups and their order
never depend on timing; groups handed back at the end of a step lose their partial answers.

A request that fails (connection refused or reset, timeout, HTTP 5xx, a malformed reply) is retried
`--rollout-request-retries` times, each time on another engine when there is one; an engine that cannot be
reached is skipped for the rest of the step. A sample is filled in only from a complete, valid reply, so a
retried request never leaves half an answer behind (nor publishes its sample twice).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from slime.determinism import sample_seed
from slime.interfaces import current_session, run_transport
from slime.rollout import rm_hub
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, finalize_rollout_groups, iter_samples
from slime.rollout.filter_hub.base_types import dynamic_filter_verdict
from slime.rollout.settings import RolloutSettings
from slime.utils.misc import load_function, plugin_name
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

#: Seconds before the first retry of a failed request; doubled for each further retry, at most 2 s.
RETRY_BACKOFF_S = 0.05


def _served_tokenizer_path(url: str) -> str | None:
    """The engine's tokenizer directory from `/model_info` when it is readable here, else None (text mode)."""
    import os

    import httpx

    try:
        response = httpx.get(f"{url}/model_info", timeout=30)
    except httpx.HTTPError as exc:
        logger.warning("Cannot read %s/model_info (%s); prompts are sent as text", url, exc)
        return None
    info = response.json() if response.status_code == 200 else {}
    path = info.get("tokenizer_path") or info.get("model_path") if isinstance(info, dict) else None
    return path if path and os.path.isdir(path) else None


class GenerateState:
    """Per-process generation state: settings, HTTP client, semaphore, sampling parameters and pending group tasks."""

    _instance: GenerateState | None = None

    def __new__(cls, args: Any, *, concurrency: int | None = None) -> GenerateState:
        if cls._instance is None or cls._instance.args is not args:
            instance = super().__new__(cls)
            instance._setup(args, concurrency)
            cls._instance = instance
        return cls._instance

    def _setup(self, args: Any, concurrency: int | None) -> None:
        self.args = args
        self.settings = RolloutSettings.from_args(args)
        self._urls = self.settings.engines()
        self.tokenizer = None
        # A router does not serve /model_info: ask an engine behind it.
        checkpoint = self.settings.hf_checkpoint or _served_tokenizer_path((self.settings.engine_urls or self._urls)[0])
        if checkpoint:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.concurrency = int(concurrency or self.settings.concurrency)
        self.sampling_params = self.settings.sampling_params()
        self._turn = itertools.count()
        self._loop = None
        self.reset()

    def _bind(self) -> None:
        """Semaphore and HTTP client belong to one event loop; each `asyncio.run` step gets fresh ones."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._semaphore = asyncio.Semaphore(self.concurrency)
            self._client = None

    @property
    def semaphore(self) -> asyncio.Semaphore:
        self._bind()
        return self._semaphore

    def reset(self) -> None:
        """Between steps; engines found unreachable get a new chance (the monitor decides which are dead)."""
        self.pendings: set[asyncio.Task] = set()
        #: The group tasks not yet taken, in submission order (taken in this order under --deterministic).
        self.submitted: list[asyncio.Task] = []
        #: The rollout step being generated (part of each sample's seed under --deterministic).
        self.rollout_id = 0
        self.remaining_batch_size = 0
        self.aborted = False
        self.unreachable: dict[str, str] = {}

    def reachable_urls(self) -> list[str]:
        """The engines not found unreachable this step (all of them when every one was)."""
        return [url for url in self._urls if url not in self.unreachable] or list(self._urls)

    def next_url(self, avoid: Collection[str] = ()) -> str:
        """The next engine in turn for a request that already failed on the engines in `avoid`: a reachable
        engine it has not tried, else any engine it has not tried, else a reachable one again."""
        reachable = self.reachable_urls()
        candidates = (
            [url for url in reachable if url not in avoid]
            or [url for url in self._urls if url not in avoid]
            or reachable
        )
        return candidates[next(self._turn) % len(candidates)]

    def mark_unreachable(self, url: str, reason: str) -> None:
        if url not in self.unreachable and len(self._urls) > 1:
            logger.warning("Rollout engine %s is unreachable (%s); this step's requests go to the others", url, reason)
        self.unreachable[url] = reason

    def http(self) -> Any:
        import httpx

        self._bind()
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.settings.http_timeout_s)
        return self._client

    def submit_generate_tasks(self, groups: list) -> None:
        for group in groups:
            task = asyncio.ensure_future(generate_and_rm_group(self.args, group, dict(self.sampling_params)))
            self.pendings.add(task)
            self.submitted.append(task)
        self.remaining_batch_size += len(groups)

    def seeded(self, sample: Sample, sampling_params: dict) -> dict:
        """`sampling_params` with the sample's own `sampling_seed` under --deterministic (unchanged otherwise)."""
        if not self.settings.deterministic:
            return sampling_params
        seed = sample_seed(self.settings.seed, sample.group_index or 0, sample.index or 0, self.rollout_id)
        return {**sampling_params, "sampling_seed": seed}


def _prompt_ids(state: GenerateState, sample: Sample) -> list[int] | None:
    if sample.tokens:
        return list(sample.tokens)
    if state.tokenizer is None:
        return None
    prompt = sample.prompt
    if isinstance(prompt, list):
        return state.tokenizer.apply_chat_template(
            prompt,
            tools=sample.metadata.get("tools"),
            tokenize=True,
            return_dict=False,  # transformers 5 returns a BatchEncoding by default
            add_generation_prompt=True,
            **(state.settings.chat_template_kwargs or {}),
        )
    return state.tokenizer(prompt, add_special_tokens=True)["input_ids"]


def _request_body(state: GenerateState, samples: list[Sample], params: list[dict]) -> tuple[dict, list]:
    """The `/generate` body for `samples` (a batch of them when there are several) and their prompt ids (None
    each in text mode)."""
    prompts = [_prompt_ids(state, sample) for sample in samples]
    body: dict[str, Any] = {"sampling_params": params[0] if len(samples) == 1 else params, "return_logprob": True}
    if all(ids is not None for ids in prompts):
        body["input_ids"] = prompts[0] if len(samples) == 1 else prompts
    else:
        texts = [sample.prompt if isinstance(sample.prompt, str) else str(sample.prompt) for sample in samples]
        body["text"] = texts[0] if len(samples) == 1 else texts
    return body, prompts


def _fill(sample: Sample, prompt_ids: list[int] | None, reply: _Reply) -> Sample:
    """Append `reply` to `sample`: tokens, response, loss mask, log-probs, weight version and status."""
    sample.tokens = (prompt_ids or []) + reply.ids
    sample.response = (sample.response or "") + reply.text
    sample.response_length += len(reply.ids)
    sample.loss_mask = (sample.loss_mask or []) + [1] * len(reply.ids)
    if reply.logprobs is not None:
        sample.rollout_log_probs = (sample.rollout_log_probs or []) + reply.logprobs
    if reply.weight_version is not None:
        sample.weight_versions.append(reply.weight_version)
    sample.status = {
        "length": Sample.Status.TRUNCATED,
        "abort": Sample.Status.ABORTED,
    }.get(reply.finish, Sample.Status.COMPLETED)
    return sample


async def generate(args: Any, sample: Sample, sampling_params: dict) -> Sample:
    """One `/generate` request; fills `tokens`, `response`, `response_length`, `loss_mask`, log-probs, status.

    The tokenizer comes from `--hf-checkpoint`, else from the engine's `/model_info` tokenizer path; without
    one the prompt is sent as text and `tokens` holds only the response ids.
    """
    state = GenerateState(args)
    body, prompts = _request_body(state, [sample], [sampling_params])
    (reply,) = await _post_generate(state, body, 1)
    return _fill(sample, prompts[0], reply)


async def generate_group(args: Any, group: list[Sample], sampling_params: dict) -> list[Sample]:
    """A whole group as one batched `/generate` request (each sample with its own seed); fills every sample as
    `generate` does. Used under --deterministic, where an engine batches the inputs of one request together and
    never with another request's: the group is then generated as one batch, reproducibly."""
    state = GenerateState(args)
    params = [state.seeded(sample, sampling_params) for sample in group]
    async with state.semaphore:
        if state.aborted:
            for sample in group:
                sample.status = Sample.Status.ABORTED
            return group
        body, prompts = _request_body(state, group, params)
        replies = await _post_generate(state, body, len(group))
    for sample, prompt_ids, reply in zip(group, prompts, replies, strict=True):
        _fill(sample, prompt_ids, reply)
        if sample.status != Sample.Status.ABORTED and sample.reward is None:
            sample.reward = await rm_hub.async_rm(args, sample)
    return group


@dataclass(frozen=True)
class _Reply:
    """A validated `/generate` answer."""

    ids: list[int]
    text: str
    logprobs: list[float] | None
    weight_version: str | None
    finish: str | None


def _parse_replies(response: Any, count: int) -> list[_Reply]:
    """The `count` answers of one `/generate` request (an object for one input, a list of them for a batch);
    ValueError when it is not a well-formed SGLang answer."""
    output = response.json()  # json.JSONDecodeError is a ValueError
    if count == 1:
        return [_parse_output(output)]
    if not isinstance(output, list) or len(output) != count:
        raise ValueError(f"expected a JSON list of {count} answers for a batch of {count} inputs")
    return [_parse_output(item) for item in output]


def _parse_output(output: Any) -> _Reply:
    """One input's answer."""
    if not isinstance(output, dict):
        raise ValueError(f"expected a JSON object, got {type(output).__name__}")
    ids = output.get("output_ids") or []
    if not isinstance(ids, list) or not all(isinstance(token, int) for token in ids):
        raise ValueError("'output_ids' is not a list of token ids")
    meta = output.get("meta_info") or {}
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not isinstance(finish or {}, dict):
        raise ValueError("'meta_info' (and its 'finish_reason') must be JSON objects")
    text = output.get("text") or ""
    if not isinstance(text, str):
        raise ValueError("'text' is not a string")
    logprobs = meta.get("output_token_logprobs")
    if logprobs is not None:
        try:
            logprobs = [float(item[0]) for item in logprobs]
        except (TypeError, IndexError, ValueError) as exc:
            raise ValueError(f"'output_token_logprobs' is not a list of [logprob, token, ...]: {exc}") from exc
        if len(logprobs) != len(ids):
            raise ValueError(f"{len(logprobs)} output token log-probs for {len(ids)} output ids")
    version = meta.get("weight_version")
    return _Reply(ids, text, logprobs, None if version is None else str(version), (finish or {}).get("type"))


async def _post_generate(state: GenerateState, body: dict, count: int) -> list[_Reply]:
    """POST `/generate` for `count` inputs, retrying failures on other engines up to `--rollout-request-retries`
    times. A reply is used only when every input's answer in it is complete and valid.

    HTTP 4xx is not retried: the request itself is at fault and every engine would refuse it.
    """
    import httpx

    attempts = state.settings.request_retries + 1
    tried: list[str] = []
    last = ""
    for attempt in range(attempts):
        if attempt:
            logger.warning("Retrying a /generate request on another engine (%d/%d): %s", attempt, attempts - 1, last)
            await asyncio.sleep(min(RETRY_BACKOFF_S * 2 ** (attempt - 1), 2.0))
        url = state.next_url(avoid=tried)
        tried.append(url)
        try:
            response = await state.http().post(f"{url}/generate", json=body)
        except httpx.TransportError as exc:
            reason = f"{type(exc).__name__}: {exc or 'no detail'}"
            last = f"{url}: {reason}"
            if not isinstance(exc, httpx.TimeoutException):  # a slow engine is not a dead one
                state.mark_unreachable(url, reason)
            continue
        if response.status_code >= 500:
            last = f"{url} answered {response.status_code}: {response.text[:500]}"
            continue
        if response.status_code != 200:
            raise RuntimeError(f"Rollout engine {url}/generate answered {response.status_code}: {response.text[:500]}")
        try:
            return _parse_replies(response, count)
        except ValueError as exc:
            last = f"{url} sent a malformed reply ({exc}): {response.text[:200]!r}"
    engines = ", ".join(dict.fromkeys(tried))
    raise RuntimeError(
        f"Rollout engine {tried[0]}/generate failed {attempts} time(s) (engines tried: {engines}; "
        f"--rollout-request-retries {state.settings.request_retries}); last failure: {last}"
    )


async def _next_finished(state: Any, settings: RolloutSettings) -> list[asyncio.Task]:
    """Group tasks that finished and were not taken yet: the oldest submission once it finishes under
    --deterministic (queue order), else whatever finished first."""
    if settings.deterministic:
        oldest = state.submitted.pop(0)
        await asyncio.wait({oldest})
        state.pendings.discard(oldest)
        return [oldest]
    done, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
    if hasattr(state, "submitted"):
        state.submitted = [task for task in state.submitted if task not in done]
    return list(done)


async def generate_and_rm(args: Any, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    """Generate one sample (custom `--custom-generate-function-path` when set) and score it."""
    state = GenerateState(args)
    path = sample.generate_function_path or state.settings.custom_generate_function_path
    sampling_params = state.seeded(sample, sampling_params)
    async with state.semaphore:
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        if path:
            result = await load_function(path)(args, sample, sampling_params)
            transport = run_transport(args)
            for produced in iter_samples(result):
                transport.adopt_generated(sample, produced)
        else:
            result = await generate(args, sample, sampling_params)
    for produced in iter_samples(result):
        if produced.status != Sample.Status.ABORTED and produced.reward is None:
            produced.reward = await rm_hub.async_rm(args, produced)
    return result


async def generate_and_rm_group(args: Any, group: list, sampling_params: dict, evaluation: bool = False) -> list:
    """Generate and score one group; all samples finish (or fail) before the first error is raised.

    Under --deterministic a group without custom generation goes as one batched request (`generate_group`) when
    the engines are reached directly (sglang-router takes one `sampling_params` per batch, and each sample needs its
    own seed); otherwise each sample is its own request, and engines batch the requests that arrive together."""
    state = GenerateState(args)
    settings = state.settings
    custom = settings.custom_generate_function_path or any(s.generate_function_path for s in group)
    if settings.deterministic and not settings.router_url and not custom:
        return await generate_group(args, group, sampling_params)
    results = await asyncio.gather(
        *(generate_and_rm(args, s, sampling_params, evaluation) for s in group), return_exceptions=True
    )
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)


async def abort(args: Any, rollout_id: int) -> list:
    """Abort in-flight requests, wait for their tasks, and return the unfinished groups (for the data source)."""
    state = GenerateState(args)
    state.aborted = True
    if state.pendings:
        # A router does not forward /abort_request: then abort on every engine behind it.
        urls = state.settings.engine_urls if state.settings.router_url else state.reachable_urls()
        for url in urls:
            try:
                await state.http().post(f"{url}/abort_request", json={"abort_all": True})
            except Exception as exc:  # noqa: BLE001 - an engine that is gone has nothing left to abort
                logger.warning("abort_request to %s failed: %s", url, exc)
    aborted = []
    for group in await asyncio.gather(*state.pendings, return_exceptions=True):
        if isinstance(group, BaseException):
            logger.warning("A generation task failed while aborting: %s", group)
            continue
        for sample in iter_samples(group):
            if state.settings.deterministic:
                # How far a request got before the abort is timing: under --deterministic none of it is kept.
                sample.discard_generation()
            sample.status = Sample.Status.PENDING
        aborted.append(group)
    state.pendings, state.submitted = set(), []
    # Handed back in issue order, so the data source serves them again in an order that does not depend on timing.
    return sorted(aborted, key=_first_index)


def _first_index(group: Any) -> int:
    first = next(iter_samples(group), None)
    return (first.index if first is not None else None) or 0


async def generate_rollout_async(args: Any, rollout_id: int, data_source: Any) -> tuple[RolloutFnTrainOutput, list]:
    """Generate until `rollout_batch_size` groups are kept; returns the output and the aborted groups."""
    settings = RolloutSettings.from_args(args)
    state = GenerateState(args)
    state.rollout_id = rollout_id
    session = current_session(args)
    data: list = []
    all_data: list = []
    dropped: dict[str, int] = {}
    try:
        await _collect(args, settings, rollout_id, data_source, state, data, all_data, dropped, session)
    except BaseException:
        for task in state.pendings:
            task.cancel()
        await asyncio.gather(*state.pendings, return_exceptions=True)
        state.reset()
        raise
    aborted = await abort(args, rollout_id)
    state.reset()
    metrics = {**(_filter_metrics(dropped, len(all_data)) or {}), **rm_hub.reward_metrics(args, all_data)}
    if settings.all_samples_process_path:
        hook = _run_all_samples_hook(args, settings, rollout_id, data_source, data, all_data, metrics, session)
        return await hook, aborted
    if settings.sample_filter_path:
        output = finalize_rollout_groups(args, rollout_id, data, metrics, session=session)
    else:
        output = await asyncio.to_thread(finalize_rollout_groups, args, rollout_id, data, metrics, session=session)
    return output, aborted


async def _collect(
    args: Any,
    settings: RolloutSettings,
    rollout_id: int,
    data_source: Any,
    state: Any,
    data: list,
    all_data: list,
    dropped: dict,
    session: Any,
) -> None:
    """Generate until `rollout_batch_size` groups are kept; kept groups go to the session as they finish.

    With `--rollout-all-samples-process-path` the legacy hook must see every Sample in memory, so groups are
    neither published nor discarded here (the hook's caller publishes the kept ones afterwards).
    """
    reader = getattr(data_source, "__self__", None)
    target = settings.batch_size
    over_sampling = settings.over_sampling_batch_size
    n_per_prompt = settings.n_samples_per_prompt
    hook_path = settings.all_samples_process_path
    while len(data) < target:
        while state.remaining_batch_size < target:
            if reader is not None and hasattr(reader, "get_samples_async"):
                groups = await reader.get_samples_async(over_sampling)
            else:
                groups = data_source(over_sampling)
            state.submit_generate_tasks(groups)
        done = await _next_finished(state, settings)
        errors = [task.exception() for task in done if task.exception() is not None]  # retrieves every error
        if errors:
            raise errors[0]
        for task in done:
            group = task.result()
            if len(group) != n_per_prompt:
                raise AssertionError(f"A generated group has {len(group)} samples, expected {n_per_prompt}")
            all_data.append(group)
            if len(data) >= target:
                continue
            verdict = rm_hub.group_verdict(args, group) or dynamic_filter_verdict(args, group, load_function)
            if not verdict.keep:
                state.remaining_batch_size -= 1
                reason = verdict.reason or "filtered"
                dropped[reason] = dropped.get(reason, 0) + 1
                if not hook_path:
                    await asyncio.to_thread(session.discard_group, group, reason)
                continue
            if not hook_path:
                group = await session.publish_group(group, rollout_id)
            data.append(group)


async def _run_all_samples_hook(
    args: Any,
    settings: RolloutSettings,
    rollout_id: int,
    data_source: Any,
    data: list,
    all_data: list,
    metrics: dict | None,
    session: Any,
) -> RolloutFnTrainOutput:
    """Legacy `--rollout-all-samples-process-path`: the hook sees every Sample in memory, then kept groups are
    published (the hook's mutations included)."""
    data.sort(key=_first_index)
    all_data.sort(key=_first_index)
    if settings.sample_filter_path:
        load_function(plugin_name("batch_filters", settings.sample_filter_path, args))(args, data)
    load_function(settings.all_samples_process_path)(args, all_data, data_source)
    refs = [await session.publish_group(group, rollout_id) for group in data]
    reference = await asyncio.to_thread(session.publish_batch, refs, rollout_id)
    return RolloutFnTrainOutput(samples=reference, metrics=metrics)


def _filter_metrics(dropped: dict[str, int], total: int) -> dict | None:
    if not dropped:
        return None
    metrics = {f"rollout/dynamic_filter/drop_{reason}": count for reason, count in dropped.items()}
    count = sum(dropped.values())
    metrics["rollout/dynamic_filter/dropped_groups"] = count
    metrics["rollout/dynamic_filter/dropped_ratio"] = count / max(total, 1)
    return metrics


async def eval_rollout(args: Any, rollout_id: int, data_source: Any) -> RolloutFnEvalOutput:
    """Evaluate `data_source.eval_datasets` (`{name: list[Sample]}`) once each: per dataset, the scored samples
    and their reward values. No sample is published: an evaluation leaves the transport and the queue alone."""
    datasets = getattr(data_source, "eval_datasets", None) or {}
    state = GenerateState(args)
    state.rollout_id = rollout_id
    params = state.settings.sampling_params(evaluation=True)
    results = {}
    for name, samples in datasets.items():
        fresh = copy.deepcopy(samples)  # the dataset's samples stay unanswered for the next evaluation
        # A prompt's copies (consecutive, one `group_index`) are generated as a group, like training groups.
        groups = [list(copies) for _, copies in itertools.groupby(fresh, key=_prompt_key)]
        answered = await asyncio.gather(*(generate_and_rm_group(args, group, dict(params), True) for group in groups))
        scored = [sample for group in answered for sample in group]
        results[name] = {"rewards": [s.get_reward_value(args) for s in scored], "samples": scored}
    return RolloutFnEvalOutput(data=results)


def _prompt_key(sample: Sample) -> int:
    """What an eval sample's prompt copies share: their `group_index` (a sample without one stands alone)."""
    return sample.group_index if sample.group_index is not None else -1 - id(sample)


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """Rollout function entry point (registered as "sglang")."""
    if evaluation:
        return asyncio.run(eval_rollout(args, rollout_id, data_source))
    output, aborted = asyncio.run(generate_rollout_async(args, rollout_id, data_source.get_samples))
    if aborted:
        data_source.add_samples(aborted)
    return output
