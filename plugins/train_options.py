"""The options every training backend shares: the optimizer and its schedule, the RL loss, precision.

A plugin of its own (entry point `train_options`) so that the flags exist whichever backends a run loads: the
torch and the Megatron backends both read them, through `slime.plugins.torch_optim.OptimizerSettings` and
`slime.plugins.rl_losses.LossSettings`.
"""

from __future__ import annotations

import logging
from typing import Any

from slime import hookimpl
from slime.plugins.rl_losses import KL_ESTIMATORS, LOSS_AGG_MODES, TIS_MODES, LossSettings
from slime.plugins.torch_optim import add_optimizer_options
from slime.utils.hf_checkpoint import validate_hf_checkpoint_dir

logger = logging.getLogger(__name__)


@hookimpl
def slime_addoption(parser) -> None:
    add_optimizer_options(parser)
    group = parser.add_argument_group("loss (every train backend)")
    group.add_argument("--eps-clip-high", type=float, default=None, help="upper clip range (default: --eps-clip)")
    group.add_argument(
        "--kl-loss-type",
        choices=KL_ESTIMATORS,
        default="k3",
        help="the KL estimator of the KL loss and of the --kl-coef reward penalty",
    )
    group.add_argument(
        "--use-kl-loss",
        action="store_true",
        help="add the KL to the reference model to the loss, weighted by --kl-loss-coef",
    )
    group.add_argument(
        "--kl-loss-coef", type=float, default=0.0, help="the KL loss's weight; weighs nothing without --use-kl-loss"
    )
    group.add_argument(
        "--ref-load",
        metavar="DIR",
        default=None,
        help="the KL loss's reference model: a local Hugging Face model directory sharing the policy's tokenizer "
        "(default: the model the run starts from, --hf-checkpoint). Read only with a KL term (--use-kl-loss "
        "--kl-loss-coef or --kl-coef above 0); upstream slime's Megatron checkpoints are not read",
    )
    group.add_argument(
        "--entropy-coef", type=float, default=0.0, help="weight of the entropy bonus subtracted from the loss"
    )
    group.add_argument(
        "--use-rollout-logprobs",
        action="store_true",
        help="take the engines' log-probs as the old policy instead of recomputing them in the trainer",
    )
    group.add_argument(
        "--use-tis",
        action="store_true",
        help="truncated importance sampling: weight each token's policy loss by exp(old - rollout log-prob), the "
        "trainer's probability of the token over the engine's, bounded by --tis-clip-low/--tis-clip",
    )
    group.add_argument("--tis-clip", type=float, default=2.0, help="upper bound of the --use-tis weight (> 0)")
    group.add_argument("--tis-clip-low", type=float, default=0.0, help="lower bound of the --use-tis weight")
    group.add_argument(
        "--tis-mode",
        choices=TIS_MODES,
        default="truncate",
        help="a weight outside the bounds: truncate (clamp it to the bound) or mask (the token counts 0)",
    )
    group.add_argument(
        "--loss-agg-mode",
        choices=LOSS_AGG_MODES,
        default="seq-mean-token-mean",
        help="how token losses make the batch loss: each sample's token mean averaged over samples; token-mean: "
        "every token of the global batch weighs the same; seq-mean-token-sum: each sample's token sum averaged "
        "over samples; seq-mean-token-sum-norm: that sum over --rollout-max-response-len (Dr. GRPO)",
    )
    group.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="the same as --loss-agg-mode token-mean (upstream slime's spelling)",
    )
    precision = parser.add_argument_group("precision (every train backend)")
    precision.add_argument(
        "--bf16",
        action="store_true",
        help="train in bfloat16 with float32 master weights in the optimizer (default: float32 throughout)",
    )
    precision.add_argument(
        "--fp16",
        action="store_true",
        help="train in float16 autocast with float32 master weights and dynamic loss scaling: an optimizer step "
        "whose scaled gradients overflow is skipped (counted in train/skipped_steps) and the scale halved; torch "
        "backend, without --fsdp",
    )


def check_reference_model(args: Any, loss: LossSettings) -> None:
    """`--ref-load` names a complete model directory when a KL term reads it; without one it is not loaded (upstream
    scripts pass it with KL weights of 0), which is said once."""
    ref_load = getattr(args, "ref_load", None)
    if not ref_load:
        return
    if not loss.needs_reference:
        logger.info(
            "--ref-load %s is not loaded: the run has no KL term (--use-kl-loss --kl-loss-coef or --kl-coef above 0)",
            ref_load,
        )
        return
    try:
        validate_hf_checkpoint_dir(ref_load, flag="--ref-load", tokenizer=False)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from exc


@hookimpl
def slime_configure(args: Any) -> None:
    """Refuse, while the arguments are parsed, a loss no backend can run."""
    if getattr(args, "bf16", False) and getattr(args, "fp16", False):
        raise ValueError("--bf16 with --fp16: choose one training precision")
    loss = LossSettings.from_args(args)  # ValueError naming the flag for a value out of range
    check_reference_model(args, loss)
    if loss.use_tis and getattr(args, "use_rollout_logprobs", False):
        raise ValueError(
            "--use-tis with --use-rollout-logprobs: the old policy's log-probs would be the engine's own, so every "
            "importance weight is 1; drop one of them"
        )
