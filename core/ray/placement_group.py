"""Placing a run on the Ray cluster: placement groups, the rollout manager and the training groups.

`create_placement_groups(args)` reserves one bundle per training rank (actor, then critic); the rollout
placement is the actor's (engines are placed by their plugin's launcher). A bundle is one GPU plus one CPU
when the cluster has GPUs, and `--train-num-cpus-per-rank` CPUs (default 1) when it has none, so the same
command runs on a laptop. The result maps role -> `Placement`.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from slime.backend_interfaces import check_run_backends
from slime.ray.actor_group import Placement, RayTrainGroup
from slime.ray.settings import ClusterSettings, DriverSettings

logger = logging.getLogger(__name__)

#: Seconds to wait for the cluster to grant a placement group before reporting what is missing.
PLACEMENT_TIMEOUT_S = 300.0


def create_placement_groups(args: Any) -> dict[str, Placement]:
    """Reserve the bundles of a run; returns `{"actor": ..., "critic": ..., "rollout": ...}` placements.

    The run's first step on the cluster: it first checks that `--train-backend`'s rank class and
    `--rollout-engine`'s launcher keep their contracts (`slime.backend_interfaces`), so a broken plugin is
    refused, naming itself and what it lacks, before any actor starts.
    """
    from ray.util.placement_group import placement_group

    check_run_backends(args)
    settings = ClusterSettings.from_args(args)
    resources = ray.cluster_resources()
    use_gpu = resources.get("GPU", 0) > 0
    actor_ranks = settings.actor_ranks
    train_ranks = actor_ranks + settings.critic_ranks
    if use_gpu:
        bundles = [{"GPU": 1, "CPU": 1} for _ in range(train_ranks)]
        gpus, cpus = 1.0, 1.0
    else:
        cpus = settings.train_num_cpus_per_rank
        available = resources.get("CPU", 0)
        if train_ranks * cpus > available:
            raise ValueError(
                f"{train_ranks} training ranks x {cpus:g} CPUs exceed the cluster's {available:g} CPUs; lower "
                "--actor-num-gpus-per-node (ranks per node on CPU) or --train-num-cpus-per-rank"
            )
        bundles = [{"CPU": cpus} for _ in range(train_ranks)]
        gpus = 0.0
    pg = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(
            f"Ray could not reserve {len(bundles)} bundles of {bundles[0]} within {PLACEMENT_TIMEOUT_S:g}s "
            f"(cluster: {resources}); reduce the number of ranks or add nodes"
        )
    actor = list(range(actor_ranks))
    critic = list(range(actor_ranks, train_ranks))
    logger.info("placement: %d actor, %d critic bundles (GPU: %s)", len(actor), len(critic), use_gpu)
    return {
        "actor": Placement(pg, actor, gpus, cpus),
        "critic": Placement(pg, critic, gpus, cpus),
        "rollout": Placement(pg, actor, gpus, cpus),
    }


def create_rollout_manager(args: Any, pg: Placement | None, restore_plan: Any = None) -> tuple[Any, int | None]:
    """Start the `RolloutManager` actor; returns it and the number of rollouts per epoch (None if unknown).

    With `--num-epoch` instead of `--num-rollout`, the manager's data source says how many rollout steps
    one epoch is, and `args.num_rollout` is set from it.
    """
    from slime.ray.rollout import RolloutManager

    driver = DriverSettings.from_args(args)
    manager = RolloutManager.options(num_cpus=0, num_gpus=0).remote(args, pg, restore_plan=restore_plan)
    num_rollout_per_epoch = None
    if driver.num_rollout is None and driver.num_epoch is not None:
        num_rollout_per_epoch = int(ray.get(manager.get_num_rollout_per_epoch.remote()))
        num_rollout = num_rollout_per_epoch * driver.num_epoch
        args.num_rollout = num_rollout
        logger.info(
            "%d epochs x %d rollouts per epoch = %d rollouts", driver.num_epoch, num_rollout_per_epoch, num_rollout
        )
    return manager, num_rollout_per_epoch


def create_training_models(
    args: Any, pgs: dict[str, Placement], rollout_manager: Any
) -> tuple[RayTrainGroup, RayTrainGroup | None]:
    """Create and initialize the actor (and, with `--use-critic`, critic) groups; sets `args.start_rollout_id`.

    Every rank reports the first rollout id it will train (the step after the checkpoint it loaded); they
    must agree. When resuming (start > 0) the rollout manager restores its data source and batch builder
    to the state saved with step `start - 1`.
    """
    settings = ClusterSettings.from_args(args)
    actor = RayTrainGroup(
        args,
        settings.actor_num_nodes,
        settings.actor_num_gpus_per_node,
        pg=pgs["actor"],
        num_gpus_per_actor=pgs["actor"].num_gpus_per_bundle,
        role="actor",
        with_ref=settings.with_ref,
    )
    critic = None
    if settings.use_critic:
        critic = RayTrainGroup(
            args,
            settings.critic_num_nodes,
            settings.critic_num_gpus_per_node,
            pg=pgs["critic"],
            num_gpus_per_actor=pgs["critic"].num_gpus_per_bundle,
            role="critic",
        )
    # The ranks' processes start while the rollout manager is still starting the engines.
    for group in (actor, critic):
        if group is not None:
            group.spawn()
    ray.get(rollout_manager.set_train_parallel_config.remote({"dp_size": actor.data_parallel_size}))
    start_ids = list(actor.create(rollout_manager) or [])
    if critic is not None:
        start_ids += list(critic.create(rollout_manager) or [])
    if len(set(start_ids)) != 1:
        raise RuntimeError(f"training ranks resume from different rollout ids {sorted(set(start_ids))}; check --load")
    start = start_ids[0]
    if settings.start_rollout_id is None:
        args.start_rollout_id = start
    elif settings.start_rollout_id != start:
        raise ValueError(
            f"The run starts at step {settings.start_rollout_id} but the trainers loaded a checkpoint whose next step "
            f"is {start}; check --load and --ckpt-step"
        )
    if start > 0:
        ray.get(rollout_manager.load.remote(start - 1))
    return actor, critic
