"""RayTrainGroup: weight-version arithmetic, disk reloads, release mode, rank creation on a CPU Ray cluster."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from fakes import fake_actor_handle

from slime.backend_interfaces import TrainBackend
from slime.ray import actor_group
from slime.ray.actor_group import Placement, RayTrainGroup
from slime.ray.rollout import RolloutManager
from slime.weight_sync import WeightUpdate


def _rank(log: list, args, rank: int = 0):
    """One training rank's handle whose `update_weights` writes the export directory as a real backend does."""

    def export(update: WeightUpdate):
        if rank == 0 and update.transport == "disk":
            target = Path(update.disk_dir)
            target.mkdir(parents=True)
            (target / "model.safetensors").write_bytes(b"w")

    return fake_actor_handle(TrainBackend, log, "rank", update_weights=export, init=5, train={"loss": 1.0})


ENGINES = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def _manager(log: list, seen_dirs: list):
    """The rollout manager's handle; `update_weights_from_disk` notes whether the export is still there."""

    def update_weights_from_disk(path, version):
        seen_dirs.append(Path(path).is_dir())

    return fake_actor_handle(
        RolloutManager,
        log,
        "manager",
        update_weights_from_disk=update_weights_from_disk,
        prepare_weight_update=list(ENGINES),
    )


