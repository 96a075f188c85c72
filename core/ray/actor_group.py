"""`RayTrainGroup`: the data-parallel ranks of one training role (actor or critic) as Ray actors.

The group is the driver's handle on a role: it creates the ranks (`create`), fans calls out to all of them
(`async_train`, `save_model`, `update_weights`) and waits for them. Ranks are instances of the training
backend's actor class (registry kind "train_backends", `--train-backend`, default "torch"; its contract is
`slime.backend_interfaces.TrainBackend`), wrapped with `ray.remote` here, one per placement-group bundle.

Weight updates are counted by the group, not by the ranks, from `update_weight_start_version`: every rank gets
the update's `slime.weight_sync.WeightUpdate` (`TrainBackend.update_weights(update)`), so the version never
depends on what the ranks return. With `--update-weight-transport disk` the ranks export version `v` to
`<update_weight_disk_dir>/weight_v{v:06d}` and the rollout manager has the engines load it; with "distributed"
or "tensor" the manager first pauses the engines and names the live ones (`prepare_weight_update`), the rank
holding the full weights sends them (`slime.weight_sync.send_weights`), and the manager checks that every
engine serves `v` and lets them generate again (`finish_weight_update`). A group made without a rollout
manager (tools, tests) has no engines: its ranks get updates with no engine URLs.

With `--release-train` the ranks are killed after every weight export and re-created (`create`) for the
next step from the checkpoint the last `save_model` wrote.

Constructing a group touches neither Ray nor GPUs; `spawn` (start the rank processes) and `create` do.
"""

from __future__ import annotations

import logging
import random
import shutil
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import ray

from slime.backend_interfaces import weight_dir
from slime.ray.settings import TrainGroupSettings
from slime.storage_errors import with_context
from slime.weight_sync import WeightUpdate

logger = logging.getLogger(__name__)

#: Seconds to wait after killing ranks so that their processes release devices and ports.
RELEASE_GRACE_S = 1.0


class Placement(NamedTuple):
    """Where a role's ranks run: a Ray placement group, one bundle index per rank, devices per bundle."""

    placement_group: Any
    bundle_indices: Sequence[int]
    num_gpus_per_bundle: float = 0.0
    num_cpus_per_bundle: float = 1.0


