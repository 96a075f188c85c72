"""Placing a run on the Ray cluster: the layout check, placement groups, the rollout manager and the training groups.

`create_placement_groups(args)` first checks the run's whole layout (training ranks and rollout engines) against
the cluster's nodes (`slime.ray.layout.fit_layout`): a layout that cannot fit is refused before anything starts,
naming what each node lacks. It then reserves one placement group per training role (actor, then critic) with one
bundle per node of the role, holding that node's ranks (`--actor-num-gpus-per-node` of them): a GPU and a CPU per
rank when the cluster has GPUs, `--train-num-cpus-per-rank` CPUs (default 1) when it has none (so the same command
runs on a laptop), plus `--train-resources`. A role on several nodes is reserved STRICT_SPREAD (one bundle per
node). The rollout placement is the actor's (engines are placed by their plugin's launcher, where
`--rollout-resources` sends them). The result maps role -> `Placement`.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from slime.backend_interfaces import check_run_backends
from slime.data.checkpoint import critic_arguments
from slime.ray.actor_group import Placement, RayTrainGroup
from slime.ray.layout import NodeGroup, alive_nodes, engine_demand, fit_layout
from slime.ray.settings import ClusterSettings, DriverSettings, ManagerSettings, ServingSettings

logger = logging.getLogger(__name__)

#: Seconds to wait for the cluster to grant a placement group before reporting what is missing.
PLACEMENT_TIMEOUT_S = 300.0


def create_placement_groups(args: Any) -> dict[str, Placement]:
    """Check the run's layout and reserve its training bundles; returns `{"actor": ..., "rollout": ...}` placements,
    and "critic" with `--use-critic`.

    The run's first step on the cluster: it first checks that `--train-backend`'s rank class and
    `--rollout-engine`'s launcher keep their contracts (`slime.backend_interfaces`), so a broken plugin is
    refused, naming itself and what it lacks, before any actor starts; then that the layout fits
    (`slime.ray.layout.LayoutError` otherwise).
    """
    check_run_backends(args)
    settings = ClusterSettings.from_args(args)
    use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    rank = settings.rank_resources(use_gpu)
    roles = [("actor", settings.actor_num_nodes, settings.actor_num_gpus_per_node)]
    if settings.use_critic:
        roles.append(("critic", settings.critic_num_nodes, settings.critic_num_gpus_per_node))
    groups = [
        NodeGroup(role, nodes, {key: amount * per_node for key, amount in rank.items()})
        for role, nodes, per_node in roles
    ]
    engines = None
    if not ManagerSettings.from_args(args).debug_train_only:
        engines = engine_demand(args, ServingSettings.from_args(args).num_engines)
    layout = fit_layout(alive_nodes(), groups, engines)
    logger.info(
        "layout fits the cluster: %s",
        "; ".join(
            f"{role} -> node(s) {', '.join(sorted({node[:8] for node in nodes}))}" for role, nodes in layout.items()
        ),
    )
    placements: dict[str, Placement] = {}
    for group, (role, num_nodes, per_node) in zip(groups, roles, strict=True):
        placements[role] = _reserve(role, [dict(group.per_node) for _ in range(num_nodes)], per_node, rank)
    placements["rollout"] = placements["actor"]
    return placements


def _reserve(role: str, bundles: list[dict[str, float]], ranks_per_node: int, rank: dict[str, float]) -> Placement:
    """A placement group of `bundles` (one per node) for `role`, each rank mapped to its node's bundle."""
    from ray.util.placement_group import placement_group

    strategy = "STRICT_SPREAD" if len(bundles) > 1 else "PACK"
    pg = placement_group(bundles, strategy=strategy, name=f"slime-{role}")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(
            f"Ray could not reserve the {role}'s {len(bundles)} bundle(s) of {bundles[0]} ({strategy}) within "
            f"{PLACEMENT_TIMEOUT_S:g}s although the cluster's nodes can hold them: other jobs hold the resources "
            f"(`ray status` shows them)"
        )
    indices = [node for node in range(len(bundles)) for _ in range(ranks_per_node)]
    logger.info("placement: %s %d rank(s) in %d node bundle(s)", role, len(indices), len(bundles))
    return Placement(pg, indices, rank.get("GPU", 0.0), rank["CPU"])


def create_rollout_manager(args: Any, pg: Placement | None, restore_plan: Any = None) -> tuple[Any, int | None]:
    """Start the `RolloutManager` actor; returns it and the number of rollouts per epoch (None if unknown).

    With `--num-epoch` instead of `--num-rollout`, the manager's data source says how many rollout steps
    one epoch is, and `args.num_rollout` is set from it.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from slime.ray.rollout import RolloutManager

    driver = DriverSettings.from_args(args)
    # On the driver's node: losing another node then loses only the engines and ranks it held.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    manager = RolloutManager.options(num_cpus=0, num_gpus=0, scheduling_strategy=here).remote(
        args, pg, restore_plan=restore_plan
    )
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
            critic_arguments(args),
            settings.critic_num_nodes,
            settings.critic_num_gpus_per_node,
            pg=pgs["critic"],
            num_gpus_per_actor=pgs["critic"].num_gpus_per_bundle,
            role="critic",
        )
    # The ranks start and load their model while the rollout manager is still starting the engines.
    for group in (actor, critic):
        if group is not None:
            group.start_init()
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
