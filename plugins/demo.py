"""The embedded demo: `slime-run --plugin straw` with no model and no prompts runs a complete RL job on CPU.

When the run names neither `--hf-checkpoint` nor `--prompt-data`, `slime_configure` fills in everything
the job needs: the tiny model built once under `<save>/model`, the copy task's prompts written once to
`<save>/prompts.jsonl` (and its eval splits to `<save>/eval_*.jsonl`, evaluated every 20 steps), the copy
reward, two CPU engines, the torch backend, disk weight updates under
`<save>/weights` and a checkpoint every few steps. Because the model and prompts live under `--save`,
rerunning the same command finds them again and resumes from the last joint commit.

Only options the user did not give on the command line (`args.explicit_options`) are changed, and each
one that is set is logged. A run that names a model or prompts is left untouched. The model and the
prompts are built in `slime_run_start`, so parsing arguments alone never writes files. What the demo reads
from the run's arguments it reads through `DemoRunSettings` (and the batch shape through `RolloutSettings`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime import hookimpl
from slime.plugins.demo_task import DEMO_TARGET_LENGTH
from slime.rollout.settings import RolloutSettings
from slime.utils.settings import Settings, option

logger = logging.getLogger(__name__)

DEFAULT_SAVE_DIR = "./slime-run-output"
DEMO_PROMPT_COUNT = 256
DEMO_PROMPT_SEED = 0
DEMO_GLOBAL_BATCH_SIZE = 16
#: The demo's optimizer beyond `--lr` (shared train-backend options; benchmarks/demo_floor.py uses them too).
DEMO_OPTIMIZER = {"adam_beta2": 0.98, "lr_decay_style": "constant", "min_lr": 0.0}


@dataclass(frozen=True)
class DemoRunSettings(Settings):
    """What the demo reads from a run's arguments (see the flags of the same names in `slime-run --help`)."""

    hf_checkpoint: str | None = option("hf_checkpoint")
    prompt_data: str | None = option("prompt_data")
    save: str | None = option("save")
    eval_prompt_data: tuple[str, ...] = option("eval_prompt_data", (), convert=tuple)
    #: Set by the framework: the destinations the user gave on the command line (the demo changes only the others).
    explicit_options: frozenset[str] = option("explicit_options", frozenset(), convert=frozenset)
    #: Set by this plugin's `slime_configure`: the run is the demo.
    demo_run: bool = option("demo_run", False)

    @property
    def is_demo(self) -> bool:
        """True when the run names neither a model (`--hf-checkpoint`) nor prompts (`--prompt-data`)."""
        return self.hf_checkpoint is None and self.prompt_data is None


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
        # The eval splits of `demo_eval_files`, evaluated before the first step and every 20 steps with the
        # built-in eval rollout (whatever rollout function trains); 4 samples per prompt give pass@1, 2 and 4.
        "eval_prompt_data": [str(part) for split in demo_eval_files(save_dir).items() for part in split],
        "n_samples_per_eval_prompt": 4,
        "eval_interval": 20,
        "eval_function_path": "sglang",
        "rollout_engine": "cpu",
        "rollout_num_engines": 2,
        "train_backend": "torch",
        "update_weight_transport": "disk",
        "update_weight_disk_dir": str(save_dir / "weights"),
        # Targets have DEMO_TARGET_LENGTH characters: the response budget is exactly that.
        "rollout_max_response_len": DEMO_TARGET_LENGTH,
        # At 1e-2 the policy collapses to deterministic outputs (zero-variance groups, no gradient) near
        # reward 0.4; 2e-3 reached 0.9 within 60 steps on seven of seeds 0-7 of benchmarks/demo_floor.py (below).
        "lr": 2e-3,
        # Without an entropy bonus the policy often stops sampling one letter of the alphabet early on (its
        # groups then all score alike and teach nothing) and stalls near reward 0.75; 0.05 makes that rare but not
        # impossible: over seeds 0-7 of benchmarks/demo_floor.py --steps 100, seven reached a 10-step mean of 0.9
        # (within 27-54 steps) and seed 3 collapsed to 0.03 at step 30 and was at 0.6 at step 100. The demo's
        # deterministic default makes its own run reproducible; runs that cannot be (tests of the Megatron
        # backend) use the clip-higher range --eps-clip-high 0.28 and a lower bar (see their module).
        "entropy_coef": 0.05,
        # Reproducible: killed and rerun, the demo ends with bitwise the weights of an uninterrupted run.
        "deterministic": True,
        **DEMO_OPTIMIZER,
    }


