"""LoRA adapters in the torch backend (`--lora-rank N`), through `peft`.

With `--lora-rank N > 0` the backend wraps the Hugging Face model with `peft`'s LoRA: every module that
`--lora-target-modules` names (default `all-linear`: every linear layer of the decoder, not the output head) gains
two trainable matrices `A` (N x in) and `B` (out x N) and computes `W x + (alpha / N) * B A x`; the base weights `W`
are frozen. The optimizer holds the adapters only, so its state shrinks with them.

What each durable file holds under LoRA:

- **checkpoints** (`<save>/iter_N/`) hold the adapter in `peft`'s format (`adapter_config.json`,
  `adapter_model.safetensors`: `PeftModel.from_pretrained(base, dir)` loads it), the tokenizer files, and the
  optimizer, scheduler and RNG state of the adapters: a joint commit carries kilobytes to megabytes instead of the
  whole model. The base model is `--hf-checkpoint`, recorded in `adapter_config.json`; a resume must name the same
  one (`check_base`).
- **weight updates to the engines** send merged weights (`merged_state`: `W + (alpha / N) B A` under the base
  model's own parameter names), so engines serve the trained policy without knowing about adapters.
- **`--save-hf DIR`** writes merged weights (a plain Hugging Face model directory) or, with
  `--lora-save-hf adapter`, the adapter; `slime-run export` merges an adapter checkpoint the same way.

Adapters start from `--seed` on every rank (`A` random, `B` zero, so the model starts as the base model), not from
the rank's own seed: data-parallel replicas start equal and a rerun starts from the same adapters.
"""

from __future__ import annotations

import argparse
import json
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from slime.utils.settings import Settings, flag, option

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
#: The peft adapter name this backend trains (one adapter per model).
ADAPTER_NAME = "default"
SAVE_HF_FORMATS = ("merged", "adapter")
#: The adapter settings a checkpoint must share with the run that resumes it.
SHAPE_KEYS = {
    "r": "--lora-rank",
    "lora_alpha": "--lora-alpha",
    "target_modules": "--lora-target-modules",
    "modules_to_save": "--lora-modules-to-save",
}
PEFT_MISSING = "--lora-rank needs the peft package: pip install 'slime-rl[lora]' (or pip install peft)"


@dataclass(frozen=True)
class LoraSettings(Settings):
    """The LoRA flags (`--lora-rank` and the rest): the adapters' shape, and what `--save-hf` writes under LoRA
    (`rank` 0: no LoRA)."""

    rank: int = option("lora_rank", 0, convert=int, minimum=0)
    alpha: float = option("lora_alpha", 16.0, convert=float, above=0.0)
    dropout: float = option("lora_dropout", 0.0, convert=float, minimum=0.0)
    #: `all-linear`, or module names separated by commas (`q_proj,v_proj`).
    target_modules: str = option("lora_target_modules", "all-linear")
    #: Modules trained in full beside the adapters and saved with them (names separated by commas; "": none).
    modules_to_save: str = option("lora_modules_to_save", "")
    save_hf: str = option("lora_save_hf", "merged", choices=SAVE_HF_FORMATS)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dropout >= 1.0:
            raise ValueError(f"--lora-dropout must be < 1, got {self.dropout}")
        if not self.targets:
            raise ValueError("--lora-target-modules names no module; pass all-linear or names like q_proj,v_proj")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def saved_modules(self) -> list[str] | None:
        """What peft's `modules_to_save` takes: the module names, or None."""
        return [name.strip() for name in self.modules_to_save.split(",") if name.strip()] or None

    @property
    def targets(self) -> str | list[str]:
        """What peft's `target_modules` takes: `"all-linear"` or a list of module names."""
        if self.target_modules.strip() == "all-linear":
            return "all-linear"
        return [name.strip() for name in self.target_modules.split(",") if name.strip()]


def require_peft() -> None:
    """ValueError with the install command when peft is not installed (a user's environment to fix)."""
    try:
        import peft  # noqa: F401
    except ImportError as exc:
        raise ValueError(PEFT_MISSING) from exc


def _config(settings: LoraSettings, base: str) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.targets,
        modules_to_save=settings.saved_modules,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )


