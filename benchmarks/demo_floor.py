"""The demo's algorithm in one process, without the framework: the floor of `benchmarks/e2e.py`.

Same tiny model, same copy task and reward, same GRPO loss and optimizer as `slime-run --plugin straw`
builds, but generation is `model.generate` in the training process: no Ray, no HTTP engines, no transport,
no checkpoints. Its step time is what the framework's step time is measured against, and its reward curve
is a quick way to try the demo's hyperparameters (`python -m benchmarks.demo_floor --steps 100`).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from slime.plugins.torch_optim import LR_DECAY_STYLES

#: Optimizer settings the command line may override (the rest of DEMO_OPTIMIZER stays as the demo has it).
OPTIMIZER_OVERRIDES = ("adam_beta2", "min_lr", "lr_decay_style")


@dataclass
class FloorConfig:
    """The demo's algorithmic settings; defaults are read from the demo plugin so the two cannot drift."""

    steps: int = 20
    rollout_batch_size: int = 8
    n_samples_per_prompt: int = 4
    max_response_len: int = 4
    temperature: float = 1.0
    global_batch_size: int = 0  # samples per optimizer step; 0: the whole rollout (one step)
    lr: float = 1e-3
    #: The rest of the optimizer's settings (`slime.plugins.torch_optim.OptimizerSettings` fields).
    optimizer: dict = field(default_factory=dict)
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    entropy_coef: float = 0.0
    seed: int = 0
    prompt_count: int = 256
    #: A built-in estimator of `slime.plugins.advantage_estimators` (its function of the same name).
    advantage_estimator: str = "grpo"
    #: LoRA adapters of this rank instead of full fine-tuning (0: full), scaled by `lora_alpha / lora_rank`.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_modules_to_save: str = ""

    @classmethod
    def from_demo(cls, **overrides: Any) -> FloorConfig:
        from slime.plugins.demo import DEMO_GLOBAL_BATCH_SIZE, DEMO_OPTIMIZER, DEMO_PROMPT_COUNT, demo_settings

        settings = demo_settings(Path("."))
        values = {
            "steps": settings["num_rollout"],
            "rollout_batch_size": settings["rollout_batch_size"],
            "n_samples_per_prompt": settings["n_samples_per_prompt"],
            "max_response_len": settings["rollout_max_response_len"],
            "temperature": settings.get("rollout_temperature", 1.0),
            "lr": settings["lr"],
            "eps_clip_high": settings.get("eps_clip_high"),
            "entropy_coef": settings.get("entropy_coef", 0.0),
            "global_batch_size": DEMO_GLOBAL_BATCH_SIZE,
            "prompt_count": DEMO_PROMPT_COUNT,
        }
        optimizer = dict(DEMO_OPTIMIZER)
        for key in list(overrides):
            if key in OPTIMIZER_OVERRIDES:
                value = overrides.pop(key)
                if value is not None:
                    optimizer[key] = value
        values["optimizer"] = optimizer
        values.update({key: value for key, value in overrides.items() if value is not None})
        return cls(**values)


@dataclass
class FloorStep:
    step: int
    reward: float
    generate_s: float
    train_s: float
    grad_norm: float
    extras: dict = field(default_factory=dict)


def _generate(model: Any, tokenizer: Any, prompts: list[str], config: FloorConfig) -> tuple[list, list[str]]:
    """Sample one response per prompt; returns (prompt ids + response ids per sample, decoded responses)."""
    encoded = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    width = max(len(ids) for ids in encoded)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])
    attention = (input_ids != pad).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            do_sample=True,
            temperature=config.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=config.max_response_len,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )
    sequences, responses = [], []
    for row, ids in enumerate(encoded):
        generated = out[row, width:].tolist()
        if tokenizer.eos_token_id in generated:
            generated = generated[: generated.index(tokenizer.eos_token_id) + 1]
        sequences.append((ids, generated))
        responses.append(tokenizer.decode(generated, skip_special_tokens=True))
    return sequences, responses


