"""The contracts of the two engine-side plugin kinds: rollout engines and training backends.

A **rollout engine** plugin (`RolloutEngineSpec(name, launcher)`, selected by `--rollout-engine NAME`) gives an
`EngineLauncher`: `launcher(args, num_engines)` starts `num_engines` HTTP servers that speak the SGLang
protocol (`ENGINE_ENDPOINTS`) and returns `LaunchedEngines`, their base URLs in slot order. The rollout
manager launches the engines once (`slime.ray.serving.RolloutServer.launch`) and calls the launcher again
with the number of missing engines when the health monitor has marked some dead (`RolloutServer.recover`).

A **training backend** plugin (`TrainBackendSpec(name, cls)`, selected by `--train-backend NAME`) gives the
class of one training rank, a `TrainBackend`. `slime.ray.actor_group.RayTrainGroup` wraps it with
`ray.remote` (unless it already is a Ray actor class), starts one instance per placement-group bundle with
no constructor arguments (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` are in the
rank's environment) and calls the methods below on every rank. Each step's data is split into one shard per
data-parallel rank: `WORLD_SIZE` shards, unless the class has a static method
`data_parallel_size(args, world_size) -> int` (a backend that splits the model itself across ranks, with tensor
or pipeline parallelism, answers `world_size // model-parallel size`); see `data_parallel_size`.

After every step (and once before the first) the group calls `update_weights(update)` on every rank with
one `slime.weight_sync.WeightUpdate`: `update.version` counts from `args.update_weight_start_version` (set before
`init`), one per update, and `update.transport` is `--update-weight-transport`:

- "disk" (the default): every rank exports the current weights to `update.disk_dir`
  (`weight_dir(--update-weight-disk-dir, version)`, i.e. `weight_v{version:06d}/`), complete or not at all:
  Hugging Face `*.safetensors` weights (with `model.safetensors.index.json` when sharded) of the served
  architecture. The rollout manager then has every engine `POST /update_weights_from_disk {"model_path": that
  directory, "weight_version": str(version)}` and the group removes the directory (unless
  `--update-weight-disk-keep-files`).
- "distributed" or "tensor": the engines are already paused and `update.engine_urls` names them. The rank that
  holds the full weights (gathered first when the backend shards them) calls
  `slime.weight_sync.send_weights(update, named_tensors)` with Hugging Face names; the other ranks wait for it.
  Every rank returns, or raises, only once the send has ended, so the ranks agree on the outcome.

Either way the rollout manager then checks that every engine reports `str(version)` in `GET /model_info` and
lets them generate again.

`check_run_backends(args)` resolves and checks both before any Ray actor starts, with errors that name the
plugin that provides them and what is missing.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from slime.plugin_manager import PluginError
from slime.weight_sync import WeightUpdate

__all__ = [
    "ENGINE_ENDPOINTS",
    "EngineEndpoint",
    "EngineLauncher",
    "LaunchedEngines",
    "PluginContractError",
    "TRAIN_BACKEND_METHODS",
    "TrainBackend",
    "check_engine_launcher",
    "check_launched_engines",
    "check_run_backends",
    "check_train_backend",
    "data_parallel_size",
    "resolve_engine_launcher",
    "resolve_train_backend",
    "weight_dir",
]


class PluginContractError(PluginError):
    """A rollout-engine or train-backend plugin does not provide what its kind's contract requires (`slime-run`
    prints it without a traceback)."""


# ------------------------------------------------------------------------------------------ engines


@runtime_checkable
class LaunchedEngines(Protocol):
    """What a launcher returns: the engines' base URLs (`http://host:port`, no trailing slash), in slot order.

    It is iterated for the URLs, and may carry two attributes (a plain `list[str]` is accepted too):
    `actors`, one Ray actor handle per URL, which the health monitor kills (`ray.kill`) when it marks that
    engine dead (a hung engine must not keep its resources while its replacement starts); and `shutdown()`,
    called once when the run (or the rollout manager) ends, which must stop every engine of this launch.
    Keep the engines alive for as long as this object lives (Ray destroys actors nobody holds a handle to).
    """

    def __iter__(self) -> Iterator[str]: ...

    def __len__(self) -> int: ...


@runtime_checkable
class EngineLauncher(Protocol):
    """`launcher(args, num_engines) -> LaunchedEngines`: start `num_engines` engines and return once every one
    answers `GET /health` with 200.

    `args` is the run's namespace (read your plugin's own options from it: `args.hf_checkpoint` is the
    model to serve, or None for the plugin's default). Called in the rollout manager's Ray actor, once at
    start and again with the number of dead engines before a weight update that follows an engine failure;
    a relaunched engine must serve the weights of `--hf-checkpoint` (the update that follows gives it the
    current ones). Raise an error naming the engine and why when one does not come up; stop the others of
    the launch first.
    """

    def __call__(self, args: Any, num_engines: int) -> LaunchedEngines: ...


@dataclass(frozen=True)
class EngineEndpoint:
    """One HTTP endpoint an engine serves: who calls it, with what body, and what it must answer."""

    method: str
    path: str
    caller: str
    request: str
    response: str


#: Every endpoint slime-rl and sglang-router (`--rollout-router sglang-router`) call on an engine. Errors of
#: `/generate` answer a 4xx status (not retried) or 5xx (retried on another engine) with a JSON body
#: `{"error": {"message": str, "code": int}}`; the weight and control endpoints refuse with 400 and
#: `{"success": false, "message": str}`, which stops the update with an error naming the engine and the message
#: (`slime.engine_control`).
ENGINE_ENDPOINTS: tuple[EngineEndpoint, ...] = (
    EngineEndpoint(
        "POST",
        "/generate",
        "the rollout functions (slime.rollout.sglang_rollout.generate), one request per sample; sglang-router",
        "{'input_ids': list[int]} or {'text': str}; 'sampling_params': {'temperature': float, 'top_p': float, "
        "'top_k': int (-1: off), 'max_new_tokens': int}; 'return_logprob': true",
        "{'text': str, 'output_ids': list[int], 'meta_info': {'finish_reason': {'type': 'stop' | 'length' | "
        "'abort'}, 'output_token_logprobs': [[logprob, token_id, ...], ...] (one per output id), "
        "'weight_version': str}}",
    ),
    EngineEndpoint(
        "GET",
        "/health",
        "engine launchers, before they return the engines; sglang-router",
        "none",
        "status 200 while the engine's server is up; the body is ignored",
    ),
    EngineEndpoint(
        "GET",
        "/health_generate",
        "the health monitor (slime.ray.health_monitor), every --rollout-health-check-interval s",
        "none",
        "status 200 once a one-token generation ran (within --rollout-health-check-timeout)",
    ),
    EngineEndpoint(
        "GET",
        "/v1/loads",
        "the health monitor, when /health_generate is slow (a busy engine is not a dead one)",
        "none",
        "{'loads': [{'num_running_reqs': int, 'num_waiting_reqs': int, ...}, ...]}",
    ),
    EngineEndpoint(
        "GET",
        "/model_info",
        "the rollout functions, when --hf-checkpoint is unset (for the tokenizer); the rollout manager, after "
        "every weight update and for a checkpoint's weight version (slime.engine_control.engine_weight_versions); "
        "sglang-router at registration",
        "none",
        "{'model_path': str, 'tokenizer_path': str | None, 'is_generation': true, 'weight_version': str} "
        "(weight_version: 'default' until the first update, then the str of the update's version)",
    ),
    EngineEndpoint(
        "GET",
        "/server_info",
        "the weight senders (slime.weight_sync), before a distributed or tensor update; sglang-router, when it "
        "registers the engine as a worker",
        "none",
        "a JSON object with 'tp_size': int (the engine's ranks that receive weights) and 'dp_size': int (1, or "
        "'enable_dp_attention': true); sglang-router also reads 'model_path' and 'served_model_name'",
    ),
    EngineEndpoint(
        "POST",
        "/pause_generation",
        "the rollout manager, before every weight update (slime.engine_control.pause_generation)",
        "{'mode': 'abort' | 'retract'} ('retract' with --partial-rollout)",
        "status 200 once generation stopped: 'abort' ends in-flight requests (finish_reason 'abort'), 'retract' "
        "holds them until /continue_generation; new requests wait until then",
    ),
    EngineEndpoint(
        "POST",
        "/continue_generation",
        "the rollout manager, after every weight update, once the engine reports the new version",
        "{}",
        "status 200; retracted and waiting requests run with the new weights",
    ),
    EngineEndpoint(
        "POST",
        "/release_memory_occupation",
        "the rollout manager after every rollout step with --offload-rollout (engines sharing the trainers' devices)",
        "{'tags': null} (all: weights and KV cache)",
        "status 200 once the memory is free; the engine generates again only after /resume_memory_occupation",
    ),
    EngineEndpoint(
        "POST",
        "/resume_memory_occupation",
        "the rollout manager before the next weight update (or generation) of engines that released memory",
        "{'tags': null}",
        "status 200 once the engine holds its memory (and the weights it served) again",
    ),
    EngineEndpoint(
        "POST",
        "/update_weights_from_disk",
        "the rollout manager, after every export with --update-weight-transport disk (see weight_dir)",
        "{'model_path': str (a weight_v{version:06d} directory), 'weight_version': str}",
        "status 200 once the engine serves those weights (later /generate answers carry that weight_version); "
        "400 with {'success': false, 'message': str} when the directory cannot be loaded, the old weights kept",
    ),
    EngineEndpoint(
        "POST",
        "/init_weights_update_group",
        "slime.weight_sync.DistributedWeightSender (--update-weight-transport distributed), to every engine at "
        "once while the trainer joins as rank 0",
        "{'master_address': str, 'master_port': int, 'rank_offset': int, 'world_size': int, 'group_name': str, "
        "'backend': 'gloo' | 'nccl'}: engine rank i joins as rank_offset + i of world_size = 1 + the sum of "
        "tp_size, over a tcp:// rendezvous whose keys it prefixes with group_name (torch.distributed's group helper)",
        "status 200 {'success': true, 'message': str} once its ranks joined; 400 {'success': false, ...}",
    ),
    EngineEndpoint(
        "POST",
        "/update_weights_from_distributed",
        "slime.weight_sync.DistributedWeightSender, once per bucket, to every engine while it broadcasts",
        "{'names': list[str], 'dtypes': list[str] ('float32', 'bfloat16', ...), 'shapes': list[list[int]], "
        "'group_name': str, 'load_format': 'flattened_bucket', 'flush_cache': bool, 'weight_version': str | null} "
        "(flush_cache and weight_version on the last bucket only)",
        "status 200 {'success': true} once the engine received the bucket (one uint8 tensor, the concatenated "
        "bytes of the tensors in order, broadcast from rank 0) and loaded it; weight_version, when given, is the "
        "served version from then on; 400 {'success': false, 'message': str}",
    ),
    EngineEndpoint(
        "POST",
        "/destroy_weights_update_group",
        "slime.weight_sync.DistributedWeightSender, after every distributed update (also a failed one)",
        "{'group_name': str}",
        "status 200 once the engine left the group; 400 {'success': false, ...} when it has no such group",
    ),
    EngineEndpoint(
        "POST",
        "/update_weights_from_tensor",
        "slime.weight_sync.TensorWeightSender (--update-weight-transport tensor; engines on training rank 0's "
        "machine), once per bucket",
        "{'serialized_named_tensors': list[str] (one per engine TP rank: base64 of a ForkingPickler dump of "
        "[(name, tensor), ...], tensors in shared memory), 'load_format': null, 'flush_cache': bool, "
        "'weight_version': str | null}",
        "status 200 {'success': true} once the tensors are loaded; 400 {'success': false, 'message': str}",
    ),
    EngineEndpoint(
        "POST",
        "/abort_request",
        "the rollout functions at the end of a step, for requests still running",
        "{'abort_all': true} (or {'rid': str})",
        "status 200; aborted requests answer /generate with finish_reason type 'abort'",
    ),
)


def weight_dir(disk_dir: str | Path, version: int) -> Path:
    """Where weight export `version` goes under `--update-weight-disk-dir`: `weight_v{version:06d}`."""
    return Path(disk_dir) / f"weight_v{int(version):06d}"


# ------------------------------------------------------------------------------------ train backends


@runtime_checkable
class TrainBackend(Protocol):
    """One training rank (data-parallel rank `RANK` of `WORLD_SIZE`); see the module docstring.

    The constructor takes no arguments. `RayTrainGroup` calls, on every rank at once:
    `init` once per start, then per step `train`, `save_model` when a checkpoint is due, and
    `update_weights`.
    """

    def init(self, args: Any, role: str, with_ref: bool = False, with_opd_teacher: bool = False) -> int:
        """Load the model (`role` "actor", or "critic" with `--use-critic`) and, when `args.load` names a
        checkpoint (the latest under it unless `args.ckpt_step`), its training state; return the first rollout
        id to train: the loaded step + 1, else `args.start_rollout_id` or 0. All ranks must return the same.
        `with_ref`: keep a frozen reference model for the KL terms (`--kl-coef`, `--use-kl-loss --kl-loss-coef`)."""
        ...

    def train(self, rollout_id: int, rollout_data_ref: Sequence[Any]) -> dict[str, float] | None:
        """Train on one rollout step. `rollout_data_ref` holds one reference per data-parallel rank; load this
        rank's shard with `slime.utils.data.process_rollout_data(rollout_data_ref, dp_rank, dp_size)` (a dict of
        per-sample lists: `tokens`, `response_lengths`, `loss_masks`, `rewards` or `advantages`, and
        `rollout_log_probs` when the engines returned them). Returns metrics (`train/*`; rank 0's are logged).
        With `--use-critic` the actor's ranks also get `external_data=`, the critic ranks' `train` results."""
        ...

    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        """Write step `rollout_id`'s model and training state under `args.save` durably, so that `init` with
        `args.load = args.save` resumes from it; return once it is durable when `force_sync`."""
        ...

    def update_weights(self, update: WeightUpdate) -> None:
        """Bring the engines to the current weights as `update.version` (see the module docstring): export to
        `update.disk_dir` for transport "disk", else have the rank holding the full weights call
        `slime.weight_sync.send_weights(update, named_tensors)`. Raise on every rank when it failed on any."""
        ...


#: What `RayTrainGroup` calls on every rank: method -> (the call as errors name it, positional args, keywords).
TRAIN_BACKEND_METHODS: dict[str, tuple[str, tuple, dict]] = {
    "init": (
        "init(args, role, with_ref=False, with_opd_teacher=False)",
        (None, "actor"),
        {"with_ref": False, "with_opd_teacher": False},
    ),
    "train": ("train(rollout_id, rollout_data_ref)", (0, []), {}),
    "save_model": ("save_model(rollout_id, force_sync=False)", (0,), {"force_sync": False}),
    "update_weights": (
        "update_weights(update)",
        (WeightUpdate(version=1, transport="disk", disk_dir="weight_v000001"),),
        {},
    ),
}


def _required_methods(args: Any) -> dict[str, tuple[str, tuple, dict]]:
    """`TRAIN_BACKEND_METHODS` as this run calls them: with `--use-critic`, `train` also gets `external_data`
    (the critic's values go to the actor)."""
    methods = dict(TRAIN_BACKEND_METHODS)
    if getattr(args, "use_critic", False):
        methods["train"] = ("train(rollout_id, rollout_data_ref, external_data=...)", (0, []), {"external_data": None})
    return methods


def _where(kind: str, name: str, plugin: str | None) -> str:
    return f"{kind} {name!r} (plugin {plugin!r})" if plugin else f"{kind} {name!r}"


def _accepts(function: Any, args: tuple, kwargs: dict) -> bool:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: cannot tell, assume it does
        return True
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _plain_class(cls: Any) -> Any:
    """The Python class behind a Ray actor class (`ray.remote(C)`), else `cls` itself."""
    metadata = getattr(cls, "__ray_metadata__", None)
    return getattr(metadata, "modified_class", cls)


def check_train_backend(cls: Any, name: str, plugin: str | None = None, args: Any = None) -> None:
    """Raise `PluginContractError` unless `cls` can serve as a rank of train backend `name` for this run.

    Checks that it is a class constructible without arguments and that it has every method of
    `TRAIN_BACKEND_METHODS` accepting the call `RayTrainGroup` makes (with the run's `args`, as this run makes
    it: `--use-critic` adds `external_data` to `train`).
    The message names the backend, the plugin that provides it, the class and the missing method, e.g.
    "train backend 'x' (plugin 'slime_foo'): FooActor lacks train(rollout_id, rollout_data_ref)".
    """
    where = _where("train backend", name, plugin)
    klass = _plain_class(cls)
    if not inspect.isclass(klass):
        raise PluginContractError(
            f"{where}: TrainBackendSpec.target must be the class of one training rank, got {klass!r}"
        )
    label = klass.__name__
    if not _accepts(klass, (), {}):
        raise PluginContractError(
            f"{where}: {label}() must be constructible without arguments (ranks read RANK, WORLD_SIZE, LOCAL_RANK, "
            f"MASTER_ADDR, MASTER_PORT from their environment); its signature is {label}{inspect.signature(klass)}"
        )
    for method, (call, call_args, call_kwargs) in _required_methods(args).items():
        function = getattr(klass, method, None)
        if not callable(function):
            raise PluginContractError(f"{where}: {label} lacks {call}")
        if not _accepts(function, (None, *call_args), call_kwargs):
            raise PluginContractError(
                f"{where}: {label}.{method}{inspect.signature(function)} does not accept the call {call}"
            )


def data_parallel_size(cls: Any, args: Any, world_size: int) -> int:
    """Into how many shards each step's data is split for `world_size` ranks of backend class `cls`.

    The class's static `data_parallel_size(args, world_size)` when it has one, else `world_size`. Its answer is
    a plugin result, checked here: a positive integer that divides `world_size`.
    """
    klass = _plain_class(cls)
    method = getattr(klass, "data_parallel_size", None)
    if method is None:
        return int(world_size)
    size = method(args, int(world_size))
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world_size % size:
        raise PluginContractError(
            f"{klass.__name__}.data_parallel_size(args, {world_size}) returned {size!r}; it must be a positive "
            f"integer that divides the {world_size} training ranks"
        )
    return size


def check_engine_launcher(launcher: Any, name: str, plugin: str | None = None) -> None:
    """Raise `PluginContractError` unless `launcher` is callable as `launcher(args, num_engines)`."""
    where = _where("rollout engine", name, plugin)
    if launcher is None or not callable(launcher):
        raise PluginContractError(
            f"{where}: RolloutEngineSpec.target must be a launcher callable as launcher(args, num_engines), "
            f"got {launcher!r}"
        )
    if not _accepts(launcher, (None, 1), {}):
        raise PluginContractError(
            f"{where}: launcher {getattr(launcher, '__qualname__', launcher)!r}{inspect.signature(launcher)} "
            "does not accept the call launcher(args, num_engines)"
        )


def check_launched_engines(launched: Any, num_engines: int, name: str) -> list[str]:
    """The URLs of what launcher `name` returned for `num_engines` engines; a clear error when it is not that."""
    where = f"rollout engine {name!r}"
    if isinstance(launched, (str, bytes)) or not isinstance(launched, LaunchedEngines):
        raise PluginContractError(f"{where}: its launcher must return the engines' URLs, got {launched!r}")
    urls = list(launched)
    if len(urls) != num_engines or not all(isinstance(url, str) and url.startswith("http") for url in urls):
        raise PluginContractError(
            f"{where}: its launcher was asked for {num_engines} engines and returned {urls!r}; expected "
            f"{num_engines} base URLs like 'http://127.0.0.1:30000'"
        )
    actors = getattr(launched, "actors", None)
    if actors is not None and len(actors) != num_engines:
        raise PluginContractError(f"{where}: {len(actors)} actors for {num_engines} engine URLs")
    return urls


# ------------------------------------------------------------------------------------------ lookup


def resolve_train_backend(args: Any) -> Any:
    """The checked rank class of `--train-backend` (default "torch") from the run's plugins."""
    from slime.plugin_manager import registry_for

    name = getattr(args, "train_backend", None) or "torch"
    registry = registry_for(args)
    spec = registry.get("train_backends", name)
    check_train_backend(spec.target, name, registry.providers.get(("train_backends", name)), args)
    return spec.target


def resolve_engine_launcher(args: Any) -> EngineLauncher:
    """The checked launcher of `--rollout-engine` (default "cpu") from the run's plugins."""
    from slime.plugin_manager import registry_for

    name = getattr(args, "rollout_engine", None) or "cpu"
    registry = registry_for(args)
    spec = registry.get("rollout_engines", name)
    check_engine_launcher(spec.target, name, registry.providers.get(("rollout_engines", name)))
    return spec.target


def check_run_backends(args: Any) -> None:
    """Resolve and check the run's train backend and (unless `--debug-train-only`) engine launcher."""
    resolve_train_backend(args)
    if not getattr(args, "debug_train_only", False):
        resolve_engine_launcher(args)