def add_adapters(model: torch.nn.Module, settings: LoraSettings, *, seed: int, base: str) -> torch.nn.Module:
    """`model` wrapped with fresh LoRA adapters (initialised from `seed` without touching the caller's RNG stream);
    only the adapters require gradients. ValueError naming `--lora-target-modules` when it matches no module."""
    require_peft()
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft asks transformers whether gradient checkpointing is on through a name transformers 5 deprecates.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, _config(settings, base))
        except ValueError as exc:
            raise ValueError(
                f"--lora-target-modules {settings.target_modules}: {exc}; name the model's linear modules "
                "(for example q_proj,v_proj) or pass all-linear"
            ) from exc


def is_adapter_checkpoint(directory: Path) -> bool:
    return (directory / ADAPTER_CONFIG_FILE).is_file()


def read_adapter_config(directory: Path) -> dict[str, Any]:
    """`adapter_config.json` of `directory`; ValueError naming the file when it is not a JSON object."""
    path = directory / ADAPTER_CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} cannot be read as JSON ({exc}); the checkpoint is corrupt or not ours") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object; the checkpoint is not ours")
    return config


def check_shape(directory: Path, model: torch.nn.Module) -> None:
    """ValueError naming the flag when the adapter saved in `directory` has another rank, alpha or target modules
    than `model`'s (a peft model built from this run's flags; peft records `all-linear` as the modules it found)."""
    saved = read_adapter_config(directory)
    built = model.peft_config[ADAPTER_NAME].to_dict()
    for key, flag_name in SHAPE_KEYS.items():
        have, want = saved.get(key), built.get(key)
        if isinstance(have, list | set | tuple) and isinstance(want, list | set | tuple):
            have, want = sorted(have), sorted(want)
        if have != want:
            raise ValueError(
                f"{directory / ADAPTER_CONFIG_FILE} was trained with {key}={have!r}, but this run's {flag_name} gives "
                f"{want!r}; resume with the checkpoint's LoRA flags, or start a new --save directory"
            )


def check_base(directory: Path, base: str) -> None:
    """ValueError when the adapter in `directory` was trained on another base model than `base`."""
    recorded = read_adapter_config(directory).get("base_model_name_or_path")
    if recorded and str(recorded) != str(base):
        raise ValueError(
            f"{directory} holds LoRA adapters trained on the base model {recorded}, but this run's base is {base}; "
            f"pass --hf-checkpoint {recorded}"
        )


def load_adapter_weights(model: torch.nn.Module, directory: Path) -> None:
    """Load the adapter weights saved in `directory` into `model` (a peft model of the same shape); ValueError
    naming the file when a tensor is missing or foreign."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    path = directory / ADAPTER_WEIGHTS_FILE
    try:
        saved = load_file(path)
    except Exception as exc:
        raise ValueError(f"{path} cannot be read ({exc}); the checkpoint is missing, corrupt or not ours") from exc
    expected = set(get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME))
    missing, foreign = sorted(expected - set(saved)), sorted(set(saved) - expected)
    if missing or foreign:
        raise ValueError(
            f"{path} does not match this run's adapters (missing {missing[:3]}, unexpected {foreign[:3]}); resume "
            "with the LoRA flags and --hf-checkpoint the checkpoint was trained with"
        )
    set_peft_model_state_dict(model, saved, adapter_name=ADAPTER_NAME)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors under peft's saved names (what `adapter_model.safetensors` holds)."""
    from peft import get_peft_model_state_dict

    return {
        name: tensor.detach().cpu().contiguous()
        for name, tensor in get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME).items()
    }