def _response_log_probs(model: Any, sequences: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Response-token log-probs, mask and entropy, right padded (as the torch backend computes them)."""
    from slime.plugins.rl_losses import pad_right, token_log_probs_and_entropy

    rows = [torch.tensor(prompt + response) for prompt, response in sequences]
    lengths = [len(response) for _, response in sequences]
    tokens = pad_right(rows, value=0, dtype=torch.long)
    logits = model(input_ids=tokens).logits[:, :-1]
    all_lp, all_entropy = token_log_probs_and_entropy(logits, tokens[:, 1:])
    spans = [(len(prompt) - 1, n) for (prompt, _), n in zip(sequences, lengths, strict=True)]
    log_probs = pad_right([all_lp[i, start : start + n] for i, (start, n) in enumerate(spans)])
    entropy = pad_right([all_entropy[i, start : start + n] for i, (start, n) in enumerate(spans)])
    return log_probs, pad_right([torch.ones(n) for n in lengths]), entropy


def _train_step(
    model: Any, optimizer: Any, scheduler: Any, sequences: list, advantages: torch.Tensor, config: FloorConfig
) -> float:
    """PPO-clipped GRPO updates over the rollout in order, `global_batch_size` samples per optimizer step;
    returns the mean gradient norm."""
    from slime.plugins.rl_losses import masked_mean, policy_loss

    with torch.no_grad():
        old, _, _ = _response_log_probs(model, sequences)
    size = config.global_batch_size or len(sequences)
    norms = []
    for start in range(0, len(sequences), size):
        chunk = slice(start, start + size)
        if not config.entropy_coef and not advantages[chunk].ne(0).any():
            continue  # no signal and no other term: the trainer takes no optimizer step either (LossSettings)
        log_probs, mask, entropy = _response_log_probs(model, sequences[chunk])
        width = log_probs.shape[1]
        loss_tok, _ = policy_loss(
            log_probs, old[chunk, :width], advantages[chunk, None], config.eps_clip, config.eps_clip_high
        )
        loss = masked_mean(loss_tok - config.entropy_coef * entropy, mask).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        scheduler.step()
    return sum(norms) / len(norms) if norms else 0.0


def run_floor(config: FloorConfig, model_dir: Path | None = None) -> list[FloorStep]:
    """Run `config.steps` GRPO steps of the copy task in this process; one `FloorStep` per step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime.plugins import advantage_estimators
    from slime.plugins.demo_task import DEMO_ROW_OPTIONS, copy_reward, demo_prompt_rows
    from slime.plugins.tiny_model import ensure_tiny_model
    from slime.plugins.torch_optim import OptimizerSettings, build_optimizer

    torch.manual_seed(config.seed)
    with tempfile.TemporaryDirectory() as scratch:
        directory = ensure_tiny_model(model_dir or Path(scratch) / "model")
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory)
    if config.lora_rank:
        from slime.plugins.torch_lora import LoraSettings, add_adapters

        lora = LoraSettings(rank=config.lora_rank, alpha=config.lora_alpha, modules_to_save=config.lora_modules_to_save)
        model = add_adapters(model, lora, seed=config.seed, base=str(directory))
    optimizer, scheduler = build_optimizer(
        [parameter for parameter in model.parameters() if parameter.requires_grad],
        OptimizerSettings.from_args(
            SimpleNamespace(
                lr=config.lr,
                num_rollout=config.steps,
                rollout_batch_size=config.rollout_batch_size,
                n_samples_per_prompt=config.n_samples_per_prompt,
                global_batch_size=config.global_batch_size,
                **config.optimizer,
            )
        ),
    )
    rows = demo_prompt_rows(config.prompt_count, seed=0, **DEMO_ROW_OPTIONS)
    order = list(range(len(rows)))
    random.Random(config.seed).shuffle(order)
    n = config.n_samples_per_prompt
    steps = []
    for step in range(config.steps):
        start = step * config.rollout_batch_size
        picked = [rows[order[(start + k) % len(rows)]] for k in range(config.rollout_batch_size)]
        prompts = [row["input"] for row in picked for _ in range(n)]
        labels = [row["label"] for row in picked for _ in range(n)]
        began = time.perf_counter()
        model.eval()
        sequences, responses = _generate(model, tokenizer, prompts, config)
        generated = time.perf_counter()
        rewards = torch.tensor(
            [
                copy_reward(None, SimpleNamespace(label=label, response=response, index=i))
                for i, (label, response) in enumerate(zip(labels, responses, strict=True))
            ]
        )
        estimate = getattr(advantage_estimators, config.advantage_estimator)
        lengths = [len(tokenizer(response)["input_ids"]) or 1 for response in responses]
        estimator_args = SimpleNamespace(grpo_std_normalization=True)
        advantages = torch.tensor(estimate(estimator_args, rewards.tolist(), n, lengths))
        model.train()
        norm = _train_step(model, optimizer, scheduler, sequences, advantages, config)
        record = FloorStep(step, float(rewards.mean()), generated - began, time.perf_counter() - generated, norm)
        record.extras["examples"] = list(zip(labels, responses, strict=True))[::n]
        steps.append(record)
    return steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in (
        "steps",
        "rollout_batch_size",
        "n_samples_per_prompt",
        "max_response_len",
        "seed",
        "global_batch_size",
        "lora_rank",
    ):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int)
    for name in ("lr", "temperature", "adam_beta2", "min_lr", "eps_clip_high", "entropy_coef", "lora_alpha"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float)
    parser.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES)
    parser.add_argument("--lora-modules-to-save", help="with --lora-rank: modules trained in full (slime-run's flag)")
    parser.add_argument(
        "--advantage-estimator",
        choices=["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"],
        help="a built-in estimator (default grpo)",
    )
    parser.add_argument("--json", help="write the per-step records here")
    options = vars(parser.parse_args(argv))
    output = options.pop("json")
    config = FloorConfig.from_demo(**options)
    steps = run_floor(config)
    rewards = [s.reward for s in steps]
    for s in steps[9::10]:
        window = rewards[s.step - 9 : s.step + 1]
        print(f"steps {s.step - 9:4d}-{s.step:4d} mean reward {sum(window) / 10:.3f} grad_norm {s.grad_norm:.3f}")
    first, last = rewards[:10], rewards[-10:]
    print("last step (label, response):", steps[-1].extras["examples"])
    print(f"first-10 {sum(first) / len(first):.3f} last-10 {sum(last) / len(last):.3f} config {config}")
    if output:
        Path(output).write_text(json.dumps([s.__dict__ for s in steps], indent=1))


if __name__ == "__main__":
    main()
