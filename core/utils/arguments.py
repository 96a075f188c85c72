"""The command line of a training run.

Parsing happens twice, as in pytest: a pre-parse finds `-p/--plugin` and the autoload switch, the run's
plugin manager is built from that selection, plugins add their options (`slime_addoption`), plugins named
on the command line set their defaults (`slime_cli_defaults`, each one logged), and then the full command
line is parsed. `args.plugin_selection` carries the selection to Ray actors.
"""

from __future__ import annotations

import argparse
import difflib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pluggy

from slime.data.eval_data import EvalSettings
from slime.determinism import check_deterministic_run
from slime.plugin_manager import (
    PluginError,
    PluginSelection,
    Registry,
    build_plugin_manager,
    collect_registry,
    named_plugin_defaults,
)
from slime.ray.layout import parse_resources
from slime.ray.router import ROUTER_CHOICES, sglang_router_available
from slime.rollout.remote_reward import check_remote_reward_options
from slime.rollout.rm_hub import REWARD_ERROR_POLICIES, RewardSettings, parse_weights, split_names
from slime.specs import RATIO_LEVELS
from slime.utils.upstream_flags import add_upstream_refusals
from slime.weight_sync import DEFAULT_BUCKET_BYTES, TRANSPORTS

logger = logging.getLogger(__name__)


