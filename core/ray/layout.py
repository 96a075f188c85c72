"""A run's layout on the Ray cluster: what its training ranks and rollout engines ask of the nodes, checked against
the nodes the cluster has before anything starts.

A run asks for:
- per training role (actor, critic) `--{role}-num-nodes` node bundles, each holding the ranks of one node: a GPU and a
  CPU per rank on a cluster with GPUs, `--train-num-cpus-per-rank` CPUs per rank without, plus `--train-resources`
  per rank. A role's node bundles go to distinct nodes (`slime.ray.placement_group` reserves them STRICT_SPREAD);
- `--rollout-num-engines` engines, each what its engine plugin declares (`RolloutEngineSpec.resources`) plus
  `--rollout-resources`. Engines go to any node with room.

Custom resources are how a user pins work to nodes: start a node with `ray start --resources '{"rollout_node": 4}'`
and run with `--rollout-resources rollout_node=1`. `fit_layout` places the bundles and engines on the nodes' total
resources (a backtracking search over the training bundles, first fit for engines) and raises `LayoutError` naming,
per node, what the first thing that does not fit lacks there. Ray itself would wait for resources that never come.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slime.errors import UsageError

logger = logging.getLogger(__name__)

__all__ = [
    "EngineDemand",
    "LayoutError",
    "Node",
    "NodeGroup",
    "alive_nodes",
    "check_engines_fit",
    "engine_actor_options",
    "fit_layout",
    "parse_resources",
    "resource_items",
]

#: Resources with their own flags (or Ray's own bookkeeping): not accepted in `--train-resources`/`--rollout-resources`.
BUILT_IN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
#: Backtracking steps `fit_layout` tries before giving up on an exact search (layouts are a few bundles).
MAX_SEARCH_STEPS = 100_000


class LayoutError(UsageError):
    """The run's layout does not fit on the cluster's nodes; the message names what is missing on each node."""


def parse_resources(text: str) -> dict[str, float]:
    """`NAME=AMOUNT[,NAME=AMOUNT...]` -> `{NAME: AMOUNT}` (argparse `type=` of `--train-resources` and
    `--rollout-resources`); ValueError on a malformed item, a non-positive amount or a built-in resource."""
    resources: dict[str, float] = {}
    for item in text.split(","):
        name, separator, amount = item.strip().partition("=")
        name = name.strip()
        if not separator or not name:
            raise ValueError(f"expected NAME=AMOUNT[,NAME=AMOUNT...], got {text!r}")
        if name in BUILT_IN_RESOURCES or name.startswith("node:"):
            raise ValueError(
                f"{name} is not a custom resource: CPUs and GPUs per rank or engine have their own flags "
                "(--train-num-cpus-per-rank, the engine plugin's options)"
            )
        try:
            value = float(amount)
        except ValueError as exc:
            raise ValueError(f"{name}: amount {amount.strip()!r} is not a number") from exc
        if not value > 0:
            raise ValueError(f"{name}: amount must be positive, got {amount.strip()}")
        resources[name] = value
    return resources


def resource_items(resources: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    """`{name: amount}` as sorted (name, amount) pairs: how settings objects hold `--*-resources` (hashable)."""
    return tuple(sorted((str(name), float(amount)) for name, amount in dict(resources).items()))


@dataclass(frozen=True)
class Node:
    """One alive node of the cluster and its total resources."""

    node_id: str
    address: str
    resources: Mapping[str, float]
    is_head: bool = False

    @property
    def label(self) -> str:
        return f"node {self.address} ({self.node_id[:8]}{', head' if self.is_head else ''})"


@dataclass(frozen=True)
class NodeGroup:
    """A training role's bundles: `num_nodes` of them, each `per_node` on a node of its own."""

    role: str
    num_nodes: int
    per_node: Mapping[str, float]


@dataclass(frozen=True)
class EngineDemand:
    """`num_engines` rollout engines, each asking for `per_engine`, on nodes of the machine at `machine` (None:
    anywhere).

    Engines listen on 127.0.0.1 (a server reachable from other machines would need a per-run API key that every
    client sends, which slime-rl does not have yet), so they must run on the rollout manager's machine, the driver's.
    """

    num_engines: int
    per_engine: Mapping[str, float]
    machine: str | None = None


