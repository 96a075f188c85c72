"""Running megatron-core 0.16.1 on a machine without CUDA (gloo, CPU tensors).

Megatron-core assumes CUDA in a handful of places on the path this backend uses (build a GPTModel, wrap it in
Float16Module and DistributedDataParallel, run a forward/backward schedule, step a Megatron optimizer, recompute
activations). Without help every one of them fails with `AssertionError: Torch not compiled with CUDA enabled`.
`apply_cpu_compat()` installs one small fix per touch point, each in its own function below with a comment
naming the Megatron call it replaces, so that callers use Megatron exactly as on a GPU and need nothing else.

The fixes reach into Megatron's private internals, so they are tied to one version: `check_megatron_core()`
refuses any other (and `apply_cpu_compat()` calls it). On a machine with CUDA nothing is patched.

`rng_state()` / `set_rng_state()` capture and restore the generators a training checkpoint needs (the CPU
generator, the CUDA generator where there is one, and Megatron's tracked model-parallel states), on CPU and GPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

MEGATRON_CORE_VERSION = "0.16.1"
INSTALL_HINT = "pip install 'slime-rl[megatron]' (megatron-core==0.16.1)"

_APPLIED = False


def _installed_megatron_core_version() -> str | None:
    """The installed megatron-core distribution's version, or None when it is not installed."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_megatron_core() -> None:
    """Raise RuntimeError unless exactly megatron-core `MEGATRON_CORE_VERSION` is installed.

    The CPU fixes and the weight converter depend on Megatron internals (module layout, parameter names, private
    helpers) that change between releases, so a different version is refused rather than half-working.
    """
    found = _installed_megatron_core_version()
    if found != MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"the Megatron backend needs megatron-core=={MEGATRON_CORE_VERSION}, "
            f"found {found if found is not None else 'not installed'}; fix: {INSTALL_HINT}"
        )
    # Looked up, not imported: importing megatron.core takes seconds, and the driver only checks the install.
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise RuntimeError(f"megatron-core {found} is installed but megatron.core cannot be found; fix: {INSTALL_HINT}")


#: Notices megatron-core prints when it imports without TransformerEngine or Apex (always, on a CPU machine): each
#: rank would print them on every start. The fallbacks they announce are the ones this backend is tested with.
_FALLBACK_NOTICES = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
)


def silence_fallback_notices() -> None:
    """Hide megatron-core's import-time notices about missing TransformerEngine/Apex (idempotent); call it before
    importing megatron.core. Megatron's INFO log lines go too (its warnings and errors stay)."""
    import logging
    import warnings

    for notice in _FALLBACK_NOTICES:
        warnings.filterwarnings("ignore", message=notice, category=UserWarning)
    logging.getLogger("megatron.core").setLevel(logging.WARNING)


def cpu_mode() -> bool:
    """True when torch has no usable CUDA device, i.e. Megatron must run on CPU over gloo."""
    return not torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------------------------
# The device-mapping torch function mode used by the fixes that wrap a Megatron call.


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a CUDA ordinal