def write_adapter(model: torch.nn.Module, directory: Path) -> None:
    """Write `adapter_config.json` and `adapter_model.safetensors` into `directory` (a staging directory the caller
    makes durable before publishing it)."""
    from safetensors.torch import save_file

    model.peft_config[ADAPTER_NAME].save_pretrained(str(directory))
    save_file(adapter_state(model), str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a peft model (whose `save_pretrained` writes config and weights); `model`
    itself when it has no adapters."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if get_base is not None else model


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights with the adapters merged in (`W + scaling * B A`) and the trained copies of
    `--lora-modules-to-save` in place of the originals, under the base model's own parameter names, computed
    without modifying `model`; tied weights stay one tensor."""
    from peft.tuners.lora import LoraLayer

    base = hf_model(model)
    with torch.no_grad():
        deltas = {
            f"{name}.base_layer.weight": module.get_delta_weight(ADAPTER_NAME)
            for name, module in base.named_modules()
            if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A
        }
        state = {}
        for name, tensor in base.state_dict().items():
            parts = name.split(".")
            if "original_module" in parts or any(part.startswith("lora_") for part in parts):
                continue  # the adapters themselves, and the frozen originals of the modules trained in full
            if name in deltas:
                tensor = tensor + deltas[name].to(tensor.dtype)
            plain = name.replace(".base_layer.", ".").replace(f".modules_to_save.{ADAPTER_NAME}.", ".")
            state[plain] = tensor
    return state


def settings_of(directory: Path) -> LoraSettings:
    """The `LoraSettings` an adapter checkpoint was trained with (rank, alpha, dropout and its target modules)."""
    saved = read_adapter_config(directory)
    targets = saved.get("target_modules")
    try:
        names = targets if isinstance(targets, str) else ",".join(sorted(targets))
        return LoraSettings(
            rank=int(saved["r"]),
            alpha=float(saved["lora_alpha"]),
            dropout=float(saved.get("lora_dropout") or 0.0),
            target_modules=names,
            modules_to_save=",".join(saved.get("modules_to_save") or ()),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{directory / ADAPTER_CONFIG_FILE} is not a LoRA adapter config this backend wrote ({exc})"
        ) from exc


def write_merged(checkpoint: Path, base: str, target: Path) -> list[Path]:
    """Merge the adapter of `checkpoint` into the base model `base` and write a Hugging Face model directory to
    `target` (new or empty; it appears complete or not at all), with the checkpoint's tokenizer files. Returns the
    files written."""
    from transformers import AutoModelForCausalLM

    from slime.plugins import torch_checkpoint as ckpt

    require_peft()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    wrapped = add_adapters(model, settings_of(checkpoint), seed=0, base=base)
    check_shape(checkpoint, wrapped)
    load_adapter_weights(wrapped, checkpoint)
    ckpt.write_hf_model(hf_model(wrapped), merged_state(wrapped), target, [checkpoint, base], replace=False)
    return sorted(target.iterdir())


def check_args(args: argparse.Namespace) -> None:
    """Parse time: the LoRA flags are valid, peft is installed, and the run can train adapters."""
    settings = LoraSettings.from_args(args)
    if not settings.enabled:
        given = [
            flag(item.metadata["dest"])
            for item in fields(settings)
            if item.name != "rank" and getattr(settings, item.name) != item.default
        ]
        if given:
            raise ValueError(f"{', '.join(given)} shape LoRA adapters; add --lora-rank N (for example 8) to train them")
        return
    backend = getattr(args, "train_backend", "torch")
    if backend != "torch":
        raise ValueError(
            f"--lora-rank: LoRA adapters are trained by the torch backend; --train-backend {backend} trains the full "
            "weights. Drop --lora-rank or use --train-backend torch"
        )
    if getattr(args, "fsdp", False):
        raise ValueError(
            "--lora-rank with --fsdp is not supported (adapters are small: DDP replicates them); drop --fsdp"
        )
    require_peft()


def add_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "LoRA (torch backend)",
        "Train low-rank adapters instead of the full weights: checkpoints hold the adapters, engines get merged "
        "weights (docs/lora.md).",
    )
    group.add_argument(
        "--lora-rank",
        type=int,
        default=LoraSettings.rank,
        metavar="N",
        help="rank of the LoRA adapters (0, the default: train the full weights); needs peft (slime-rl[lora])",
    )
    group.add_argument(
        "--lora-alpha",
        type=float,
        default=LoraSettings.alpha,
        metavar="A",
        help="scaling of the adapters: their product B A is multiplied by A / --lora-rank",
    )
    group.add_argument(
        "--lora-dropout",
        type=float,
        default=LoraSettings.dropout,
        metavar="P",
        help="dropout on the adapters' input while training",
    )
    group.add_argument(
        "--lora-target-modules",
        default=LoraSettings.target_modules,
        metavar="NAMES",
        help="modules that get adapters: all-linear (every linear layer but the output head) or names separated by "
        "commas (q_proj,k_proj,v_proj,o_proj)",
    )
    group.add_argument(
        "--lora-modules-to-save",
        default=LoraSettings.modules_to_save,
        metavar="NAMES",
        help="modules trained in full beside the adapters and saved with them, names separated by commas (a name "
        "matches every module whose name ends with it: norm trains every RMSNorm; model.norm the final one)",
    )
    group.add_argument(
        "--lora-save-hf",
        choices=SAVE_HF_FORMATS,
        default=LoraSettings.save_hf,
        help="what --save-hf writes under LoRA: merged weights (a plain Hugging Face model) or the adapter (peft's "
        "adapter_config.json and adapter_model.safetensors)",
    )