def alive_nodes() -> list[Node]:
    """The cluster's alive nodes (Ray must be initialised)."""
    import ray

    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        resources = {str(key): float(value) for key, value in (node.get("Resources") or {}).items()}
        nodes.append(
            Node(
                node_id=str(node["NodeID"]),
                address=str(node.get("NodeManagerAddress", "?")),
                resources=resources,
                is_head="node:__internal_head__" in resources,
            )
        )
    return nodes


def _describe(resources: Mapping[str, float]) -> str:
    """`{CPU: 2, slime_rollout: 1}`: the resources a run can ask for (not memory or Ray's per-node markers)."""
    shown = {
        name: amount
        for name, amount in resources.items()
        if amount and name not in ("memory", "object_store_memory") and not name.startswith("node:")
    }
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in sorted(shown.items())) + "}" if shown else "{}"


def _fits(free: Mapping[str, float], demand: Mapping[str, float]) -> bool:
    return all(free.get(name, 0.0) + 1e-9 >= amount for name, amount in demand.items() if amount)


def _take(free: dict[str, float], demand: Mapping[str, float], sign: float = 1.0) -> None:
    for name, amount in demand.items():
        free[name] = free.get(name, 0.0) - sign * amount


def _lacks(free: Mapping[str, float], demand: Mapping[str, float]) -> str:
    missing = [
        f"{name} {amount:g} (has {free.get(name, 0.0):g})"
        for name, amount in sorted(demand.items())
        if amount and free.get(name, 0.0) + 1e-9 < amount
    ]
    return ", ".join(missing)


def _place_groups(
    nodes: Sequence[Node], groups: Sequence[NodeGroup], free: list[dict[str, float]]
) -> list[list[int]] | None:
    """Node indices for every group's bundles (a role's on distinct nodes), taking them from `free`; None if no
    assignment exists (or the search ran out of steps)."""
    bundles = [(g, group) for g, group in enumerate(groups) for _ in range(group.num_nodes)]
    chosen: list[int] = []
    steps = 0

    def search(position: int) -> bool:
        nonlocal steps
        if position == len(bundles):
            return True
        g, group = bundles[position]
        used = {chosen[i] for i in range(position) if bundles[i][0] == g}
        for index in range(len(nodes)):
            steps += 1
            if steps > MAX_SEARCH_STEPS:
                return False
            if index in used or not _fits(free[index], group.per_node):
                continue
            _take(free[index], group.per_node)
            chosen.append(index)
            if search(position + 1):
                return True
            chosen.pop()
            _take(free[index], group.per_node, sign=-1.0)
        return False

    if not search(0):
        return None
    placement: list[list[int]] = [[] for _ in groups]
    for (g, _), index in zip(bundles, chosen, strict=True):
        placement[g].append(index)
    return placement


def _role_flags(role: str) -> str:
    """The flags that size a training role: `--actor-num-nodes/--actor-num-gpus-per-node`."""
    return f"--{role}-num-nodes/--{role}-num-gpus-per-node"


def _node_line(node: Node, left: Mapping[str, float], demand: Mapping[str, float]) -> str:
    lacks = _lacks(left, demand)
    return f"  {node.label}: {'lacks ' + lacks if lacks else 'has room'}; total {_describe(node.resources)}"


def _nodes_report(nodes: Sequence[Node], free: Sequence[Mapping[str, float]], demand: Mapping[str, float]) -> str:
    return "\n".join(_node_line(node, left, demand) for node, left in zip(nodes, free, strict=True))


def fit_layout(nodes: Sequence[Node], groups: Sequence[NodeGroup], engines: EngineDemand | None) -> dict[str, Any]:
    """Place `groups` and `engines` on `nodes`; returns `{role: [node ids], "engines": [node ids]}` or raises
    `LayoutError` naming what the first bundle or engine that does not fit lacks on each node."""
    if not nodes:
        raise LayoutError("the Ray cluster has no alive node")
    free = [dict(node.resources) for node in nodes]
    placement = _place_groups(nodes, groups, free)
    if placement is None:
        # Name the first role that cannot be placed beside the ones before it (placed as the search places them).
        free = [dict(node.resources) for node in nodes]
        for position, group in enumerate(groups):
            if _place_groups(nodes, [group], free) is None:
                raise LayoutError(
                    f"the cluster cannot hold this run's layout: the {group.role} needs {group.num_nodes} distinct "
                    f"node(s) with {_describe(group.per_node)} each"
                    + (f" beside the {', '.join(g.role for g in groups[:position])}" if position else "")
                    + f"; the cluster's {len(nodes)} node(s):\n{_nodes_report(nodes, free, group.per_node)}\n"
                    f"add nodes with these resources, or lower {_role_flags(group.role)}, --train-num-cpus-per-rank "
                    "or --train-resources"
                )
        raise LayoutError(
            f"no placement of the training ranks was found within {MAX_SEARCH_STEPS} steps: "
            + "; ".join(f"{g.role}: {g.num_nodes} node(s) x {_describe(g.per_node)}" for g in groups)
        )
    layout: dict[str, Any] = {
        group.role: [nodes[index].node_id for index in indices]
        for group, indices in zip(groups, placement, strict=True)
    }
    if engines is not None:
        layout["engines"] = _place_engines(nodes, engines, free, bool(groups))
    return layout


