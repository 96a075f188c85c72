"""Jobs the Megatron tests run on the worker ranks (`megatron_workers.Workers.run`), and the transformers
references they are compared with.

Every job sets up Megatron's parallel state for its layout and tears it down, so jobs of different layouts follow
each other on the same two ranks. Jobs return plain tensors and dicts (they travel by pickle).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron_workers import megatron_parallel


def loss_for_grads(token_lp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
    """The loss whose gradients the tests compare: entropy and log-prob terms with distinct weights."""
    return ent.mean() - 0.5 * token_lp.mean()


def hf_reference(model: Any, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' next-token log-probs [B, S-1] and entropies [B, S] (float32, no grad)."""
    with torch.no_grad():
        logits = model(tokens).logits.float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return {
        "logprobs": log_probs[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0],
        "entropy": -(log_probs.exp() * log_probs).sum(-1),
    }


def hf_loss_grads(model: Any, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of `loss_for_grads` computed by transformers, by Hugging Face parameter name (a tied lm_head
    is the embedding)."""
    model.zero_grad(set_to_none=True)
    logits = model(tokens).logits.float()
    log_probs = torch.log_softmax(logits, dim=-1)
    token_lp = log_probs[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    ent = -(log_probs.exp() * log_probs).sum(-1)
    loss_for_grads(token_lp, ent).backward()
    grads = {name: param.grad.detach().clone() for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _layout(layout_kw: dict[str, int]):
    from slime.plugins.megatron_backend.model import ParallelLayout

    return ParallelLayout(**layout_kw)


def _build_loaded(hf_dir: str, layout, **build_kw):
    from transformers import AutoConfig

    from slime.plugins.megatron_backend.convert import load_hf_weights
    from slime.plugins.megatron_backend.model import build_model

    hf_config = AutoConfig.from_pretrained(hf_dir)
    chunks = build_model(hf_config, layout, **build_kw)
    load_hf_weights(chunks, hf_dir, layout)
    return hf_config, chunks


def _forward_backward(chunks, batches: list[dict[str, torch.Tensor]], vocab: int, *, forward_only: bool):
    """Megatron's schedule over `batches` (tokens and, optionally, packed inputs) with `loss_for_grads`; the loss
    function reports this micro-batch's log-probs and entropies (on the last pipeline stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from slime.plugins.megatron_backend.model import causal_inputs
    from slime.plugins.megatron_backend.vocab_parallel import entropy, token_log_probs

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        tokens = batch["tokens"]
        if "attention_mask" in batch:
            position_ids, attention_mask = batch["position_ids"], batch["attention_mask"]
        else:
            position_ids, attention_mask = causal_inputs(tokens)
        logits = model(tokens, position_ids, attention_mask)

        def loss_func(output):
            token_lp = token_log_probs(output[:, :-1], tokens[:, 1:], vocab)
            ent = entropy(output, vocab)
            return loss_for_grads(token_lp, ent), {"logprobs": token_lp.detach(), "entropy": ent.detach()}

        return logits, loss_func

    for chunk in chunks:
        chunk.zero_grad_buffer()
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=chunks,
        num_microbatches=len(batches),
        seq_length=batches[0]["tokens"].shape[1],
        micro_batch_size=batches[0]["tokens"].shape[0],
        forward_only=forward_only,
    )


def _gathered_grads(chunks, hf_config, layout) -> dict[str, torch.Tensor] | None:
    """The gradients (`main_grad`) by Hugging Face name on rank 0, gathered like the weights (the parameters are
    overwritten with their gradients: the model is discarded afterwards)."""
    from slime.plugins.megatron_backend.convert import gather_hf_state
    from slime.plugins.megatron_backend.model import unwrap_model

    with torch.no_grad():
        for param in unwrap_model(chunks[0]).parameters():
            param.data.copy_(param.main_grad.view_as(param))
    return gather_hf_state(chunks, hf_config, layout)


def model_job(rank: int, hf_dir: str, layout_kw: dict[str, int], tokens: torch.Tensor) -> dict[str, Any]:
    """Load the checkpoint into Megatron, gather it back (round trip), run one forward/backward of
    `loss_for_grads` on `tokens` and gather the gradients. Rank 0 returns `state` and `grads` (Hugging Face
    names), the last stage's first TP rank `logprobs` and `entropy`."""
    from megatron.core import parallel_state

    from slime.plugins.megatron_backend.convert import gather_hf_state

    layout = _layout(layout_kw)
    result: dict[str, Any] = {}
    with megatron_parallel(layout):
        hf_config, chunks = _build_loaded(hf_dir, layout)
        result["state"] = gather_hf_state(chunks, hf_config, layout)
        reports = _forward_backward(chunks, [{"tokens": tokens}], hf_config.vocab_size, forward_only=False)
        if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
            result.update(reports[0])
        result["grads"] = _gathered_grads(chunks, hf_config, layout)
    return result