def _args(tmp_path, **overrides):
    values = dict(
        update_weight_start_version=3,
        update_weight_mode="full",
        update_weight_transport="disk",
        update_weight_disk_dir=str(tmp_path / "weights"),
        release_train=False,
        save=str(tmp_path / "ckpt"),
        no_save_optim=True,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setattr(actor_group.ray, "get", lambda value: value)
    monkeypatch.setattr(actor_group.ray, "kill", lambda actor, no_restart=True: None)
    monkeypatch.setattr(actor_group, "RELEASE_GRACE_S", 0.0)


def _group(args, log, ranks=1, seen_dirs=None):
    group = RayTrainGroup(args, 1, ranks, pg=None)
    group._actor_handlers = [_rank(log, args, rank) for rank in range(ranks)]
    group._rollout_manager = _manager(log, [] if seen_dirs is None else seen_dirs)
    return group


def test_constructing_a_group_touches_no_ray(tmp_path):
    import ray

    was_initialized = ray.is_initialized()
    group = RayTrainGroup(_args(tmp_path), 2, 4, pg=None, role="critic")
    assert group.world_size == 8 and group._actor_handlers == []
    assert ray.is_initialized() == was_initialized


def test_disk_versions_count_from_start_and_exports_are_removed_after_reload(tmp_path, no_ray):
    log: list = []
    seen_dirs: list = []
    group = _group(_args(tmp_path), log, ranks=2, seen_dirs=seen_dirs)
    for expected in (4, 5, 6):
        assert group.update_weights() is None
        assert group._weight_version == expected
    reloads = [call[1] for call in log if call[0] == "manager.update_weights_from_disk"]
    assert reloads == [(str(tmp_path / "weights" / f"weight_v{v:06d}"), str(v)) for v in (4, 5, 6)]
    assert seen_dirs == [True, True, True]  # Still there while engines load it.
    assert not any((tmp_path / "weights").iterdir())
    exports = [WeightUpdate(v, "disk", disk_dir=str(tmp_path / "weights" / f"weight_v{v:06d}")) for v in (4, 5, 6)]
    assert _updates(log) == [export for export in exports for _rank in range(2)]  # every rank, every version


def test_keep_files_retains_exports(tmp_path, no_ray):
    log: list = []
    group = _group(_args(tmp_path, update_weight_disk_keep_files=True), log)
    group.update_weights()
    assert (tmp_path / "weights" / "weight_v000004" / "model.safetensors").is_file()


def _updates(log: list) -> list[WeightUpdate]:
    return [call[1][0] for call in log if call[0] == "rank.update_weights"]


@pytest.mark.parametrize("transport", ["distributed", "tensor", "nccl"])
def test_sent_updates_go_to_the_paused_engines_and_are_checked_before_generation_continues(tmp_path, no_ray, transport):
    log: list = []
    args = _args(tmp_path, update_weight_transport=transport, update_weight_buffer_size=1024, rollout_http_timeout=9)
    group = _group(args, log, ranks=2)
    group.update_weights()
    assert [call[0] for call in log] == [
        "manager.prepare_weight_update",
        "rank.update_weights",
        "rank.update_weights",
        "manager.finish_weight_update",
    ]
    expected = WeightUpdate(
        version=4,
        transport="tensor" if transport == "tensor" else "distributed",  # "nccl" is the old name of distributed
        engine_urls=tuple(ENGINES),
        bucket_bytes=1024,
        timeout_s=9.0,
    )
    assert _updates(log) == [expected, expected]
    assert log[-1][1] == (4,) and group._weight_version == 4
    group.update_weights()
    assert [update.version for update in _updates(log)] == [4, 4, 5, 5] and group._weight_version == 5
    assert not (tmp_path / "weights").exists()


def test_a_failed_send_leaves_the_version_and_the_engines_paused(tmp_path, no_ray):
    log: list = []
    group = _group(_args(tmp_path, update_weight_transport="distributed"), log)

    def fail(update):
        raise RuntimeError("engine http://127.0.0.1:1 refused")

    group._actor_handlers[0].update_weights.behaviour = fail
    with pytest.raises(RuntimeError, match="refused"):
        group.update_weights()
    assert group._weight_version == 3
    assert [call[0] for call in log] == ["manager.prepare_weight_update", "rank.update_weights"]


def test_without_a_rollout_manager_sent_updates_name_no_engines(tmp_path, no_ray):
    log: list = []
    group = _group(_args(tmp_path, update_weight_transport="distributed"), log)
    group._rollout_manager = None
    group.update_weights()
    assert _updates(log) == [WeightUpdate(version=4, transport="distributed")]


def test_only_full_updates_and_known_transports_are_accepted(tmp_path):
    with pytest.raises(ValueError, match="--update-weight-mode must be one of full, got 'delta'"):
        RayTrainGroup(_args(tmp_path, update_weight_mode="delta"), 1, 1, pg=None)
    with pytest.raises(ValueError, match="--update-weight-transport must be one of disk, distributed, tensor"):
        RayTrainGroup(_args(tmp_path, update_weight_transport="shm"), 1, 1, pg=None)
    with pytest.raises(ValueError, match="--update-weight-buffer-size must be >= 1, got 0"):
        RayTrainGroup(_args(tmp_path, update_weight_buffer_size=0), 1, 1, pg=None)


def test_the_critics_weights_never_go_to_the_engines(tmp_path, no_ray):
    log: list = []
    group = _group(_args(tmp_path), log)
    group.role = "critic"
    with pytest.raises(ValueError, match="only the actor's weights go to the rollout engines"):
        group.update_weights()
    assert log == []


def test_disk_update_errors_name_the_fix(tmp_path, no_ray):
    log: list = []
    group = _group(_args(tmp_path, update_weight_disk_dir=None), log)
    with pytest.raises(ValueError, match="--update-weight-disk-dir"):
        group.update_weights()
    assert log == [] and group._weight_version == 3
    group = _group(_args(tmp_path), log)
    group._rollout_manager = None
    with pytest.raises(RuntimeError, match="rollout manager"):
        group.update_weights()


def test_failed_export_does_not_advance_the_version(tmp_path, no_ray):
    log: list = []
    group = _group(_args(tmp_path), log)

    def fail(update):
        raise OSError("disk full")

    group._actor_handlers[0].update_weights.behaviour = fail
    with pytest.raises(OSError, match="disk full"):
        group.update_weights()
    assert group._weight_version == 3
    assert not any(call[0] == "manager.update_weights_from_disk" for call in log)


def test_release_kills_ranks_before_reload_and_save_points_next_create_at_it(tmp_path, no_ray, monkeypatch):
    log: list = []
    args = _args(tmp_path, release_train=True, ckpt_step=2, no_load_rng=True)
    group = _group(args, log)
    rank = group._actor_handlers[0]
    monkeypatch.setattr(actor_group.ray, "kill", lambda actor, no_restart=True: log.append(("kill", (actor,), {})))
    group.save_model(9, force_sync=True)
    assert ("rank.save_model", (9,), {"force_sync": True}) in log
    assert (args.load, args.ckpt_step, args.no_load_optim, args.no_load_rng) == (args.save, None, True, False)
    group.update_weights()
    names = [call[0] for call in log]
    assert names.index("kill") < names.index("manager.update_weights_from_disk")
    assert group._actor_handlers == []

    monkeypatch.setattr(group, "_allocate_gpus_for_actor", lambda *a: group._actor_handlers.append(rank))
    assert group.create() == [5]
    init = next(call for call in log if call[0] == "rank.init")
    assert init[1] == (args, "actor") and args.update_weight_start_version == 4
    assert group.create() is None  # Already running: no second set of ranks.


def test_start_init_overlaps_the_ranks_init_with_the_engines_start_and_create_registers_after(
    tmp_path, no_ray, monkeypatch
):
    log: list = []
    args = _args(tmp_path)
    group = _group(args, log)
    rank, manager = group._actor_handlers[0], group._rollout_manager
    group._actor_handlers = []
    monkeypatch.setattr(group, "_allocate_gpus_for_actor", lambda *a: group._actor_handlers.append(rank))
    group.start_init()
    group.start_init()  # once under way, not started again
    assert [call[0] for call in log] == ["rank.init"]  # the rollout manager (still starting engines) is not asked
    assert group.create(manager) == [5]
    assert [call[0] for call in log] == ["rank.init", "manager.register_training_actors"]
    assert group.create(manager) is None


def test_manager_registration_only_moves_the_weight_version_forward(tmp_path, no_ray):
    log: list = []
    args = _args(tmp_path)
    group = _group(args, log)
    register = group._rollout_manager.register_training_actors
    register.behaviour = {"update_weight_start_version": 1, "rollout_engine_urls": ["u"]}
    group._register_with_rollout_manager()
    assert group._weight_version == 3 and args.update_weight_start_version == 3
    assert args.rollout_engine_urls == ["u"]
    register.behaviour = {"update_weight_start_version": 10}
    group._register_with_rollout_manager()
    assert [call.args for call in register.calls] == [("actor", group._actor_handlers)] * 2
    assert group._weight_version == 10 and args.update_weight_start_version == 10
    group._actor_handlers = [_rank(log, args)]  # Ranks initialize after registration, from these args.
    group.update_weights()
    assert (str(tmp_path / "weights" / "weight_v000011"), "11") in [c[1] for c in log]


def test_backend_class_comes_from_the_registry(tmp_path):
    import ray

    from slime.plugins.torch_backend import TorchTrainRayActor

    assert RayTrainGroup(_args(tmp_path), 1, 1, pg=None)._backend_class() is TorchTrainRayActor
    remote_cls = ray.remote(TorchTrainRayActor)  # an explicit class wins, used as given (here a Ray actor class)
    assert RayTrainGroup(_args(tmp_path), 1, 1, pg=None, actor_cls=remote_cls)._backend_class() is remote_cls
    from slime.plugin_manager import PluginError

    with pytest.raises(PluginError, match="nope"):
        RayTrainGroup(_args(tmp_path, train_backend="nope"), 1, 1, pg=None)._backend_class()


def test_allocation_needs_enough_bundles(tmp_path):
    group = RayTrainGroup(_args(tmp_path), 1, 2, pg=None)
    with pytest.raises(ValueError, match="placement"):
        group._allocate_gpus_for_actor(None, 0)
    with pytest.raises(ValueError, match="needs 2 bundles"):
        group._allocate_gpus_for_actor(Placement(object(), [0]), 0)


@pytest.mark.slow
def test_ranks_start_in_cpu_placement_bundles_with_a_shared_master(tmp_path):
    import ray

    from slime.ray.layout import LayoutError
    from slime.ray.placement_group import create_placement_groups

    class EnvRank:
        """A real (tiny) rank class, defined here so Ray ships it by value: reports its environment."""

        def init(self, args, role, with_ref=False, with_opd_teacher=False):
            return 0

        def env(self):
            import os

            return {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}

        def train(self, rollout_id, refs):
            return {"rank": int(__import__("os").environ["RANK"]), "rollout_id": rollout_id}

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        args = SimpleNamespace(actor_num_nodes=1, actor_num_gpus_per_node=2, use_critic=False)
        pgs = create_placement_groups(args)
        # One node: both ranks share its bundle.
        assert pgs["actor"].num_gpus_per_bundle == 0 and list(pgs["actor"].bundle_indices) == [0, 0]
        group = RayTrainGroup(args, 1, 2, pg=pgs["actor"], num_gpus_per_actor=0, actor_cls=EnvRank)
        assert group.create() == [0, 0]
        envs = ray.get([actor.env.remote() for actor in group._actor_handlers])
        assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
        assert ray.get(group.async_train(4, [])) == [{"rank": 0, "rollout_id": 4}, {"rank": 1, "rollout_id": 4}]
        with pytest.raises(
            LayoutError, match=r"the actor needs 1 distinct node\(s\) with \{CPU: 3\}(.|\n)*lacks CPU 3"
        ):
            create_placement_groups(SimpleNamespace(actor_num_nodes=1, actor_num_gpus_per_node=3))
        group.release()
        assert group._actor_handlers == []
    finally:
        ray.shutdown()
