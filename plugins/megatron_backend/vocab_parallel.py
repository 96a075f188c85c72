"""Per-token log-probs and entropy from logits whose vocabulary is split across tensor-parallel ranks.

With tensor parallelism GPTModel's output layer leaves each rank `V_local = padded_vocab / tp` logits of each
position. The RL losses need log-probs of the sampled tokens and the entropy over the whole vocabulary without
gathering the full logits, and must ignore the padding rows the model carries (`model.padded_vocab_size`) so that
results equal the unpadded Hugging Face model's. Both functions are differentiable with Megatron's
tensor-parallel convention: every rank of the group computes the same loss from the same values, and backward
gives each rank the gradient of its own vocabulary slice.
"""

from __future__ import annotations

import torch


def _tp() -> tuple[int, int, object]:
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def _real_columns(local_vocab: int, true_vocab_size: int, tp_rank: int, tp_size: int) -> int:
    """How many of this rank's vocabulary columns are real tokens (the rest is padding)."""
    if local_vocab * tp_size < true_vocab_size:
        raise ValueError(
            f"logits hold {local_vocab} vocabulary entries per rank x {tp_size} ranks = {local_vocab * tp_size}, "
            f"fewer than the true vocabulary size {true_vocab_size}"
        )
    return max(0, min(local_vocab, true_vocab_size - tp_rank * local_vocab))


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, true_vocab_size: int) -> torch.Tensor:
    """log p(targets[b, s] | position b, s) in float32, shape [B, S], from this rank's logits [B, S, V_local].

    Logits and targets are aligned (for next-token log-probs pass `logits[:, :-1]` and `tokens[:, 1:]`). Uses
    Megatron's `vocab_parallel_cross_entropy`, so it is correct at any tensor-parallel size; padded vocabulary
    entries are set to -inf on the rank holding them. The caller's logits are not modified.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"token_log_probs needs logits [B, S, V_local] and targets [B, S], got {tuple(logits.shape)} and "
            f"{tuple(targets.shape)}"
        )
    tp_rank, tp_size, _ = _tp()
    local_vocab = logits.shape[-1]
    real = _real_columns(local_vocab, true_vocab_size, tp_rank, tp_size)
    padding = torch.arange(local_vocab, device=logits.device) >= real
    # masked_fill always returns a new tensor: Megatron's cross entropy works in place on its input.
    masked = logits.float().masked_fill(padding, float("-inf"))
    return -vocab_parallel_cross_entropy(masked, targets.contiguous())


def entropy(logits: torch.Tensor, true_vocab_size: int) -> torch.Tensor:
    """Entropy of the softmax over the full unpadded vocabulary at each position, float32 [B, S], from this rank's
    logits [B, S, V_local]; the partial sums are all-reduced over the tensor-parallel group (forward all-reduce,
    backward identity: Megatron's `reduce_from_tensor_model_parallel_region`)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    if logits.dim() != 3:
        raise ValueError(f"entropy needs logits [B, S, V_local], got {tuple(logits.shape)}")
    tp_rank, tp_size, group = _tp()
    real = _real_columns(logits.shape[-1], true_vocab_size, tp_rank, tp_size)
    values = logits.float()[..., :real]  # the padding is left out, not masked: no 0 * inf anywhere
    with torch.no_grad():
        if real:
            shift = values.max(dim=-1).values
        else:
            shift = torch.full(values.shape[:-1], float("-inf"), device=values.device)
        if tp_size > 1:
            torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = values - shift.unsqueeze(-1)
    exp = shifted.exp()
    partial = torch.stack([exp.sum(dim=-1), (exp * shifted).sum(dim=-1)]).contiguous()
    total, weighted = reduce_from_tensor_model_parallel_region(partial)
    # H = -sum p log p with p = exp / total and log p = shifted - log total.
    return total.log() - weighted / total
