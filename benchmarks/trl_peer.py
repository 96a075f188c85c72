"""The demo's workload on TRL's `GRPOTrainer`: the peer row of `benchmarks/e2e.py` (when `trl` is installed).

Same tiny model (`slime.plugins.tiny_model`), same copy-task prompts and reward (`slime.plugins.demo_task`), same
batch shape as the CPU demo: 16 prompts x 8 samples per generation round, `DEMO_GLOBAL_BATCH_SIZE` samples per
optimizer step (so 8 optimizer steps per round, TRL's `steps_per_generation`), the demo's response budget,
temperature, learning rate and clip range; no KL term (TRL's default beta 0, as the demo). TRL generates with
`model.generate` in the training process, on CPU here. A round of 8 optimizer steps is one demo step; its time is
measured with a trainer callback from the end of one round's last optimizer step to the next's.

Differences that remain: TRL's loss aggregation default ("dapo": token-level over the whole batch) and its
optimizer (AdamW with its own defaults, linear decay) are TRL's; the point of the row is the per-step cost of a
one-process trainer, not identical learning.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

#: Samples per generation round: the demo's 16 prompts x 8 samples.
PROMPTS_PER_STEP = 16
SAMPLES_PER_PROMPT = 8


def trl_available() -> bool:
    return importlib.util.find_spec("trl") is not None


def measure_trl(steps: int, warmup: int) -> dict[str, Any]:
    """Run `steps` demo-shaped GRPO rounds on TRL; seconds per round (mean of those after `warmup`) and TRL's
    version."""
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    from slime.plugins.demo import DEMO_GLOBAL_BATCH_SIZE, DEMO_PROMPT_COUNT, demo_settings
    from slime.plugins.demo_task import DEMO_ROW_OPTIONS, demo_prompt_rows
    from slime.plugins.tiny_model import ensure_tiny_model

    settings = demo_settings(Path("."))
    samples = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    per_round = samples // DEMO_GLOBAL_BATCH_SIZE
    rows = demo_prompt_rows(DEMO_PROMPT_COUNT, seed=0, **DEMO_ROW_OPTIONS)
    dataset = datasets.Dataset.from_list([{"prompt": row["input"], "label": row["label"]} for row in rows])

    def copy_reward(prompts: list[str], completions: list[str], label: list[str], **_: Any) -> list[float]:
        """The demo's copy reward (`slime.plugins.demo_task.copy_reward`) on TRL's batch columns."""
        scores = []
        for target, completion in zip(label, completions, strict=True):
            response = completion.strip()
            matches = sum(1 for expected, got in zip(target, response, strict=False) if expected == got)
            scores.append(max(0.0, matches / len(target) - 0.1 * max(0, len(response) - len(target))))
        return scores

    ends: list[float] = []

    class RoundTimer(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % per_round == 0:
                ends.append(time.perf_counter())

    torch.manual_seed(0)
    # transformers' deprecation notices for the arguments and calls TRL uses are left out of the report's output.
    with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        directory = ensure_tiny_model(Path(scratch) / "model")
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory)
        config = trl.GRPOConfig(
            output_dir=str(Path(scratch) / "out"),
            per_device_train_batch_size=DEMO_GLOBAL_BATCH_SIZE,
            gradient_accumulation_steps=1,
            num_generations=SAMPLES_PER_PROMPT,
            generation_batch_size=samples,
            max_completion_length=settings["rollout_max_response_len"],
            temperature=settings.get("rollout_temperature", 1.0),
            learning_rate=settings["lr"],
            max_steps=(steps + 1) * per_round,
            use_cpu=True,
            report_to=[],
            logging_strategy="no",
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=copy_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[RoundTimer()],
        )
        trainer.remove_callback(PrinterCallback)  # its end-of-training dict on stdout would break the report
        began = time.perf_counter()
        trainer.train()
    rounds = [end - start for start, end in zip([began, *ends], ends, strict=False)]
    measured = rounds[1 + warmup :] or rounds[-1:]  # the first round includes TRL's own start
    return {
        "step": sum(measured) / len(measured),
        "rounds_s": rounds,
        "optimizer_steps_per_round": per_round,
        "trl": trl.__version__,
    }
