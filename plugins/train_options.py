"""The options every training backend shares: the optimizer and its schedule, the RL loss, precision.

A plugin of its own (entry point `train_options`) so that the flags exist whichever backends a run loads: the
torch and the Megatron backends both read them, through `slime.plugins.torch_optim.OptimizerSettings` and
`slime.plugins.rl_losses.LossSettings`.
"""

from __future__ import annotations

from slime import hookimpl
from slime.plugins.rl_losses import KL_ESTIMATORS
from slime.plugins.torch_optim import add_optimizer_options


@hookimpl
def slime_addoption(parser) -> None:
    add_optimizer_options(parser)
    group = parser.add_argument_group("loss (every train backend)")
    group.add_argument("--eps-clip-high", type=float, default=None, help="upper clip range (default: --eps-clip)")
    group.add_argument("--kl-loss-type", choices=KL_ESTIMATORS, default="k3", help="KL estimator when --kl-coef > 0")
    group.add_argument(
        "--entropy-coef", type=float, default=0.0, help="weight of the entropy bonus subtracted from the loss"
    )
    group.add_argument(
        "--use-rollout-logprobs",
        action="store_true",
        help="take the engines' log-probs as the old policy instead of recomputing them in the trainer",
    )
    precision = parser.add_argument_group("precision (every train backend)")
    precision.add_argument(
        "--bf16",
        action="store_true",
        help="train in bfloat16 with float32 master weights in the optimizer (default: float32 throughout)",
    )