def _training_rows() -> list[dict[str, str]]:
    from slime.plugins.demo_task import DEMO_ROW_OPTIONS, demo_prompt_rows

    return demo_prompt_rows(DEMO_PROMPT_COUNT, seed=DEMO_PROMPT_SEED, **DEMO_ROW_OPTIONS)


def demo_eval_files(save_dir: Path) -> dict[str, Path]:
    """`{split name: file}` of the demo's eval splits (`demo_task.demo_eval_rows`), under `save_dir`."""
    from slime.plugins.demo_task import demo_eval_rows

    return {name: save_dir / f"eval_{name}.jsonl" for name in demo_eval_rows(_training_rows())}


def _set_default(args: Any, explicit: frozenset[str], dest: str, value: Any) -> bool:
    """Set `args.<dest>` to `value` unless the user gave the option on the command line (`explicit`); True when
    set (logged at DEBUG: `--verbose` lists every option the demo sets)."""
    if dest in explicit:
        return False
    setattr(args, dest, value)
    logger.debug("demo sets --%s=%s", dest.replace("_", "-"), value)
    return True


def configure_demo(args: Any) -> None:
    """Turn a run without model and prompts into the demo (see the module docstring)."""
    settings = DemoRunSettings.from_args(args)
    explicit = settings.explicit_options
    save = settings.save if "save" in explicit else DEFAULT_SAVE_DIR
    save_dir = Path(save).expanduser().resolve()
    count = int(_set_default(args, explicit, "save", str(save_dir)))
    args.save = str(save_dir)  # A --save the user gave, made absolute.
    for dest, value in demo_settings(save_dir).items():
        count += _set_default(args, explicit, dest, value)
    rollout = RolloutSettings.from_args(args)
    samples_per_rollout = rollout.batch_size * rollout.n_samples_per_prompt
    count += _set_default(args, explicit, "global_batch_size", min(DEMO_GLOBAL_BATCH_SIZE, samples_per_rollout))
    logger.info("demo: set %d options (model, prompts, engines, lr, ...); --verbose lists them", count)
    args.demo_run = True


def prepare_demo_files(args: Any) -> None:
    """Build the tiny model and write the prompts once (reruns find them under `--save`)."""
    from slime.plugins.demo_task import demo_eval_rows, write_prompt_rows
    from slime.plugins.tiny_model import ensure_tiny_model

    settings = DemoRunSettings.from_args(args)
    model_dir = ensure_tiny_model(Path(settings.hf_checkpoint))
    logger.info("demo model: %s", model_dir)
    prompts = Path(settings.prompt_data)
    rows = _training_rows()
    files = {prompts: rows}
    eval_files = demo_eval_files(Path(settings.save))
    for name, split in demo_eval_rows(rows).items():
        if str(eval_files[name]) in settings.eval_prompt_data:  # not when the user gave other eval data
            files[eval_files[name]] = split
    written = [write_prompt_rows(path, content).name for path, content in files.items() if not path.exists()]
    if written:
        logger.info("demo prompts written to %s: %s", settings.save, ", ".join(written))


@hookimpl
def slime_configure(args: Any) -> None:
    if DemoRunSettings.from_args(args).is_demo:
        configure_demo(args)


@hookimpl
def slime_run_start(args: Any) -> None:
    if DemoRunSettings.from_args(args).demo_run:
        prepare_demo_files(args)