class RayTrainGroup:
    """The ranks of one training role; see the module docstring."""

    def __init__(
        self,
        args: Any,
        num_nodes: int,
        num_gpus_per_node: int,
        pg: Placement | None,
        num_gpus_per_actor: float = 1,
        role: str = "actor",
        with_ref: bool = False,
        with_opd_teacher: bool = False,
        actor_cls: Any = None,
    ) -> None:
        self.args = args
        self.settings = TrainGroupSettings.from_args(args)
        self.role = role
        self.with_ref = with_ref
        self.with_opd_teacher = with_opd_teacher
        self._num_nodes = int(num_nodes)
        self._num_gpus_per_node = int(num_gpus_per_node)
        self._pg = pg
        self._num_gpus_per_actor = num_gpus_per_actor
        self._actor_cls = actor_cls
        self._rollout_manager: Any = None
        self._weight_version = self.settings.update_weight_start_version
        self._actor_handlers: list[Any] = []
        self._awaiting_init = False
        self._pending_init: list[Any] | None = None

    @property
    def world_size(self) -> int:
        return self._num_nodes * self._num_gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        """Into how many shards each step's data is split (`slime.backend_interfaces.data_parallel_size`)."""
        from slime.backend_interfaces import data_parallel_size

        return data_parallel_size(self._backend_class(), self.args, self.world_size)

    # ---------------------------------------------------------------- lifecycle

    def spawn(self) -> None:
        """Create the ranks' Ray actors without waiting for them or initializing them.

        Their processes start and import the training backend (seconds of CPU each: torch, transformers) in the
        background; see `start_init` for starting their initialization too. Does nothing once ranks exist.
        """
        if not self._actor_handlers:
            self.args.update_weight_start_version = self._weight_version
            self._allocate_gpus_for_actor(self._pg, self._num_gpus_per_actor)
            self._awaiting_init = True

    def start_init(self) -> None:
        """Spawn the ranks (unless `spawn` did) and start their `init` without waiting for it.

        A rank's `init` (load the model and optimizer, restore a checkpoint) needs neither the engines nor the
        rollout manager, so a driver that starts it before it waits for the engines overlaps the two; `create`
        then registers the ranks with the rollout manager and waits for the `init` started here. Does nothing
        once an `init` is under way or done.
        """
        self.spawn()
        if self._awaiting_init and self._pending_init is None:
            self._pending_init = [
                actor.init.remote(self.args, self.role, with_ref=self.with_ref, with_opd_teacher=self.with_opd_teacher)
                for actor in self._actor_handlers
            ]

    def create(self, rollout_manager: Any = None) -> list[int] | None:
        """Start the ranks and their `init` (unless `spawn`/`start_init` did), register them with the rollout
        manager and wait for `init`; returns each rank's first rollout id (None if they were already initialized).

        Ranks whose `init` was not started yet are registered first, so that they start with the rollout
        manager's configuration (the weight version, the engines' URLs) in their arguments.
        """
        if rollout_manager is not None:
            self._rollout_manager = rollout_manager
        if self._actor_handlers and not self._awaiting_init:
            return None
        self.spawn()
        started = self._pending_init is not None
        if not started:
            self._register_with_rollout_manager()
            self.start_init()
        pending, self._pending_init = self._pending_init, None
        self._awaiting_init = False
        if started:
            self._register_with_rollout_manager()
        return ray.get(pending)

    def release(self) -> None:
        """Kill the ranks (`--release-train`); the next `create` starts fresh ones."""
        handlers, self._actor_handlers = self._actor_handlers, []
        for actor in handlers:
            ray.kill(actor, no_restart=True)
        if handlers:
            time.sleep(RELEASE_GRACE_S)

    def _backend_class(self) -> Any:
        """The rank class: `actor_cls` when given, else `--train-backend`'s, checked against `TrainBackend`."""
        if self._actor_cls is not None:
            return self._actor_cls
        from slime.backend_interfaces import resolve_train_backend

        return resolve_train_backend(self.args)

    def _allocate_gpus_for_actor(self, pg: Placement | None, num_gpus_per_actor: float) -> None:
        """Create one rank per bundle of `pg`, with the distributed environment each rank needs."""
        if pg is None:
            raise ValueError(f"RayTrainGroup({self.role!r}) needs a placement (create_placement_groups) to start ranks")
        world_size = self.world_size
        if len(pg.bundle_indices) < world_size:
            raise ValueError(
                f"{self.role} needs {world_size} bundles ({self._num_nodes} nodes x {self._num_gpus_per_node}), "
                f"its placement has {len(pg.bundle_indices)}"
            )
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = self._backend_class()
        remote_cls = cls if isinstance(cls, ray.actor.ActorClass) else ray.remote(cls)
        master_addr, master_port = _master_address(pg.placement_group, pg.bundle_indices[0])
        for rank in range(world_size):
            env = {
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                # Ray exposes only the actor's own GPU, so on GPU each rank's local device is 0.
                "LOCAL_RANK": "0" if num_gpus_per_actor else str(rank % self._num_gpus_per_node),
            }
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pg.placement_group, placement_group_bundle_index=pg.bundle_indices[rank]
            )
            handle = remote_cls.options(
                num_cpus=pg.num_cpus_per_bundle,
                num_gpus=num_gpus_per_actor,
                runtime_env={"env_vars": env},
                scheduling_strategy=strategy,
            ).remote()
            self._actor_handlers.append(handle)

    def _register_with_rollout_manager(self) -> None:
        """Tell the rollout manager about the new ranks and adopt the configuration it returns.

        The returned weight version only moves forward: engines may already serve a newer one than this group
        counted.
        """
        manager = self._rollout_manager
        if manager is None:
            return
        config = ray.get(manager.register_training_actors.remote(self.role, self._actor_handlers))
        if not config:
            return
        for key, value in dict(config).items():
            if key == "update_weight_start_version":
                value = max(int(value or 0), self._weight_version)
                self._weight_version = value
            setattr(self.args, key, value)

    # ----------------------------------------------------------------- training

    def async_train(self, rollout_id: int, rollout_data_ref: Any, external_data: Any = None) -> list[Any]:
        """Start one training step on every rank; returns the ranks' object refs (for `ray.get`)."""
        kwargs = {} if external_data is None else {"external_data": external_data}
        return [actor.train.remote(rollout_id, rollout_data_ref, **kwargs) for actor in self._actor_handlers]

    def save_model(self, rollout_id: int, force_sync: bool = False) -> None:
        """Save every rank's part of step `rollout_id`; returns once all of them have."""
        ray.get([actor.save_model.remote(rollout_id, force_sync=force_sync) for actor in self._actor_handlers])
        if self.settings.release_train:
            # The next `create` must resume from exactly what was just saved.
            self.args.load = self.settings.save
            self.args.ckpt_step = None
            self.args.no_load_optim = self.settings.no_save_optim
            self.args.no_load_rng = False

    # ------------------------------------------------------------ weight update

    def update_weights(self) -> None:
        """Push the current weights to the rollout engines as the next version (see the module docstring)."""
        if self.role != "actor":
            raise ValueError(f"only the actor's weights go to the rollout engines, not the {self.role}'s")
        settings = self.settings
        version = self._weight_version + 1
        if settings.disk_weights:
            self._update_weights_through_disk(version)
            return
        manager = self._rollout_manager
        urls = ray.get(manager.prepare_weight_update.remote()) if manager is not None else []
        update = WeightUpdate(
            version=version,
            transport=settings.update_weight_transport,
            engine_urls=tuple(urls),
            bucket_bytes=settings.update_weight_buffer_size,
            timeout_s=settings.http_timeout_s,
        )
        ray.get([actor.update_weights.remote(update) for actor in self._actor_handlers])
        self._weight_version = version
        if manager is not None:
            ray.get(manager.finish_weight_update.remote(version))
        if settings.release_train:
            self.release()

    def _update_weights_through_disk(self, version: int) -> None:
        """The ranks export `version`; the rollout manager has the engines load it; the export is removed."""
        disk_dir = self.settings.update_weight_disk_dir
        if not disk_dir:
            raise ValueError(
                "--update-weight-transport disk needs --update-weight-disk-dir (a directory trainers and engines share)"
            )
        directory = weight_dir(disk_dir, version)
        update = WeightUpdate(version=version, transport="disk", disk_dir=str(directory))
        ray.get([actor.update_weights.remote(update) for actor in self._actor_handlers])
        self._weight_version = version
        if self.settings.release_train:
            self.release()
        self._reload_rollout_weights_from_disk(directory, str(version))

    def _reload_rollout_weights_from_disk(self, directory: Path, version: str) -> None:
        """Have the rollout engines load `directory` as weight `version`, then drop the export."""
        if self._rollout_manager is None:
            raise RuntimeError(
                "disk weight updates need the rollout manager: create the group with create(rollout_manager)"
            )
        ray.get(self._rollout_manager.update_weights_from_disk.remote(str(directory), version))
        if not self.settings.update_weight_disk_keep_files:
            try:
                shutil.rmtree(directory)
            except OSError as exc:  # rmtree names the file relative to the directory: name the directory
                storage_error = with_context(exc, directory, "handing the new weights to the engines", probe=False)
                if storage_error is None:
                    raise
                raise storage_error from exc


def _master_address(placement_group: Any, bundle_index: int) -> tuple[str, int]:
    """Address and port for the ranks' process group: the node that hosts the first bundle."""
    node_id = ray.util.placement_group_table(placement_group)["bundles_to_node_id"][bundle_index]
    driver_node = ray.get_runtime_context().get_node_id()
    address = next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == node_id)
    if node_id == driver_node:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return address, sock.getsockname()[1]
    # Another node: no way to probe its ports from here; pick one from a range ephemeral ports avoid.
    return address, random.randint(20000, 30000)
