"""The CPU engine's model side: request parsing, batched sampling, pausing and in-place weight updates.

`CPUEngine` owns one Hugging Face causal LM and its tokenizer and runs a batch of requests through the model as
one left-padded batch, each row with its own sampling parameters and random generator; the background worker that
forms the batches is `slime.plugins.cpu_engine_scheduler.EngineScheduler`. The HTTP layer
(`slime.plugins.cpu_engine_server`) only parses JSON and waits on futures.

Everything that changes the weights (`update_weights_from_disk`, `load_named_tensors` behind the distributed
and tensor updates, `release_memory`/`resume_memory`) runs under `CPUEngine.exclusive()`: it waits for the
decode batch in progress to finish (or to reach a pause, see `PauseGate`) and no new batch starts until it is
done, so weights never change under a running model step. The transfers themselves live in
`slime.plugins.cpu_engine_weights`.

Log-probabilities follow SGLang's default: the log-softmax of the temperature-scaled logits, before top-k
and top-p filtering (temperature 0 means greedy decoding and scores with temperature 1).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128,
    "min_new_tokens": 0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "stop": None,
    "stop_token_ids": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "sampling_seed": None,
    "n": 1,
}
# Top-level /generate fields. Informational ones are accepted and have no effect; feature switches are
# accepted only when off (sglang-router sends them all with their defaults); any other field is rejected
# rather than silently ignored.
GENERATE_FIELDS = {"input_ids", "text", "sampling_params", "return_logprob", "rid"}
INFORMATIONAL_FIELDS = {
    "model",
    "log_metrics",
    "no_logs",
    "logprob_start_len",
    "return_text_in_logprobs",
    "priority",
    "custom_labels",
    "data_parallel_rank",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
}
OFF_ONLY_FIELDS = {
    "stream",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_hidden_states",
    "return_entropy",
    "return_bytes",
    "return_routed_experts",
    "background",
    "image_data",
    "video_data",
    "audio_data",
    "input_embeds",
    "lora_path",
    "custom_logit_processor",
    "session_params",
}


class RequestError(ValueError):
    """A request the engine cannot serve; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class GenerationRequest:
    """One sequence to generate, validated."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    min_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: list[str]
    stop_token_ids: set[int]
    ignore_eos: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    seed: int | None
    return_logprob: bool
    created: float = field(default_factory=time.monotonic)
    aborted: threading.Event = field(default_factory=threading.Event)
    abort_message: str = "Aborted by /abort_request"

    def abort(self, message: str) -> None:
        if not self.aborted.is_set():
            self.abort_message = message
            self.aborted.set()


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"'{name}' is a list of {len(value)} entries but the batch has {count} inputs")
        return value
    return [value] * count


def _check_type(name: str, value: Any, kinds: tuple[type, ...], nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if isinstance(value, bool) and bool not in kinds:
        raise RequestError(f"sampling_params.{name} must be {'/'.join(k.__name__ for k in kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise RequestError(f"sampling_params.{name} must be {'/'.join(k.__name__ for k in kinds)}, got {value!r}")


def parse_sampling_params(raw: Any) -> dict[str, Any]:
    """Validate one `sampling_params` object against the supported SGLang subset; returns it with defaults."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"'sampling_params' must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(SAMPLING_DEFAULTS))
    if unknown:
        raise RequestError(
            f"unsupported sampling_params {unknown}; the CPU engine supports {sorted(SAMPLING_DEFAULTS)}"
        )
    params = {**SAMPLING_DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k in ("stop", "sampling_seed")}}
    _check_type("max_new_tokens", params["max_new_tokens"], (int,))
    _check_type("min_new_tokens", params["min_new_tokens"], (int,))
    _check_type("temperature", params["temperature"], (int, float))
    _check_type("top_p", params["top_p"], (int, float))
    _check_type("top_k", params["top_k"], (int,))
    _check_type("sampling_seed", params["sampling_seed"], (int,), nullable=True)
    for flag in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        _check_type(flag, params[flag], (bool,))
    if params["max_new_tokens"] < 0 or params["min_new_tokens"] < 0:
        raise RequestError("sampling_params.max_new_tokens and min_new_tokens must be >= 0")
    if params["temperature"] < 0:
        raise RequestError(f"sampling_params.temperature must be >= 0, got {params['temperature']}")
    if not 0 < params["top_p"] <= 1:
        raise RequestError(f"sampling_params.top_p must be in (0, 1], got {params['top_p']}")
    if params["top_k"] == 0 or params["top_k"] < -1:
        raise RequestError(f"sampling_params.top_k must be -1 (off) or >= 1, got {params['top_k']}")
    if params["n"] != 1:
        raise RequestError("sampling_params.n must be 1 on the CPU engine; send n copies of the input instead")
    stop = params["stop"]
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise RequestError(f"sampling_params.stop must be a non-empty string or a list of them, got {stop!r}")
    params["stop"] = stop
    stop_ids = params["stop_token_ids"] or []
    if not (isinstance(stop_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids)):
        raise RequestError(f"sampling_params.stop_token_ids must be a list of integers, got {stop_ids!r}")
    params["stop_token_ids"] = set(stop_ids)
    return params