def packed_job(rank: int, hf_dir: str, layout_kw: dict[str, int], rows: list[torch.Tensor]) -> dict[str, Any]:
    """Log-probs of `rows` packed into one row (`pack_sequences`), and of the rows padded into one batch with
    `causal_inputs` masks, forward only; returned by the last stage's first TP rank with the packing offsets."""
    from megatron.core import parallel_state

    from slime.plugins.megatron_backend.model import pack_sequences

    layout = _layout(layout_kw)
    result: dict[str, Any] = {}
    with megatron_parallel(layout):
        hf_config, chunks = _build_loaded(hf_dir, layout)
        tokens, position_ids, attention_mask, offsets = pack_sequences(rows)
        packed = {"tokens": tokens, "position_ids": position_ids, "attention_mask": attention_mask}
        reports = _forward_backward(chunks, [packed], hf_config.vocab_size, forward_only=True)
        if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
            result = {"logprobs": reports[0]["logprobs"], "offsets": offsets}
    return result


def train_job(
    rank: int, hf_dir: str, layout_kw: dict[str, int], tokens: torch.Tensor, options: dict[str, Any], steps: int
) -> dict[str, Any]:
    """`steps` optimizer steps on `tokens` (two micro-batches each) with `build_model(**options)` and
    `build_optimizer`; returns the step results and losses (last stage) and the trained weights (rank 0)."""
    from megatron.core import parallel_state

    from slime.plugins.megatron_backend.convert import gather_hf_state
    from slime.plugins.megatron_backend.model import build_optimizer, set_lr

    layout = _layout(layout_kw)
    result: dict[str, Any] = {"steps": [], "losses": []}
    bf16 = options.get("bf16", False)
    distributed = options.get("use_distributed_optimizer", False)
    with megatron_parallel(layout):
        hf_config, chunks = _build_loaded(hf_dir, layout, **options)
        optimizer = build_optimizer(
            chunks,
            lr=1e-3,
            adam_beta1=0.9,
            adam_beta2=0.98,
            adam_eps=1e-8,
            weight_decay=0.01,
            clip_grad=1.0,
            bf16=bf16,
            use_distributed_optimizer=distributed,
        )
        for step in range(steps):
            optimizer.zero_grad()
            reports = _forward_backward(chunks, [{"tokens": tokens}] * 2, hf_config.vocab_size, forward_only=False)
            set_lr(optimizer, 1e-3 * (step + 1) / steps)
            result["steps"].append(optimizer.step())
            if parallel_state.is_pipeline_last_stage():
                result["losses"].append(-float(sum(r["logprobs"].mean() for r in reports)) / len(reports))
        result["lrs"] = sorted({group["lr"] for group in optimizer.param_groups})
        result["weight_decays"] = sorted({group["weight_decay"] for group in optimizer.param_groups})
        result["state"] = gather_hf_state(chunks, hf_config, layout)
    return result


def load_error_job(rank: int, hf_dir: str, layout_kw: dict[str, int]) -> None:
    """Build the model of `hf_dir` and load its weights (for checkpoints that must be refused)."""
    layout = _layout(layout_kw)
    with megatron_parallel(layout):
        _build_loaded(hf_dir, layout)


def cpu_compat_job(rank: int, hf_dir: str) -> dict[str, Any]:
    """The CPU fixes seen from a rank: idempotence, RNG state round trip, the device scope, and a forward without
    an explicit mask (Megatron's default causal mask) against one with `causal_inputs`."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from slime.plugins.megatron_backend import cpu_compat
    from slime.plugins.megatron_backend.model import causal_inputs

    layout = _layout({})
    result: dict[str, Any] = {}
    with megatron_parallel(layout):
        cpu_compat.apply_cpu_compat()  # a second time: nothing changes
        hf_config, chunks = _build_loaded(hf_dir, layout, wrap_ddp=False)
        tokens = torch.arange(10).unsqueeze(0) % hf_config.vocab_size
        position_ids, attention_mask = causal_inputs(tokens)
        with torch.no_grad():
            explicit = chunks[0](tokens, position_ids, attention_mask)
            default = chunks[0](tokens, position_ids, None)
        result["default_mask_equal"] = torch.equal(explicit, default)
        saved = cpu_compat.rng_state()
        first = (torch.rand(4), _forked_rand(get_cuda_rng_tracker()))
        cpu_compat.set_rng_state(saved)
        second = (torch.rand(4), _forked_rand(get_cuda_rng_tracker()))
        result["rng_replayed"] = all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
        result["tracker_differs"] = not torch.equal(first[0], first[1])
        result["rng_state_types"] = sorted({type(value).__name__ for value in saved.values()})
        with cpu_compat.cpu_device_scope():
            result["scope_device"] = str(torch.zeros(1, device="cuda").device)
            result["scope_type"] = torch.zeros(1).type()
        result["current_device"] = torch.cuda.current_device()
    return result


def _forked_rand(tracker) -> torch.Tensor:
    with tracker.fork():
        return torch.rand(4)
