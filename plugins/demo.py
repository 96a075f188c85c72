"""The embedded demo: `slime-run --plugin straw` with no model and no prompts runs a complete RL job on CPU.

When the run names neither `--hf-checkpoint` nor `--prompt-data`, `slime_configure` fills in everything
the job needs: the tiny model built once under `<save>/model`, the copy task's prompts written once to
`<save>/prompts.jsonl`, the copy reward, two CPU engines, the torch backend, disk weight updates under
`<save>/weights` and a checkpoint every few steps. Because the model and prompts live under `--save`,
rerunning the same command finds them again and resumes from the last joint commit.

Only options the user did not give on the command line (`args.explicit_options`) are changed, and each
one that is set is logged. A run that names a model or prompts is left untouched. The model and the
prompts are built in `slime_run_start`, so parsing arguments alone never writes files.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from slime import hookimpl
from slime.plugins.demo_task import DEMO_TARGET_LENGTH

logger = logging.getLogger(__name__)

DEFAULT_SAVE_DIR = "./slime-run-output"
DEMO_PROMPT_COUNT = 256
DEMO_PROMPT_SEED = 0
DEMO_GLOBAL_BATCH_SIZE = 16
#: The demo's optimizer beyond `--lr` (torch backend options; benchmarks/demo_floor.py uses them too).
DEMO_OPTIMIZER = {"adam_beta2": 0.98, "lr_decay_style": "constant", "min_lr": 0.0}


def is_demo_run(args: Any) -> bool:
    """True when the run names neither a model (`--hf-checkpoint`) nor prompts (`--prompt-data`)."""
    return getattr(args, "hf_checkpoint", None) is None and getattr(args, "prompt_data", None) is None


def demo_settings(save_dir: Path) -> dict[str, Any]:
    """The option values of the demo run saved under `save_dir` (before checking what the user gave);
    `--global-batch-size` (DEMO_GLOBAL_BATCH_SIZE, at most one rollout's samples) follows from the batch
    shape the run ends up with."""
    return {
        "hf_checkpoint": str(save_dir / "model"),
        "prompt_data": str(save_dir / "prompts.jsonl"),
        "input_key": "input",
        "label_key": "label",
        "rm_type": "copy",
        # Reward reaches about 1 by step 60-80 (one run stalled near 0.8 for 30 steps first); 150 leaves margin.
        "num_rollout": 150,
        # 16 prompts x 8 samples, trained in optimizer steps of DEMO_GLOBAL_BATCH_SIZE samples: measured with
        # benchmarks/demo_floor.py, smaller groups or one step per rollout stall around reward 0.4-0.7.
        "rollout_batch_size": 16,
        "n_samples_per_prompt": 8,
        "save_interval": 10,
        "rollout_engine": "cpu",
        "rollout_num_engines": 2,
        "train_backend": "torch",
        "update_weight_transport": "disk",
        "update_weight_disk_dir": str(save_dir / "weights"),
        # Targets have DEMO_TARGET_LENGTH characters: the response budget is exactly that.
        "rollout_max_response_len": DEMO_TARGET_LENGTH,
        # At 1e-2 the policy collapses to deterministic outputs (zero-variance groups, no gradient) near
        # reward 0.4; 2e-3 reached 0.9 within 60 steps on every seed tried in benchmarks/demo_floor.py.
        "lr": 2e-3,
        # Without an entropy bonus the policy often stops sampling one letter of the alphabet early on (its
        # groups then all score alike and teach nothing) and stalls near reward 0.75; 0.05 avoided it on every
        # seed tried with benchmarks/demo_floor.py (see that module).
        "entropy_coef": 0.05,
        **DEMO_OPTIMIZER,
    }


def _set_default(args: Any, dest: str, value: Any) -> None:
    """Set `args.<dest>` to `value` unless the user gave the option on the command line."""
    if dest in getattr(args, "explicit_options", ()):
        return
    setattr(args, dest, value)
    logger.info("demo sets --%s=%s", dest.replace("_", "-"), value)


def configure_demo(args: Any) -> None:
    """Turn a run without model and prompts into the demo (see the module docstring)."""
    _set_default(args, "save", str(Path(DEFAULT_SAVE_DIR).resolve()))
    args.save = str(Path(args.save).expanduser().resolve())
    save_dir = Path(args.save)
    for dest, value in demo_settings(save_dir).items():
        _set_default(args, dest, value)
    samples_per_rollout = args.rollout_batch_size * args.n_samples_per_prompt
    _set_default(args, "global_batch_size", min(DEMO_GLOBAL_BATCH_SIZE, samples_per_rollout))
    args.demo_run = True


def prepare_demo_files(args: Any) -> None:
    """Build the tiny model and write the prompts once (reruns find them under `--save`)."""
    from slime.plugins.demo_task import DEMO_ROW_OPTIONS, write_demo_prompts
    from slime.plugins.tiny_model import ensure_tiny_model

    model_dir = ensure_tiny_model(Path(args.hf_checkpoint))
    logger.info("demo model: %s", model_dir)
    prompts = Path(args.prompt_data)
    if not prompts.exists():
        write_demo_prompts(prompts, DEMO_PROMPT_COUNT, seed=DEMO_PROMPT_SEED, **DEMO_ROW_OPTIONS)
        logger.info("demo prompts written to %s", prompts)


@hookimpl
def slime_configure(args: Any) -> None:
    if is_demo_run(args):
        configure_demo(args)


@hookimpl
def slime_run_start(args: Any) -> None:
    if getattr(args, "demo_run", False):
        prepare_demo_files(args)