class _CudaAsCpuMode(TorchFunctionMode):
    """Runs torch calls that name a CUDA device on the CPU instead.

    `device="cuda"` (or a CUDA ordinal) becomes `device="cpu"`, `pin_memory=True` is dropped, `Tensor.cuda()`
    returns the tensor itself and `Tensor.to("cuda")` stays on the CPU. With `type_strings`, `Tensor.type()` of a
    CPU tensor answers the CUDA name (`torch.cuda.FloatTensor`) so that Megatron's checks of parameter and
    gradient types accept CPU tensors.
    """

    def __init__(self, type_strings: bool = False) -> None:
        super().__init__()
        self.type_strings = type_strings

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if self.type_strings and args[0].device.type == "cpu":
                return name.replace("torch.", "torch.cuda.", 1)
            return name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _on_cpu(fn: Callable, *, type_strings: bool = False) -> Callable:
    """`fn` run under `_CudaAsCpuMode` (wrapping is idempotent)."""
    if getattr(fn, "__slime_cpu_compat__", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _CudaAsCpuMode(type_strings=type_strings):
            return fn(*args, **kwargs)

    wrapper.__slime_cpu_compat__ = True
    return wrapper


def _replace_everywhere(original: Callable, replacement: Callable) -> None:
    """Rebind `original` to `replacement` in every loaded megatron.core module that imported it by name."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("megatron.core"):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)


@contextlib.contextmanager
def cpu_device_scope() -> Iterator[None]:
    """Run Megatron calls that `apply_cpu_compat()` does not cover and that build tensors on "cuda".

    On CPU, torch calls inside the block that name a CUDA device run on the CPU, `Tensor.cuda()` is the identity
    and `Tensor.type()` answers CUDA type names for CPU tensors; on a GPU it does nothing. Callers need it for
    nothing this backend's path uses: building the model, the forward/backward schedules, building the optimizer
    and `optimizer.step()` (gradient clipping and zero counting included), the tied-embedding sync, and
    `dist_checkpointing.save/load` with the default strategies (checked: model, Adam and the distributed optimizer
    with `distrib_optim_sharding_type="dp_reshardable"`) are covered or CUDA-free. Wrap in it the Megatron entry
    points known to allocate on "cuda" that are off that path: the fully-parallel dist_checkpointing strategy
    wrappers (`exchange_utils`), `DistributedOptimizer.get_parameter_state_dp_zero()` (the legacy optimizer state
    format), `MegatronOptimizer.restore_from_cpu()`. Nesting it around covered calls is harmless.
    """
    if not cpu_mode():
        yield
        return
    with _CudaAsCpuMode(type_strings=True):
        yield


# ---------------------------------------------------------------------------------------------------------------
# One fix per CUDA touch point.


def _fix_current_device() -> None:
    # Replaces `torch.cuda.current_device()`, which Megatron passes as `device=` when it creates parameters
    # (besides use_cpu_initialization), RoPE's `inv_freq.to(current_device())`, the global memory buffer of the
    # local attention (`GlobalMemoryBuffer.get_tensor`), DDP's parameter/gradient buffers, the pipeline's p2p
    # receive buffers and `ChainedOptimizer.get_loss_scale`: on a machine without CUDA it answers "cpu".
    if not getattr(torch.cuda.current_device, "__slime_cpu_compat__", False):

        def current_device() -> str:
            return "cpu"

        current_device.__slime_cpu_compat__ = True
        torch.cuda.current_device = current_device


def _fix_synchronize() -> None:
    # Replaces `torch.cuda.synchronize()` (pipeline p2p's batch_isend_irecv guard, parallel_state timeouts):
    # CPU collectives complete before `wait()` returns, so there is nothing to synchronize.
    if not getattr(torch.cuda.synchronize, "__slime_cpu_compat__", False):

        def synchronize(device: Any = None) -> None:
            return None

        synchronize.__slime_cpu_compat__ = True
        torch.cuda.synchronize = synchronize


def _make_cpu_rng_tracker_class(base: type, default_name: str) -> type:
    class CpuRNGStatesTracker(base):
        """Megatron's RNG tracker kept on the CPU generator (the one CPU dropout draws from).

        `add` seeds a fresh state without touching the current one; `fork` swaps the named state into the CPU
        generator for the block and swaps it back out afterwards, as the CUDA tracker does with the CUDA one.
        """

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"cpu rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = default_name):
            if name not in self.states_:
                raise Exception(f"cpu rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def _fix_rng_tracker() -> None:
    # Replaces the CUDA RNG tracker (`CudaRNGStatesTracker.add` seeds with `torch.cuda.manual_seed` and
    # `fork` swaps CUDA generator states) that `model_parallel_cuda_manual_seed` fills and attention's
    # `get_cuda_rng_tracker().fork()` uses: `initialize_rng_tracker` now builds a tracker on the CPU generator.
    from megatron.core.tensor_parallel import random as mpu_random

    if getattr(mpu_random.CudaRNGStatesTracker, "__slime_cpu_compat__", False):
        return
    tracker_class = _make_cpu_rng_tracker_class(
        mpu_random.CudaRNGStatesTracker, mpu_random._MODEL_PARALLEL_RNG_TRACKER_NAME
    )
    tracker_class.__slime_cpu_compat__ = True
    mpu_random.CudaRNGStatesTracker = tracker_class
    mpu_random.initialize_rng_tracker(force_reset=True)


def _fix_recompute_rng_state() -> None:
    # Replaces `tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state`, which activation recompute
    # (`CheckpointFunction`, `CheckpointWithoutOutput`) uses to replay the forward's random stream: the CPU
    # generator stands in for the CUDA one.
    from megatron.core.tensor_parallel import random as mpu_random

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    for name, replacement in (("_get_cuda_rng_state", get_state), ("_set_cuda_rng_state", set_state)):
        original = getattr(mpu_random, name)
        if not getattr(original, "__slime_cpu_compat__", False):
            replacement.__slime_cpu_compat__ = True
            _replace_everywhere(original, replacement)


def _fix_default_causal_mask() -> None:
    # Replaces `transformer.utils.get_default_causal_mask` / `get_sliding_window_causal_mask` (used by
    # `FusedScaleMaskSoftmax` when no attention mask is passed), which build the mask with `device="cuda"`.
    from megatron.core.transformer import utils as transformer_utils

    for name in ("get_default_causal_mask", "get_sliding_window_causal_mask"):
        original = getattr(transformer_utils, name)
        if not getattr(original, "__slime_cpu_compat__", False):
            _replace_everywhere(original, _on_cpu(original))


def _fix_optimizer_construction() -> None:
    # Replaces the constructors of `MixedPrecisionOptimizer` and `FP32Optimizer` (`torch.tensor(...,
    # device="cuda")` for found_inf / the unit loss scale) and the parameter sorting of
    # `Float16OptimizerWithFloat16Params` and `DistributedOptimizer` (`param.type() == "torch.cuda.FloatTensor"`).
    from megatron.core.optimizer import distrib_optimizer, optimizer

    for cls in (
        optimizer.MixedPrecisionOptimizer,
        optimizer.FP32Optimizer,
        optimizer.Float16OptimizerWithFloat16Params,
        distrib_optimizer.DistributedOptimizer,
    ):
        cls.__init__ = _on_cpu(cls.__init__, type_strings=True)


def _fix_grad_clipping() -> None:
    # Replaces `clip_grads.get_grad_norm_fp32` (its norm buffers and the local multi-tensor l2 norm use
    # `device="cuda"`), `clip_grad_by_total_norm_fp32` (asserts grads are `torch.cuda.FloatTensor`) and
    # `count_zeros_fp32` (`device="cuda"` accumulator), wherever `optimizer.step()` reaches them.
    from megatron.core.optimizer import clip_grads

    for name in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32"):
        original = getattr(clip_grads, name)
        if not getattr(original, "__slime_cpu_compat__", False):
            _replace_everywhere(original, _on_cpu(original, type_strings=True))


def _fix_schedule_token_counter() -> None:
    # Replaces the forward/backward schedules (`forward_backward_no_pipelining`,
    # `forward_backward_pipelining_without_interleaving`, `..._with_interleaving`), which start with
    # `total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")`.
    from megatron.core.pipeline_parallel import schedules

    for name in (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ):
        original = getattr(schedules, name)
        if not getattr(original, "__slime_cpu_compat__", False):
            _replace_everywhere(original, _on_cpu(original))


def _fix_tied_embedding_sync() -> None:
    # Replaces `LanguageModule.setup_embeddings_and_output_layer`, which moves the shared embedding/output weight
    # with `weight.data.cuda()` before all-reducing it across the first and last pipeline stages.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _on_cpu(LanguageModule.setup_embeddings_and_output_layer)


def apply_cpu_compat() -> None:
    """Install the CPU fixes (idempotent). Does nothing when CUDA is available.

    Raises RuntimeError (from `check_megatron_core`) when the installed megatron-core is not the pinned version.
    """
    global _APPLIED
    if _APPLIED or not cpu_mode():
        return
    check_megatron_core()
    _fix_current_device()
    _fix_synchronize()
    _fix_rng_tracker()
    _fix_recompute_rng_state()
    _fix_default_causal_mask()
    _fix_optimizer_construction()
    _fix_grad_clipping()
    _fix_schedule_token_counter()
    _fix_tied_embedding_sync()
    _APPLIED = True


# ---------------------------------------------------------------------------------------------------------------
# RNG state for checkpoints.


def rng_state() -> dict[str, Any]:
    """The generator states a training checkpoint restores: `cpu` (torch's CPU generator), `cuda` (the current
    CUDA generator, None on CPU) and `tracker` (Megatron's tracked model-parallel states by name; on CPU these are
    CPU generator states, see `_fix_rng_tracker`). Every value is a uint8 tensor (or None): `torch.save`-able and
    loadable with `weights_only=True`."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker().get_states()
    return {
        "cpu": torch.get_rng_state(),
        "cuda": None if cpu_mode() else torch.cuda.get_rng_state(),
        "tracker": {name: state.clone() for name, state in tracker.items()},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state()` returned (raises ValueError naming the missing keys)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    missing = sorted({"cpu", "cuda", "tracker"} - set(state))
    if missing:
        raise ValueError(f"RNG state lacks {missing}; expected the dict rng_state() returns")
    torch.set_rng_state(state["cpu"])
    if not cpu_mode() and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states({name: tensor.clone() for name, tensor in state["tracker"].items()})
