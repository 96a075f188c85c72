"""The Megatron training backend: `--train-backend megatron` trains with megatron-core, on GPUs or on CPU.

Built in (entry point `megatron_backend`) and imported whenever the plugin registry is built, so this module and
`actor` import nothing of Megatron: megatron-core (`pip install 'slime-rl[megatron]'`, pinned to the version the
CPU compatibility layer was written against) is imported only by ranks of a run that selects the backend, and
by `slime_configure` to check it is installed before Ray starts.

- `actor.MegatronTrainRayActor`: one rank; tensor (`--tensor-model-parallel-size`), pipeline
  (`--pipeline-model-parallel-size`) and data parallel over NCCL on GPUs or gloo on CPU.
- `model`: the parallel state, Megatron's GPTModel for a Hugging Face config, the optimizer.
- `convert`: Hugging Face <-> Megatron weights for the Qwen2, Qwen3 and Llama families, TP/PP-aware.
- `vocab_parallel`: per-token log-probs and entropy over a vocabulary split across tensor-parallel ranks.
- `checkpoint`: `dist_checkpointing` saves inside the joint commit, and resumes from them.
- `cpu_compat`: what megatron-core needs to run without a GPU (applied only then).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slime import hookimpl
from slime.plugins.megatron_backend.actor import MegatronTrainRayActor
from slime.plugins.megatron_backend.settings import (
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    MegatronSettings,
    check_cpu_support,
    check_model,
    check_model_support,
)
from slime.specs import TrainBackendSpec

BACKEND_NAME = "megatron"


@hookimpl
def slime_train_backends() -> Iterable[TrainBackendSpec]:
    return [
        TrainBackendSpec(
            BACKEND_NAME,
            MegatronTrainRayActor,
            "megatron-core GPTModel (Qwen2, Qwen3, Llama from --hf-checkpoint): tensor, pipeline and data parallel "
            "over NCCL or, without a GPU, gloo; needs pip install 'slime-rl[megatron]'",
        )
    ]


@hookimpl(trylast=True)
def slime_configure(args: Any) -> None:
    """With `--train-backend megatron`: check megatron-core, the layout against the ranks and the model, and refuse
    what this machine cannot run, before Ray starts (after the demo and other plugins have set their defaults)."""
    if getattr(args, "train_backend", None) != BACKEND_NAME:
        return
    import torch

    from slime.plugins.megatron_backend.cpu_compat import check_megatron_core
    from slime.ray.settings import ClusterSettings

    if getattr(args, "use_critic", False):
        raise ValueError(
            "--use-critic: the megatron backend trains the policy only; PPO's value model needs --train-backend torch"
        )
    settings = MegatronSettings.from_args(args)
    check_model_support(settings)
    if not torch.cuda.is_available():
        check_cpu_support(settings)
    try:
        check_megatron_core()
    except RuntimeError as exc:  # the user's environment to fix: reported like a bad flag
        raise ValueError(str(exc)) from exc
    cluster = ClusterSettings.from_args(args)
    settings.data_parallel_size(cluster.actor_num_nodes * cluster.actor_num_gpus_per_node)
    if settings.train.hf_checkpoint and (Path(settings.train.hf_checkpoint) / "config.json").is_file():
        check_model(settings.train.hf_checkpoint, settings)


@hookimpl
def slime_addoption(parser: Any) -> None:
    group = parser.add_argument_group(
        "megatron backend",
        "--train-backend megatron: megatron-core's parallel layout and memory options. Ranks are "
        "--actor-num-nodes x --actor-num-gpus-per-node; data parallel = ranks / (tensor x pipeline x context).",
    )
    group.add_argument("--tensor-model-parallel-size", type=int, default=1, help="ranks that split each layer")
    group.add_argument(
        "--pipeline-model-parallel-size", type=int, default=1, help="ranks that split the layers into stages (1F1B)"
    )
    group.add_argument("--context-parallel-size", type=int, default=1, help="ranks that split each sequence (GPU only)")
    group.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="ranks that split the experts of MoE layers (the supported families are dense: 1)",
    )
    group.add_argument(
        "--sequence-parallel", action="store_true", help="split activations along the sequence in TP (GPU only)"
    )
    group.add_argument(
        "--recompute-granularity",
        choices=RECOMPUTE_GRANULARITIES,
        default=None,
        help="recompute activations in the backward pass instead of keeping them: whole layers or attention only",
    )
    group.add_argument(
        "--recompute-method",
        choices=RECOMPUTE_METHODS,
        default=None,
        help="with --recompute-granularity full: recompute groups of layers (uniform) or the first N layers (block)",
    )
    group.add_argument(
        "--recompute-num-layers", type=int, default=None, help="layers per group (uniform) or recomputed (block)"
    )
    group.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="shard the optimizer state and fp32 master weights across data-parallel ranks",
    )