def parse_generate_body(body: Any, tokenizer: Any, vocab_size: int, next_rid) -> tuple[list[GenerationRequest], bool]:
    """Turn a `/generate` JSON body into requests; the flag says whether the answer is a list (batch input)."""
    if not isinstance(body, dict):
        raise RequestError("the /generate body must be a JSON object")
    unknown = sorted(set(body) - GENERATE_FIELDS - INFORMATIONAL_FIELDS - OFF_ONLY_FIELDS)
    if unknown:
        raise RequestError(f"unsupported /generate fields {unknown}; supported: {sorted(GENERATE_FIELDS)}")
    switched_on = sorted(name for name in OFF_ONLY_FIELDS if body.get(name))
    if switched_on:
        raise RequestError(f"the CPU engine does not support {switched_on}; leave them unset or false")
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise RequestError("provide exactly one of 'input_ids' (list of token ids, or list of lists) or 'text'")
    if has_ids:
        ids = body["input_ids"]
        batched = isinstance(ids, list) and bool(ids) and all(isinstance(x, list) for x in ids)
        sequences = ids if batched else [ids]
        for seq in sequences:
            if not isinstance(seq, list) or not seq:
                raise RequestError("'input_ids' must be a non-empty list of token ids or a list of such lists")
            for token in seq:
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                    raise RequestError(f"'input_ids' holds {token!r}; token ids must be integers in [0, {vocab_size})")
    else:
        text = body["text"]
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("'text' must be a string or a non-empty list of strings")
        sequences = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
        if any(not seq for seq in sequences):
            raise RequestError("'text' tokenized to an empty sequence; send at least one character")
    count = len(sequences)
    params = [parse_sampling_params(p) for p in _per_item(body.get("sampling_params"), count, "sampling_params")]
    logprob_flags = _per_item(body.get("return_logprob", False), count, "return_logprob")
    rids = _per_item(body.get("rid"), count, "rid") if body.get("rid") is not None else [None] * count
    if batched and body.get("rid") is not None and not isinstance(body["rid"], list):
        raise RequestError("'rid' must be a list with one id per input when the input is a batch")
    requests = []
    for seq, p, want_logprob, rid in zip(sequences, params, logprob_flags, rids, strict=True):
        requests.append(
            GenerationRequest(
                rid=str(rid) if rid is not None else next_rid(),
                input_ids=list(seq),
                max_new_tokens=p["max_new_tokens"],
                min_new_tokens=p["min_new_tokens"],
                temperature=float(p["temperature"]),
                top_p=float(p["top_p"]),
                top_k=p["top_k"],
                stop=p["stop"],
                stop_token_ids=p["stop_token_ids"],
                ignore_eos=p["ignore_eos"],
                skip_special_tokens=p["skip_special_tokens"],
                no_stop_trim=p["no_stop_trim"],
                seed=p["sampling_seed"],
                return_logprob=bool(want_logprob),
            )
        )
    return requests, batched


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask one row's logits outside the top-k set and the top-p nucleus with -inf."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


#: Seconds a weight update group waits for its ranks to join, and for each broadcast to complete.
DEFAULT_GROUP_TIMEOUT_S = 600.0
WEIGHTS_RELEASED_MESSAGE = (
    "the engine's weights are released (/release_memory_occupation); call /resume_memory_occupation before "
    "generating or updating weights"
)