def _place_engines(nodes: Sequence[Node], engines: EngineDemand, free: list[dict[str, float]], after: bool) -> list:
    placed = []
    usable = [engines.machine is None or node.address == engines.machine for node in nodes]
    for number in range(engines.num_engines):
        index = next((i for i in range(len(nodes)) if usable[i] and _fits(free[i], engines.per_engine)), None)
        if index is None:
            elsewhere = f"on another machine than the rollout manager's ({engines.machine})"
            report = "\n".join(
                _node_line(node, left, engines.per_engine) if fits else f"  {node.label}: {elsewhere}"
                for node, left, fits in zip(nodes, free, usable, strict=True)
            )
            raise LayoutError(
                f"the cluster cannot hold this run's layout: {engines.num_engines} rollout engine(s) need "
                f"{_describe(engines.per_engine)} each and {number} fit"
                + (" beside the training ranks" if after else "")
                + f"; engine {number + 1} does not:\n{report}\n"
                "add nodes with these resources, or lower --rollout-num-engines or --rollout-resources"
                + ("; engines listen on 127.0.0.1, so they run on the driver's machine only" if not all(usable) else "")
            )
        _take(free[index], engines.per_engine)
        placed.append(nodes[index].node_id)
    return placed


def engine_actor_options(args: Any, per_engine: Mapping[str, float]) -> dict[str, Any]:
    """Ray actor options for one engine asking for `per_engine` (its plugin's CPU/GPU) plus the run's
    `--rollout-resources`, on this process's machine (Ray's `node:<address>` marker; see `EngineDemand`): what engine
    launchers pass to `.options(...)` from the rollout manager, so engines land where `fit_layout` found room."""
    from slime.ray.settings import ServingSettings

    custom = dict(ServingSettings.from_args(args).rollout_resources)
    custom[f"node:{this_machine()}"] = MACHINE_MARKER_AMOUNT
    return {
        "num_cpus": float(per_engine.get("CPU", 0.0)),
        "num_gpus": float(per_engine.get("GPU", 0.0)),
        "resources": custom,
    }


#: How much of a node's `node:<address>` marker (1.0 per node) an engine asks for: any amount pins it to the machine.
MACHINE_MARKER_AMOUNT = 0.001


def this_machine() -> str:
    """The address of the Ray node this process runs on (Ray must be initialised)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    return next(str(node["NodeManagerAddress"]) for node in ray.nodes() if node["NodeID"] == here)


def engine_demand(args: Any, num_engines: int) -> EngineDemand:
    """What `num_engines` engines of `--rollout-engine` ask for: its spec's `resources(args)` plus
    `--rollout-resources`, on this process's machine (call it on the driver's node: the driver or the rollout
    manager)."""
    from slime.plugin_manager import registry_for
    from slime.ray.settings import ServingSettings

    spec = registry_for(args).get("rollout_engines", ServingSettings.from_args(args).engine)
    declared = dict(spec.resources(args)) if spec.resources is not None else {}
    per_engine = {key: float(amount) for key, amount in declared.items() if amount}
    for key, amount in ServingSettings.from_args(args).rollout_resources:
        per_engine[key] = per_engine.get(key, 0.0) + amount
    return EngineDemand(num_engines, per_engine, machine=this_machine())


def check_engines_fit(args: Any, num_engines: int) -> None:
    """Raise `LayoutError` when `num_engines` engines could not fit on the cluster's alive nodes even if those were
    empty: a relaunch after a node was lost must not wait for resources that left with it."""
    fit_layout(alive_nodes(), [], engine_demand(args, num_engines))
