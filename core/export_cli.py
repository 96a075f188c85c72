"""`slime-run export SAVE_DIR [--step N] OUT`: a checkpoint of a run as a Hugging Face model directory.

Copies the Hugging Face part of a torch-backend checkpoint (`slime.plugins.torch_checkpoint.hf_files`: config,
weights, tokenizer and generation files; not the optimizer, RNG or scheduler state) to `OUT`, which appears
complete or not at all. The checkpoint of a step is looked up along the run's lineage, as `slime-run runs compare`
finds a run's checkpoints (`slime.data.run_comparison.checkpoints`): a save directory with branches from resumed
runs holds the step in the branch that trained it. Reads `SAVE_DIR` only; starts no Ray.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from slime.errors import UsageError
from slime.utils.hf_checkpoint import TOKENIZER_FILES

DESCRIPTION = """\
Copy a checkpoint of a run (the --save directory of slime-run) to OUT as a Hugging Face model directory that
transformers' AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load: config.json, the
weights as saved (model.safetensors), the tokenizer, chat template and generation files; not the optimizer, RNG or
scheduler state. The step defaults to the latest checkpoint, the one a rerun of the run's command would resume
from; a save directory with branches from resumed runs is searched along its lineage. OUT must not exist or be an
empty directory; it appears complete or not at all (written in a hidden sibling, fsynced, then renamed).

A checkpoint of a LoRA run (--lora-rank) holds adapters: export merges them into the base model it was trained on
(recorded in the checkpoint; --base names another path to it) and writes plain merged weights, or with --adapter
copies the adapter itself (adapter_config.json, adapter_model.safetensors, the tokenizer files), which
peft.PeftModel.from_pretrained loads on top of the base model.

Torch-backend checkpoints only: Megatron checkpoints hold distributed shards; train with --save-hf DIR to get
Hugging Face directories from them.
"""


def build_export_parser() -> argparse.ArgumentParser:
    """The parser of `slime-run export` (also read by the test that checks every flag the docs name exists)."""
    parser = argparse.ArgumentParser(
        prog="slime-run export",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("save", metavar="SAVE_DIR", help="the --save directory of a run")
    parser.add_argument("out", metavar="OUT", help="the directory to write (new, or an empty directory)")
    parser.add_argument(
        "--step", type=int, default=None, metavar="N", help="the step to export (default: the latest checkpoint)"
    )
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="LoRA checkpoints: copy the adapter instead of merging it into the base model",
    )
    parser.add_argument(
        "--base",
        metavar="DIR",
        default=None,
        help="LoRA checkpoints: the base model to merge into (default: the --hf-checkpoint the run recorded)",
    )
    return parser


def _steps(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps))


def find_checkpoint(save: Path, step: int | None) -> tuple[int, Path]:
    """`(step, iter directory)` of the checkpoint of `step` (None: the latest) in `save`'s lineage; UsageError
    naming the directory and the fix when there is none."""
    from slime.data.run_comparison import checkpoints

    if not save.is_dir():
        raise UsageError(f"{save}: no such directory; pass the --save directory of a slime-run run")
    notes: list[str] = []
    found = {number: path for number, path in checkpoints(save, notes, str(save)).items() if path.is_dir()}
    if not found:
        why = f" ({'; '.join(notes)})" if notes else ""
        raise UsageError(
            f"{save} holds no checkpoint (no iter_<step> directory of its lineage){why}; pass the --save "
            "directory of a run that saved one (--save-interval N saves every N steps)"
        )
    if step is None:
        step = max(found)
    if step not in found:
        elsewhere = sorted(str(path) for path in save.rglob(f"iter_{step:07d}") if path.is_dir())
        outside = f" ({', '.join(elsewhere)} is not part of the run's lineage or newer than its tracker)"
        raise UsageError(
            f"{save} has no checkpoint of step {step}{outside if elsewhere else ''}; its checkpoints are steps "
            f"{_steps(sorted(found))}: pass one of them with --step"
        )
    return step, found[step]


def export_checkpoint(
    save: Path, step: int | None, out: Path, *, adapter: bool = False, base: str | None = None
) -> str:
    """Export the checkpoint of `step` of `save` to `out` (a LoRA checkpoint merged into `base`, default the base
    it records, or with `adapter` copied as it is); returns the line that says what was written."""
    from slime.plugins import torch_checkpoint as ckpt
    from slime.plugins import torch_lora

    step, checkpoint = find_checkpoint(save, step)
    lora = torch_lora.is_adapter_checkpoint(checkpoint)
    if (adapter or base) and not lora:
        raise UsageError(
            f"{checkpoint} holds full weights, not LoRA adapters; drop {'--adapter' if adapter else '--base'}"
        )
    if not lora and not (checkpoint / "config.json").is_file():
        kind = "a Megatron checkpoint (distributed shards)" if (checkpoint / "dist").is_dir() else "incomplete"
        raise UsageError(
            f"{checkpoint} has no config.json: it is {kind}, not a Hugging Face directory; export a torch-backend "
            "checkpoint, or train with --save-hf DIR to write Hugging Face directories"
        )
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise UsageError(
            f"{out} exists and is not an empty directory; pass a new or empty directory as OUT (export never "
            "overwrites)"
        )
    merge_into = None
    if lora and not adapter:
        merge_into = base or torch_lora.read_adapter_config(checkpoint).get("base_model_name_or_path")
        if not merge_into or not Path(merge_into).is_dir():
            raise UsageError(
                f"{checkpoint} holds LoRA adapters of the base model {merge_into or '(not recorded)'}, which is not a "
                "directory here; pass --base DIR (the run's --hf-checkpoint) to merge them, or --adapter to copy them"
            )
    try:
        if merge_into is not None:
            written = torch_lora.write_merged(checkpoint, str(merge_into), out)
        else:
            written = ckpt.export_hf_dir(checkpoint, out, replace=False)
    except OSError as exc:
        raise UsageError(f"writing {out} failed ({exc}); pass an OUT on a writable filesystem with room") from exc
    except ValueError as exc:
        raise UsageError(f"merging {checkpoint} into {merge_into} failed: {exc}") from exc
    size = sum(path.stat().st_size for path in written) / (1 << 20)
    written_names = {path.name for path in written}
    what = f"merged into {merge_into}" if merge_into is not None else ("adapter" if lora else "")
    line = (
        f"exported step {step} ({checkpoint}{', ' + what if what else ''}) to {out}: "
        f"{', '.join(sorted(written_names))} ({size:.1f} MiB)"
    )
    if not any(all(name in written_names for name in group) for group in TOKENIZER_FILES):
        line += "; no tokenizer files in this checkpoint (saved by an older slime-rl): copy them from --hf-checkpoint"
    return line


def run_export_cli(argv: Sequence[str]) -> int:
    """`slime-run export ...` with `argv` the words after `export`; returns the exit status."""
    ns = build_export_parser().parse_args(list(argv))
    print(export_checkpoint(Path(ns.save), ns.step, Path(ns.out), adapter=ns.adapter, base=ns.base))
    return 0