class PauseGate:
    """Whether generation may run; shared by the scheduler and the decode loop.

    `mode` is None while generating, else the `/pause_generation` mode in force. `cond` guards `mode`, `held`
    (batches waiting at a pause point), `exclusive_waiters` (operations waiting in `CPUEngine.exclusive`) and
    the scheduler's queues: whoever waits for any of them waits on `cond`, whoever changes one notifies it.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.mode: str | None = None
        self.held = 0
        self.exclusive_waiters = 0

    def pause(self, mode: str) -> None:
        with self.cond:
            self.mode = mode
            self.cond.notify_all()

    def resume(self) -> None:
        with self.cond:
            self.mode = None
            self.cond.notify_all()

    def may_start_batch(self) -> bool:
        """Call holding `cond`: not paused and no exclusive operation waiting."""
        return self.mode is None and self.exclusive_waiters == 0


class CPUEngine:
    """A causal LM served on CPU: batched generation, pausing and in-place weight updates.

    Pausing (`gate.pause(mode)`, behind `/pause_generation`; the scheduler aborts requests for "abort"):
    - "abort": queued and running requests end at once with finish_reason {"type": "abort"}; requests that
      arrive while paused wait in the queue until generation continues.
    - "in_place": the running batch stops after the decode step in progress, keeps its KV cache and gives the
      engine lock up, so weights can be updated; after `gate.resume()` it continues where it stopped, with the
      weights loaded by then over the KV cache computed with the old ones (as SGLang's in_place does).
      Queued and new requests wait.
    - "retract": the same, but the running batch drops its KV cache at the pause and, once continued,
      recomputes it from prompt + tokens generated so far with the weights loaded by then, as SGLang's retract
      sends running requests back to its waiting queue.
    Sampled tokens, their log-probabilities and the per-request random generators survive a pause, so a
    request paused and continued without a weight update generates what it would have unpaused. A response's
    `weight_version` is the version served when it finished.
    """

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str | None = None,
        seed: int = 0,
        weights_group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from slime.plugins.cpu_engine_weights import WeightUpdateGroups

        self.model_path = str(model_path)
        self.tokenizer_path = str(tokenizer_path or model_path)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        except Exception as exc:
            raise RuntimeError(
                f"CPU engine cannot load a causal LM from {self.model_path} (tokenizer {self.tokenizer_path}): {exc}"
            ) from exc
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(getattr(config, "max_position_embeddings", 2048))
        eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else next(iter(self.eos_token_ids), 0))
        # transformers 5.x renamed the KV-cache argument and output field `past_key_values` to `cache`.
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.seed = seed
        self.weight_version = "default"
        self.lock = threading.Lock()
        self.gate = PauseGate()
        self.weight_groups = WeightUpdateGroups(weights_group_timeout_s)
        self.released_tags: set[str] = set()
        self._released: Any = None  # cpu_engine_weights.ReleasedWeights while the weights are released
        self.num_batches = 0
        self.num_requests = 0
        self._counter = 0
        self._counter_lock = threading.Lock()

    def next_rid(self) -> str:
        with self._counter_lock:
            self._counter += 1
            return f"cpu-{self._counter}"

    @property
    def weights_released(self) -> bool:
        return self._released is not None

    def _check_weights_loaded(self) -> None:
        if self._released is not None:
            raise RequestError(WEIGHTS_RELEASED_MESSAGE)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engine lock, for changing weights: waits for the batch in progress to finish or reach a pause,
        and keeps the scheduler from starting another one meanwhile (a plain lock could starve behind it)."""
        gate = self.gate
        with gate.cond:
            gate.exclusive_waiters += 1
        try:
            with self.lock:
                yield
        finally:
            with gate.cond:
                gate.exclusive_waiters -= 1
                gate.cond.notify_all()

    def _generator_for(self, request: GenerationRequest, index: int) -> torch.Generator:
        seed = request.seed if request.seed is not None else (self.seed * 1_000_003 + index) % (2**63)
        return torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest]) -> list[dict[str, Any]]:
        """Run `requests` as one left-padded batch; returns one SGLang-shaped response per request."""
        with self.lock:
            self.num_batches += 1
            self.num_requests += len(requests)
            self._hold(requests, [None] * len(requests))  # a pause that came after the scheduler took the batch
            live = [i for i, r in enumerate(requests) if not r.aborted.is_set()]
            outputs: list[tuple[list[int], list[float], dict[str, Any]]] = [
                ([], [], {"type": "abort", "message": r.abort_message}) for r in requests
            ]
            if live:
                self._check_weights_loaded()
                for index, output in zip(live, self._decode([requests[i] for i in live]), strict=True):
                    outputs[index] = output
            weight_version = self.weight_version
        return [self._response(r, *output, weight_version) for r, output in zip(requests, outputs, strict=True)]

    def abort_response(self, request: GenerationRequest) -> dict[str, Any]:
        """The answer for a request aborted before it reached the model."""
        finish = {"type": "abort", "message": request.abort_message}
        return self._response(request, [], [], finish, self.weight_version)

    def _hold(self, requests: list[GenerationRequest], finish: list[dict | None]) -> str | None:
        """A pause point, called holding `self.lock` between decode steps.

        While generation is paused, give the lock up (weights may then change) and wait until it continues or
        every unfinished request is aborted. Returns None when there was no pause, else "retract" when the
        batch was retracted (its KV cache must be recomputed) or "in_place".
        """
        gate = self.gate

        def alive() -> bool:
            return any(f is None and not r.aborted.is_set() for r, f in zip(requests, finish, strict=True))

        with gate.cond:
            if gate.mode is None or not alive():
                return None
            retract = gate.mode == "retract"
            gate.held += 1
            gate.cond.notify_all()
        self.lock.release()
        try:
            with gate.cond:
                while gate.mode is not None and alive():
                    gate.cond.wait()
                    retract = retract or gate.mode == "retract"
        finally:
            self.lock.acquire()
            with gate.cond:
                gate.held -= 1
                gate.cond.notify_all()
        return "retract" if retract else "in_place"

    def _prefill(self, sequences: list[list[int]]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The model's output over the left-padded `sequences` (with its KV cache), their mask and positions."""
        width = max(len(seq) for seq in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            input_ids[row, width - len(seq) :] = torch.tensor(seq)
            mask[row, width - len(seq) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
        return out, mask, positions

    def _decode(self, requests: list[GenerationRequest]) -> list[tuple[list[int], list[float], dict]]:
        batch = len(requests)
        limits = [min(r.max_new_tokens, self.context_length - len(r.input_ids)) for r in requests]
        generators = []
        with self._counter_lock:
            for r in requests:
                self._counter += 1
                generators.append(self._generator_for(r, self._counter))
        tokens: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        finish: list[dict | None] = [None] * batch
        for row, limit in enumerate(limits):
            if limit <= 0:
                finish[row] = {"type": "length", "length": 0}
        out, mask, positions = self._prefill([r.input_ids for r in requests])
        temperatures = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in requests]).unsqueeze(-1)
        while any(f is None for f in finish):
            scaled = out.logits[:, -1, :].float() / temperatures
            scores = torch.log_softmax(scaled, dim=-1)
            next_tokens = torch.full((batch,), self.pad_token_id, dtype=torch.long)
            for row, r in enumerate(requests):
                if finish[row] is not None:
                    continue
                if r.aborted.is_set():
                    finish[row] = {"type": "abort", "message": r.abort_message}
                    continue
                token = self._pick(scaled[row], r, generators[row], len(tokens[row]))
                tokens[row].append(token)
                logprobs[row].append(float(scores[row, token]))
                next_tokens[row] = token
                finish[row] = self._finished(r, tokens[row], limits[row])
            if all(f is not None for f in finish):
                break
            paused = self._hold(requests, finish)
            if paused is not None:
                self._check_weights_loaded()
                for row, r in enumerate(requests):
                    if finish[row] is None and r.aborted.is_set():
                        finish[row] = {"type": "abort", "message": r.abort_message}
                if all(f is not None for f in finish):
                    break
                if paused == "retract":
                    out, mask, positions = self._prefill([r.input_ids + tokens[row] for row, r in enumerate(requests)])
                    continue
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long)], dim=-1)
            positions = positions[:, -1:] + 1
            out = self.model(
                input_ids=next_tokens.unsqueeze(-1),
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_arg: out[self._cache_arg]},
            )
        return [(tokens[row], logprobs[row], finish[row]) for row in range(batch)]

    def _pick(self, logits: torch.Tensor, request: GenerationRequest, generator: torch.Generator, step: int) -> int:
        if step < request.min_new_tokens:
            banned = list(request.stop_token_ids | (set() if request.ignore_eos else self.eos_token_ids))
            if banned:
                logits = logits.clone()
                logits[banned] = float("-inf")
        if request.temperature == 0:
            return int(torch.argmax(logits))
        filtered = _filter_logits(logits, request.top_k, request.top_p)
        return int(torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=generator))

    def _finished(self, request: GenerationRequest, tokens: list[int], limit: int) -> dict | None:
        token = tokens[-1]
        if len(tokens) > request.min_new_tokens:
            if token in request.stop_token_ids or (not request.ignore_eos and token in self.eos_token_ids):
                return {"type": "stop", "matched": token}
            if request.stop:
                text = self.tokenizer.decode(tokens, skip_special_tokens=request.skip_special_tokens)
                for stop in request.stop:
                    if stop in text:
                        return {"type": "stop", "matched": stop}
        if len(tokens) >= limit:
            return {"type": "length", "length": len(tokens)}
        return None

    def _response(
        self, request: GenerationRequest, tokens: list[int], logprobs: list[float], finish: dict, weight_version: str
    ) -> dict[str, Any]:
        shown = tokens
        matched = finish.get("matched")
        if finish["type"] == "stop" and isinstance(matched, int) and not request.no_stop_trim:
            shown = tokens[:-1]
        text = self.tokenizer.decode(shown, skip_special_tokens=request.skip_special_tokens)
        if finish["type"] == "stop" and isinstance(matched, str) and not request.no_stop_trim:
            text = text[: text.index(matched)]
        meta: dict[str, Any] = {
            "id": request.rid,
            "finish_reason": finish,
            "prompt_tokens": len(request.input_ids),
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "weight_version": weight_version,
            "e2e_latency": time.monotonic() - request.created,
        }
        if request.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(logprobs, tokens, strict=True)]
        return {"text": text, "output_ids": tokens, "meta_info": meta}

    # --- weights ---------------------------------------------------------------------------------------

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> str:
        """Load the safetensors weights under `model_path` into the live model, all or nothing.

        Every tensor is checked (names and shapes) before any parameter changes, so a bad directory
        leaves the served weights untouched. Waits for the running batch to finish (or reach a pause).
        """
        from safetensors.torch import load_file

        self._check_weights_loaded()
        directory = Path(model_path)
        index = directory / "model.safetensors.index.json"
        state: dict[str, torch.Tensor] = {}
        try:
            if index.is_file():
                files = sorted({directory / name for name in json.loads(index.read_text())["weight_map"].values()})
            else:
                files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise RequestError(f"no *.safetensors weights in {directory}; save the model with safe_serialization")
            for file in files:
                state.update(load_file(str(file)))
        except RequestError:
            raise
        except Exception as exc:
            raise RequestError(f"cannot read weights from {directory}: {exc}") from exc
        with self.exclusive(), torch.no_grad():
            self._check_weights_loaded()
            current = self.model.state_dict()
            unexpected = sorted(set(state) - set(current))
            tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
            missing = sorted(set(current) - set(state) - tied)
            if unexpected or missing:
                raise RequestError(
                    f"weights in {directory} do not match the served model: missing {missing[:5]}, "
                    f"unexpected {unexpected[:5]}"
                )
            for name, tensor in state.items():
                if tuple(tensor.shape) != tuple(current[name].shape):
                    raise RequestError(
                        f"weights in {directory}: {name} has shape {tuple(tensor.shape)}, "
                        f"the served model expects {tuple(current[name].shape)}"
                    )
            for name, tensor in state.items():
                current[name].copy_(tensor.to(current[name].dtype))
            self.model_path = str(directory)
            if weight_version is not None:
                self.weight_version = str(weight_version)
        return f"Succeeded to update model weights from {directory}.{_version_note(weight_version)}"

    def load_named_tensors(
        self, named: list[tuple[str, torch.Tensor]], weight_version: str | None, endpoint: str
    ) -> None:
        """Copy each `(name, tensor)` into the parameter or buffer of that Hugging Face state-dict name (e.g.
        `model.layers.0.self_attn.q_proj.weight`), converting the dtype; all or nothing: an unknown name or a
        shape mismatch raises before anything changes. `weight_version` (when given) is served afterwards."""
        with self.exclusive(), torch.no_grad():
            self._check_weights_loaded()
            current = self.model.state_dict()
            unknown = [name for name, _ in named if name not in current]
            if unknown:
                raise RequestError(
                    f"{endpoint}: the served model has no parameter named {unknown[:5]}"
                    f"{f' (and {len(unknown) - 5} more)' if len(unknown) > 5 else ''}; names are the Hugging Face "
                    f"state-dict names, e.g. {next(iter(current))!r}. No weights were changed"
                )
            for name, tensor in named:
                if tuple(tensor.shape) != tuple(current[name].shape):
                    raise RequestError(
                        f"{endpoint}: {name} has shape {list(tensor.shape)}, the served model expects "
                        f"{list(current[name].shape)}. No weights were changed"
                    )
            for name, tensor in named:
                current[name].copy_(tensor)
            if weight_version is not None:
                self.weight_version = str(weight_version)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[list[int]],
        group_name: str,
        load_format: str | None,
        weight_version: str | None,
    ) -> str:
        """Receive the tensors rank 0 of `group_name` broadcasts and load them by name.

        The tensors are received whatever their names, so the group stays in step with the trainer; loading
        then refuses unknown names or shapes, leaving the weights as they were.
        """
        self._check_weights_loaded()
        named = self.weight_groups.receive(group_name, names, dtypes, shapes, load_format)
        self.load_named_tensors(named, weight_version, "/update_weights_from_distributed")
        return (
            f"Succeeded to update {len(named)} tensors over weight update group {group_name!r}."
            f"{_version_note(weight_version)}"
        )

    def update_weights_from_tensor(self, entry: str, weight_version: str | None) -> str:
        """Load the `(name, tensor)` pairs of one serialized entry (see `cpu_engine_weights.decode_named_tensors`)."""
        from slime.plugins.cpu_engine_weights import decode_named_tensors

        self._check_weights_loaded()
        named = decode_named_tensors(entry)
        self.load_named_tensors(named, weight_version, "/update_weights_from_tensor")
        return f"Succeeded to update {len(named)} tensors from shared memory.{_version_note(weight_version)}"

    def release_memory(self, tags: list[str] | None) -> None:
        """Release the memory of `tags` (None or empty: all). "weights" frees every parameter's storage after
        saving it to a temporary file (see `cpu_engine_weights.release_weights`); the other tags hold no memory
        on the CPU engine. Releasing what is already released changes nothing."""
        from slime.plugins.cpu_engine_weights import MEMORY_TAGS, release_weights

        wanted = set(tags or MEMORY_TAGS)
        with self.exclusive():
            if "weights" in wanted and self._released is None:
                with self.gate.cond:
                    held = self.gate.held
                if held:
                    raise RequestError(
                        "cannot release the weights while a batch is paused mid-generation: abort it "
                        "(/pause_generation with mode 'abort', or /abort_request) or continue it first"
                    )
                self._released = release_weights(self.model)
            self.released_tags |= wanted

    def resume_memory(self, tags: list[str] | None) -> None:
        """Undo `release_memory` for `tags` (None or empty: all): "weights" come back exactly as served before the
        release. Resuming what is not released changes nothing."""
        from slime.plugins.cpu_engine_weights import MEMORY_TAGS, restore_weights

        wanted = set(tags or MEMORY_TAGS)
        with self.exclusive():
            if "weights" in wanted and self._released is not None:
                restore_weights(self.model, self._released)
                self._released = None
            self.released_tags -= wanted

    def close(self) -> None:
        """Leave every weight update group and remove released weights' temporary file."""
        self.weight_groups.close()
        if self._released is not None:
            self._released.discard()


def _version_note(weight_version: str | None) -> str:
    return f" Weight version updated to {weight_version}." if weight_version is not None else ""