def add_plugin_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("plugins")
    group.add_argument(
        "-p",
        "--plugin",
        dest="plugins",
        action="append",
        default=[],
        metavar="NAME",
        help="load a plugin: a built-in or entry-point name, or a dotted module; 'no:NAME' blocks one "
        "(repeatable; SLIME_PLUGINS=a,b adds more)",
    )
    group.add_argument(
        "--disable-plugin-autoload",
        action="store_true",
        help="do not load third-party entry-point plugins unless named with --plugin "
        "(also: SLIME_DISABLE_PLUGIN_AUTOLOAD=1)",
    )


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("rollout data")
    data.add_argument("--rollout-data-transport", default="object-store", help="transport plugin name")
    data.add_argument("--rollout-data-dir", default=None, help="straw pool on a filesystem every node mounts")
    data.add_argument("--rollout-queue-run-id", default=None, help="namespace of this run's writers inside the pool")
    data.add_argument("--rollout-queue-segment-mib", type=float, default=None, help="target pack size in MiB")
    data.add_argument("--rollout-queue-online-gc", action="store_true", help="reclaim unreferenced packs while running")
    data.add_argument("--rollout-queue-gc-interval", type=float, default=60.0, help="seconds between online GC passes")
    data.add_argument("--rollout-queue-lease-seconds", type=int, default=300)
    data.add_argument(
        "--rollout-queue-take-timeout",
        type=float,
        default=600.0,
        help="seconds a rollout waits for the queue to lease it prompt groups",
    )
    data.add_argument("--rollout-storage-profile", default="local", help="straw filesystem profile (local, juicefs)")
    data.add_argument("--rollout-storage-declaration", default=None, help="JSON file declaring the storage properties")
    data.add_argument("--rollout-data-compression", choices=["none", "zstd"], default="none")
    data.add_argument(
        "--rollout-io-concurrency",
        type=int,
        default=16,
        help="group publications in flight at once while generating (they wait on fsync and the queue, not the CPU)",
    )

    rollout = parser.add_argument_group("rollout")
    rollout.add_argument(
        "--hf-checkpoint",
        default=None,
        help="a Hugging Face model directory, or a Hub id (owner/name) fetched into the Hugging Face cache at start-up "
        "(found there when the Hub is unreachable); default: the built-in tiny model",
    )
    rollout.add_argument(
        "--prompt-data",
        nargs="+",
        default=None,
        metavar="LOCATION[:WEIGHT]",
        help="the training prompts: a JSONL or Parquet file, a directory written by datasets' save_to_disk, or a "
        "Hugging Face Hub dataset id (owner/name; needs `pip install 'slime-rl[data]'`). Several LOCATION:WEIGHT "
        "train on a weighted mixture, e.g. --prompt-data math.jsonl:0.7 code.parquet:0.3",
    )
    rollout.add_argument(
        "--prompt-data-split",
        default=None,
        help="the split of a datasets directory or Hub dataset with several (default: train, or its only split)",
    )
    rollout.add_argument("--input-key", default="input", help="the field of a prompt row that holds the prompt")
    rollout.add_argument("--label-key", default=None, help="the field that holds the label the reward reads")
    rollout.add_argument("--metadata-key", default="metadata", help="the field that holds the row's metadata")
    rollout.add_argument(
        "--tool-key",
        default=None,
        help="the field that holds a row's tools (a list of function schemas, or its JSON), passed to the chat "
        "template as tools=",
    )
    rollout.add_argument(
        "--apply-chat-template", action="store_true", help="send a plain-text prompt as one user message"
    )
    rollout.add_argument(
        "--apply-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="keyword arguments every chat prompt is rendered with, as a JSON object, e.g. "
        "'{\"enable_thinking\": false}'",
    )
    rollout.add_argument("--rollout-shuffle", action="store_true")
    rollout.add_argument("--rollout-seed", type=int, default=42, help="seeds prompt shuffling and sampling")
    rollout.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="reproducible run (on for the built-in demo): each sample is seeded from --rollout-seed, its prompt "
        "group, its index and the rollout step; groups train in the order they were issued; engines and trainers "
        "use batch-invariant, deterministic arithmetic. Killed and resumed any number of times, the run ends with "
        "bitwise the weights of an uninterrupted one. Refused with components that cannot honour it; slower "
        "generation (see docs/reproducibility.md)",
    )
    rollout.add_argument("--num-rollout", type=int, default=None)
    rollout.add_argument("--num-epoch", type=int, default=None)
    rollout.add_argument("--rollout-batch-size", type=int, default=8, help="prompts per rollout step")
    rollout.add_argument("--n-samples-per-prompt", type=int, default=4)
    rollout.add_argument("--over-sampling-batch-size", type=int, default=None)
    rollout.add_argument("--rollout-max-response-len", type=int, default=16)
    rollout.add_argument("--rollout-temperature", type=float, default=1.0)
    rollout.add_argument("--rollout-top-p", type=float, default=1.0)
    rollout.add_argument("--rollout-top-k", type=int, default=-1)
    rollout.add_argument(
        "--eval-prompt-data",
        nargs="+",
        metavar="NAME PATH",
        default=None,
        help="held-out prompts (each PATH a JSONL or Parquet file, a datasets directory or a Hub dataset id, with "
        "the --input-key/--label-key fields) evaluated every --eval-interval steps; metrics eval/NAME/reward and "
        "eval/NAME/pass@k. Evaluation never draws from the training prompts or the queue",
    )
    rollout.add_argument(
        "--eval-prompt-data-split",
        default=None,
        help="the split of an eval datasets directory or Hub dataset with several (default: test, or its only split)",
    )
    rollout.add_argument(
        "--n-samples-per-eval-prompt",
        type=int,
        default=1,
        help="samples per eval prompt; above 1, pass@k for k = 1, 2, 4, ... n is reported (a pass earns reward 1)",
    )
    rollout.add_argument("--eval-max-response-len", type=int, default=None, help="default: --rollout-max-response-len")
    rollout.add_argument("--eval-temperature", type=float, default=None, help="default: --rollout-temperature")
    rollout.add_argument("--eval-top-p", type=float, default=None, help="default: --rollout-top-p")
    rollout.add_argument("--eval-top-k", type=int, default=None, help="default: --rollout-top-k")
    rollout.add_argument("--rollout-engine", default="cpu", help="rollout engine plugin name")
    rollout.add_argument("--rollout-num-engines", type=int, default=2)
    rollout.add_argument(
        "--rollout-router",
        choices=ROUTER_CHOICES,
        default="auto",
        help="sglang-router: start one sglang-router (pip install 'slime-rl[router]') in front of the engines and "
        "send every rollout request through it; none: the rollout functions spread requests over the engines; "
        "auto: sglang-router when there are several engines and the package is installed (and not --deterministic), "
        "else none",
    )
    rollout.add_argument("--sglang-server-concurrency", type=int, default=64)
    rollout.add_argument(
        "--partial-rollout",
        action="store_true",
        help="keep partial generations across weight updates: engines pause with mode 'retract' (running requests "
        "wait and finish with the new weights) instead of 'abort'",
    )
    rollout.add_argument(
        "--offload-rollout",
        action="store_true",
        help="for engines that share devices with the trainers: after each rollout step the engines release their "
        "weights' and KV cache's memory (/release_memory_occupation) and take it back before the next weight update",
    )
    rollout.add_argument(
        "--rollout-http-timeout",
        type=float,
        default=600.0,
        help="seconds an HTTP request to an engine may take (a generation, a weight update)",
    )
    rollout.add_argument(
        "--rollout-request-retries",
        type=int,
        default=3,
        help="retries of an engine request that failed (connection error, HTTP 5xx, malformed reply), each on "
        "another live engine when there is one",
    )
    rollout.add_argument(
        "--rollout-health-check-interval", type=float, default=5.0, help="seconds between engine health checks"
    )
    rollout.add_argument("--rollout-health-check-timeout", type=float, default=5.0, help="seconds per health check")
    rollout.add_argument(
        "--rollout-health-check-failures",
        type=int,
        default=3,
        help="consecutive failed health checks after which an engine is dead (relaunched at the next weight update)",
    )
    rollout.add_argument("--rollout-function-path", default="sglang", help="registered name or dotted path")
    rollout.add_argument("--eval-function-path", default=None)
    rollout.add_argument(
        "--data-source-path", default=None, help="registered name or dotted path (default: the transport's data source)"
    )
    rollout.add_argument("--custom-generate-function-path", default=None)
    rollout.add_argument(
        "--rm-type",
        default=None,
        help="registered reward function name, or several comma-separated (a,b) to train on their weighted sum "
        "(see docs/rewards.md)",
    )
    rollout.add_argument(
        "--rm-weights",
        default=None,
        metavar="W1,W2",
        help="weights of the comma-separated --rm-type rewards, one per reward (default: equal weights summing to 1)",
    )
    rollout.add_argument(
        "--reward-timeout",
        type=float,
        default=30.0,
        help="seconds one sample's reward call may take; a call that overruns or raises is a reward error",
    )
    rollout.add_argument(
        "--reward-error",
        choices=REWARD_ERROR_POLICIES,
        default="zero",
        help="what a reward error does to its sample: zero (reward 0.0, marked metadata['reward_error']) or "
        "drop-group (the sample's whole group is dropped, like a filtered group; rollout function sglang only); "
        "counted in rollout/reward_errors either way",
    )
    rollout.add_argument(
        "--rm-url",
        default=None,
        help='reward server of --rm-type remote: samples are POSTed as JSON, it answers {"rewards": [...]}',
    )
    rollout.add_argument(
        "--rm-timeout",
        type=float,
        default=None,
        help="seconds one HTTP request to --rm-url may take (default: --reward-timeout, which bounds the whole call "
        "with its retries)",
    )
    rollout.add_argument(
        "--rm-max-retries",
        type=int,
        default=3,
        help="retries of a failed --rm-url request (connection error, timeout, HTTP 429 or 5xx), with exponential "
        "backoff",
    )
    rollout.add_argument(
        "--rm-batch-size",
        type=int,
        default=16,
        help="samples per request to --rm-url: the rewards asked for within 20 ms of each other go in one request",
    )
    rollout.add_argument(
        "--rm-api-key",
        default=None,
        help="sent to --rm-url as 'Authorization: Bearer KEY' (default: the SLIME_RM_API_KEY environment variable)",
    )
    rollout.add_argument("--custom-rm-path", default=None)
    rollout.add_argument("--reward-key", default=None)
    rollout.add_argument("--dynamic-sampling-filter-path", default=None)
    rollout.add_argument("--rollout-sample-filter-path", default=None)
    rollout.add_argument("--rollout-all-samples-process-path", default=None)
    rollout.add_argument("--custom-reward-post-process-path", default=None)
    rollout.add_argument("--custom-convert-samples-to-train-data-path", default=None)

    train = parser.add_argument_group("training")
    train.add_argument("--train-backend", default="torch", help="training backend plugin name")
    train.add_argument(
        "--advantage-estimator",
        default="grpo",
        help="registered advantage estimator (built in: grpo, gspo, dr_grpo, rloo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, ppo with --use-critic; `slime-run plugins` lists every one loaded); "
        "docs/losses.md",
    )
    train.add_argument(
        "--importance-ratio-level",
        choices=RATIO_LEVELS,
        default=None,
        help="the policy loss's importance ratio: one per token (PPO) or one per sequence, the geometric mean of its "
        "tokens' (GSPO) (default: the advantage estimator's: sequence for gspo, token otherwise)",
    )
    train.add_argument(
        "--use-critic",
        action="store_true",
        help="train a value model on a second group of ranks (--critic-num-nodes x --critic-num-gpus-per-node), for "
        "an estimator that needs one (--advantage-estimator ppo)",
    )
    train.add_argument(
        "--num-critic-only-steps",
        type=int,
        default=0,
        help="with --use-critic, train only the critic for the first N steps (the policy does not move and those "
        "steps commit nothing)",
    )
    train.add_argument(
        "--rewards-normalization",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="subtract each prompt group's mean reward (GRPO's baseline)",
    )
    train.add_argument(
        "--disable-rewards-normalization",
        dest="rewards_normalization",
        action="store_false",
        help="upstream slime's spelling of --no-rewards-normalization",
    )
    train.add_argument(
        "--grpo-std-normalization",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="divide the normalized rewards by the group's standard deviation",
    )
    train.add_argument(
        "--disable-grpo-std-normalization",
        dest="grpo_std_normalization",
        action="store_false",
        help="upstream slime's spelling of --no-grpo-std-normalization",
    )
    train.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per optimizer step (default: one step per rollout)",
    )
    train.add_argument(
        "--num-steps-per-rollout",
        type=_positive_int,
        default=None,
        metavar="N",
        help="optimizer steps per rollout: sets --global-batch-size to --rollout-batch-size x "
        "--n-samples-per-prompt / N",
    )
    train.add_argument("--micro-batch-size", type=int, default=8)
    train.add_argument("--use-dynamic-batch-size", action="store_true")
    train.add_argument("--max-tokens-per-gpu", type=int, default=None)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument(
        "--kl-coef",
        type=float,
        default=0.0,
        help="KL penalty in the reward: each response token's reward loses kl_coef x KL(old policy || reference) "
        "(--kl-loss-type), so a token's advantage loses the penalty of itself and every later token; for a KL term "
        "in the loss use --use-kl-loss --kl-loss-coef",
    )
    train.add_argument("--eps-clip", type=float, default=0.2)
    train.add_argument("--actor-num-nodes", type=int, default=1)
    train.add_argument("--actor-num-gpus-per-node", type=int, default=1, help="ranks per node (CPU processes on CPU)")
    train.add_argument("--critic-num-nodes", type=int, default=1, help="with --use-critic")
    train.add_argument("--critic-num-gpus-per-node", type=int, default=1, help="critic ranks per node (--use-critic)")
    train.add_argument(
        "--train-num-cpus-per-rank",
        type=float,
        default=1.0,
        help="Ray CPUs per training rank on a cluster without GPUs",
    )
    train.add_argument(
        "--balance-data",
        action="store_true",
        help="split each step's samples across data-parallel ranks by token count (default: contiguous, equal count)",
    )
    train.add_argument(
        "--release-train",
        action="store_true",
        help="kill the training ranks after each weight export and re-create them, from the checkpoint saved every "
        "step, before the next step trains (frees their memory while the engines generate)",
    )
    train.add_argument(
        "--update-weight-mode",
        default="full",
        choices=["full"],
        help="full: every weight goes to the engines at every update (the only mode implemented)",
    )
    train.add_argument(
        "--update-weight-transport",
        default="disk",
        choices=list(TRANSPORTS),
        help="how weights reach the engines after each step: disk (an export under --update-weight-disk-dir that "
        "the engines load), distributed (a torch.distributed broadcast from training rank 0 to every engine rank: "
        "gloo, NCCL when training on GPUs), tensor (shared memory; engines on training rank 0's machine only)",
    )
    train.add_argument(
        "--update-weight-buffer-size",
        type=int,
        default=DEFAULT_BUCKET_BYTES,
        help="bytes of weights per bucket (distributed and tensor updates); a larger tensor travels alone",
    )
    train.add_argument("--update-weight-disk-dir", default=None)
    train.add_argument(
        "--update-weight-disk-keep-files",
        action="store_true",
        help="keep each exported weight directory after the engines loaded it (default: removed)",
    )
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument(
        "--use-rollout-routing-replay",
        action="store_true",
        help="keep and validate the MoE routed experts the engines captured, for a backend that replays them",
    )
    train.add_argument("--num-layers", type=int, default=None, help="layers a routed-experts capture must cover")
    train.add_argument("--moe-router-topk", type=int, default=None, help="experts per token in routed-experts captures")
    train.add_argument(
        "--use-score-centering",
        action="store_true",
        help="keep and validate the engines' top-k (top-p with --rollout-top-p < 1) log-prob captures, for a backend "
        "that centers scores with them",
    )
    train.add_argument("--score-centering-top-k", type=int, default=None, help="entries per token in a top-k capture")

    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--save", default=None, help="checkpoint directory (joint commits with straw)")
    ckpt.add_argument("--load", default=None, help="checkpoint directory or committed_<step>.json to restore")
    ckpt.add_argument("--ckpt-step", type=int, default=None, help="restore this step into a new branch")
    ckpt.add_argument("--save-interval", type=int, default=None)
    ckpt.add_argument("--checkpoint-policy", default=None, help="override the transport's checkpoint policy")
    ckpt.add_argument("--keep-last-checkpoints", type=int, default=None)
    ckpt.add_argument("--keep-every-checkpoint", type=int, default=None)
    ckpt.add_argument("--no-save-optim", action="store_true")
    ckpt.add_argument("--no-save-rng", action="store_true")
    ckpt.add_argument(
        "--save-hf",
        default=None,
        metavar="DIR",
        help="with every checkpoint also write the model as a Hugging Face directory here ({rollout_id} is "
        "replaced by the step; an older directory of that name is replaced): config, weights and tokenizer files "
        "that AutoModelForCausalLM and AutoTokenizer load. Torch and megatron backends (megatron: gathered from "
        "all tensor- and pipeline-parallel ranks)",
    )
    ckpt.add_argument("--no-load-optim", action="store_true")
    ckpt.add_argument("--no-load-rng", action="store_true")
    ckpt.add_argument(
        "--use-stateless-adam",
        action="store_true",
        help="the optimizer keeps no state a resume needs: a checkpoint saved with --no-save-optim stays resumable "
        "(it must hold opt_param_scheduler.pt)",
    )

    debug = parser.add_argument_group("debugging")
    debug.add_argument(
        "--save-debug-rollout-data", default=None, help="path template, e.g. dumps/{rollout_id}.straw.json"
    )
    debug.add_argument("--load-debug-rollout-data", default=None, help="replay archived rollouts into training")
    debug.add_argument(
        "--load-debug-rollout-data-subsample",
        type=float,
        default=None,
        help="replay about this fraction, in (0, 1], of each archived rollout: half from its head, half from its tail",
    )
    debug.add_argument("--debug-train-only", action="store_true")
    debug.add_argument("--debug-rollout-only", action="store_true")
    debug.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="evaluate --eval-prompt-data every N steps, before the first and after the last",
    )
    debug.add_argument(
        "--skip-eval-before-train", action="store_true", help="no evaluation before the first step (--eval-interval)"
    )
    debug.add_argument(
        "--eval-only",
        action="store_true",
        help="evaluate --eval-prompt-data once with the model of --load (or --hf-checkpoint) and stop; trains nothing",
    )
    debug.add_argument("--metrics-dir", default=None)

    cluster = parser.add_argument_group(
        "Ray cluster",
        "Without --ray-address (or RAY_ADDRESS) the run starts a local Ray instance and stops it at the end.",
    )
    cluster.add_argument(
        "--ray-address",
        default=None,
        metavar="HOST:PORT",
        help="join the running Ray cluster whose head's GCS is at HOST:PORT (as `ray start --head` prints it; "
        "`auto` finds one started on this machine) instead of starting a local one; the run's actors end with "
        "the run, the cluster keeps running. Run slime-run on a node of the cluster: the driver reads and writes "
        "--save and the straw pool, which every node must mount (checked at start)",
    )
    cluster.add_argument(
        "--ray-connect-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long to try reaching --ray-address before stopping with the address and the last error",
    )
    cluster.add_argument(
        "--train-resources",
        type=_custom_resources,
        default=None,
        metavar="NAME=AMOUNT[,...]",
        help="custom Ray resources every training rank asks for, to pin the ranks to the nodes that offer them "
        "(start those with `ray start --resources '{\"NAME\": N}'`). The layout is checked against the cluster "
        "before anything starts: what does not fit is named per node",
    )
    cluster.add_argument(
        "--rollout-resources",
        type=_custom_resources,
        default=None,
        metavar="NAME=AMOUNT[,...]",
        help="custom Ray resources every rollout engine asks for, besides its CPUs/GPUs (as --train-resources)",
    )

    console = parser.add_argument_group("console")
    console.add_argument(
        "--log-interval",
        type=_positive_int,
        default=10,
        metavar="N",
        help="every N steps the progress bar prints one summary line: the interval's mean reward and step time, "
        "the last train loss, grad norm and entropy, the last commit; tracker plugins log a table of sample "
        "answers at the same steps",
    )
    console.add_argument(
        "--verbose",
        action="store_true",
        help="also log every step's metrics, each option a plugin sets, library INFO lines (Ray, transformers) "
        "and the actors' progress bars",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _custom_resources(text: str) -> dict[str, float]:
    try:
        return parse_resources(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser(pm: Any = None) -> argparse.ArgumentParser:
    """The full parser; with a plugin manager, plugins' options are added too."""
    parser = argparse.ArgumentParser(
        prog="slime-run",
        description="Train a language model with RL (GRPO/PPO-style) on Ray. With --plugin straw every rollout "
        "is durable on shared storage and the run resumes from its last joint checkpoint when rerun.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_plugin_arguments(parser)
    _add_run_arguments(parser)
    add_upstream_refusals(parser)
    if pm is not None:
        pm.hook.slime_addoption.call_historic(kwargs={"parser": parser})
    return parser


#: Flags that name a registered thing (or a dotted path), by destination, with the registry kind they name.
NAMED_OPTIONS = {
    "rollout_function_path": "rollout_functions",
    "eval_function_path": "rollout_functions",
    "data_source_path": "data_sources",
    "dynamic_sampling_filter_path": "batch_filters",
    "rollout_sample_filter_path": "batch_filters",
    "custom_rm_path": "reward_functions",
    "rm_type": "reward_functions",
    "advantage_estimator": "advantage_estimators",
    "checkpoint_policy": "checkpoint_policies",
    "rollout_engine": "rollout_engines",
    "train_backend": "train_backends",
}


#: Name-valued flags that take a comma-separated list of names.
LIST_OPTIONS = frozenset({"rm_type"})


def _check_named_options(parser: argparse.ArgumentParser, args: argparse.Namespace, registry: Registry) -> None:
    """Resolve every name-valued flag now (importing dotted paths), so a wrong one fails before Ray starts."""
    for dest, kind in NAMED_OPTIONS.items():
        value = getattr(args, dest, None)
        if not isinstance(value, str):
            continue
        try:
            for name in split_names(value) if dest in LIST_OPTIONS else [value]:
                registry.resolve(kind, name)
        except (PluginError, ImportError, AttributeError, ValueError) as exc:
            parser.error(f"--{dest.replace('_', '-')}: {exc}")


def _apply_num_steps_per_rollout(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--num-steps-per-rollout N` sets `--global-batch-size` to a rollout's samples / N (after the plugins' defaults,
    which it overrides; a `--global-batch-size` given on the command line must agree)."""
    steps = args.num_steps_per_rollout
    if steps is None:
        return
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if samples % steps:
        parser.error(
            f"--num-steps-per-rollout {steps} does not divide a rollout's {samples} samples (--rollout-batch-size "
            f"{args.rollout_batch_size} x --n-samples-per-prompt {args.n_samples_per_prompt})"
        )
    global_batch_size = samples // steps
    if "global_batch_size" in args.explicit_options and args.global_batch_size != global_batch_size:
        parser.error(
            f"--num-steps-per-rollout {steps} means --global-batch-size {global_batch_size}, not "
            f"{args.global_batch_size}: give one of them"
        )
    args.global_batch_size = global_batch_size


def _check_advantage_estimator(parser: argparse.ArgumentParser, args: argparse.Namespace, registry: Registry) -> None:
    """Match `--use-critic` to what the estimator needs; default `--importance-ratio-level` to the estimator's."""
    spec = registry.kinds["advantage_estimators"].get(args.advantage_estimator)
    needs_critic = spec.needs_critic if spec is not None else False  # a dotted path: a plain function
    if needs_critic and not args.use_critic:
        parser.error(f"--advantage-estimator {args.advantage_estimator} needs a value model: add --use-critic")
    if args.use_critic and not needs_critic:
        parser.error(
            f"--use-critic trains a value model that --advantage-estimator {args.advantage_estimator} does not use; "
            "drop --use-critic (or choose an estimator that needs a critic)"
        )
    if args.importance_ratio_level is None:
        args.importance_ratio_level = spec.ratio_level if spec is not None else "token"


def _check_reward_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The reward flags' values and how they combine (docs/rewards.md), before Ray starts."""
    try:
        if args.rm_weights is not None:
            parse_weights(args.rm_weights)  # its own message, not the settings' generic one
        settings = RewardSettings.from_args(args)
        if args.rm_weights is not None and args.custom_rm_path:
            raise ValueError("--rm-weights weighs the --rm-type rewards; --custom-rm-path replaces them: drop one")
        if settings.error_policy == "drop-group" and args.rollout_function_path != "sglang":
            raise ValueError(
                f"--reward-error drop-group is implemented by the sglang rollout function only, not by "
                f"--rollout-function-path {args.rollout_function_path}; use --reward-error zero"
            )
        check_remote_reward_options(args, remote="remote" in settings.rm_types and not args.custom_rm_path)
    except ValueError as exc:
        parser.error(str(exc))


def _check_eval_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse an evaluation that would do nothing, or data that would never be evaluated."""
    try:
        settings = EvalSettings.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    evaluates = args.eval_interval is not None or args.eval_only
    if evaluates and not settings.datasets and args.eval_function_path is None:
        option = "--eval-only" if args.eval_only else "--eval-interval"
        parser.error(f"{option} evaluates nothing without --eval-prompt-data NAME PATH [NAME PATH ...]")
    if settings.datasets and not evaluates:
        parser.error("--eval-prompt-data is never evaluated: add --eval-interval N (or --eval-only)")


def _option_owner(option: str, pm: pluggy.PluginManager) -> tuple[str, bool] | None:
    """The installed plugin, not loaded in `pm`, whose `slime_addoption` defines `option`, and whether it is blocked.

    Builds a manager with every installed entry point of group "slime" and gives each plugin missing from
    `pm` its own copy of the core parser, so that an option of an unloaded plugin can be named precisely.
    """
    try:
        every = build_plugin_manager(PluginSelection())
    except PluginError:
        return None
    for name, plugin in every.list_name_plugin():
        if pm.has_plugin(name) or getattr(plugin, "slime_addoption", None) is None:
            continue
        parser = build_parser()
        others = [p for p in every.get_plugins() if p is not plugin]
        every.subset_hook_caller("slime_addoption", remove_plugins=others).call_historic(kwargs={"parser": parser})
        if option in parser._option_string_actions:
            return name, pm.is_blocked(name)
    return None


def _refuse_unrecognized(parser: argparse.ArgumentParser, extras: Sequence[str], pm: pluggy.PluginManager) -> None:
    """Fail as argparse does on unrecognized arguments, naming the plugin an unknown flag belongs to."""
    for token in extras:
        option = token.split("=", 1)[0]
        if not option.startswith("-") or (owner := _option_owner(option, pm)) is None:
            continue
        name, blocked = owner
        fix = f"remove -p no:{name}" if blocked else f"add --plugin {name}"
        parser.error(f"{option} belongs to plugin {name!r}, which is not loaded ({fix})")
    known = [option for action in parser._actions for option in action.option_strings]
    hints = []
    for token in extras:
        option = token.split("=", 1)[0]
        close = difflib.get_close_matches(option, known, n=1, cutoff=0.8) if option.startswith("--") else []
        if close:
            hints.append(f"{option}: did you mean {close[0]}?")
    parser.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else ""))


def _explicit_options(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> frozenset[str]:
    """The destinations the user gave on the command line (so plugins only fill in the rest)."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(parser.parse_args(argv)))


def parse_args(argv: Sequence[str] | None = None, *, return_restore_plan: bool = False) -> Any:
    """Parse a run's command line with its plugins; optionally resolve the checkpoint to restore."""
    pre = argparse.ArgumentParser(add_help=False)
    add_plugin_arguments(pre)
    known, _ = pre.parse_known_args(argv)
    selection = PluginSelection.from_cli(known.plugins, disable_autoload=known.disable_plugin_autoload)
    pm = build_plugin_manager(selection)
    registry = collect_registry(pm)
    parser = build_parser(pm)
    defaults = named_plugin_defaults(pm, selection)
    for dest, (plugin, value) in defaults.items():
        logger.info("plugin %s sets default --%s=%r", plugin, dest.replace("_", "-"), value)
    parser.set_defaults(**{dest: value for dest, (_, value) in defaults.items()})
    args, extras = parser.parse_known_args(argv)
    if extras:
        _refuse_unrecognized(parser, extras, pm)
    args.explicit_options = _explicit_options(build_parser(pm), argv)
    args.plugin_selection = selection
    if args.rollout_data_transport not in registry.kinds["transports"]:
        available = ", ".join(sorted(registry.kinds["transports"]))
        parser.error(
            f"--rollout-data-transport {args.rollout_data_transport!r} is not provided by any plugin ({available})"
        )
    if args.data_source_path is None:
        args.data_source_path = registry.get("transports", args.rollout_data_transport).data_source
    if args.rollout_data_compression == "none":
        args.rollout_data_compression = None
    try:
        pm.hook.slime_configure(args=args)
    except ValueError as exc:  # the hook's contract: a user's bad input, naming the flag to fix
        parser.error(str(exc))
    _apply_num_steps_per_rollout(parser, args)
    _check_named_options(parser, args, registry)
    _check_advantage_estimator(parser, args, registry)
    _check_reward_options(parser, args)
    _check_eval_options(parser, args)
    try:
        check_deterministic_run(args, registry)
    except ValueError as exc:
        parser.error(str(exc))
    if args.rollout_router == "sglang-router" and not sglang_router_available():
        parser.error(
            '--rollout-router sglang-router needs the sglang-router package: pip install "slime-rl[router]" '
            "(or drop --rollout-router)"
        )
    if args.update_weight_transport == "disk" and args.update_weight_disk_dir is None and args.save:
        args.update_weight_disk_dir = str(Path(args.save).expanduser().resolve() / "weights")
    if not return_restore_plan:
        return args
    from slime.interfaces import run_transport

    return run_transport(args).resolve_restore()
