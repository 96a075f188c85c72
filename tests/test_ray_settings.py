"""The orchestration's settings (`slime.ray.settings`): defaults equal the flags', bad values name the flag,
and the driver, placement, rollout manager and training groups read them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fakes import fake_actor_handle

from slime.plugin_manager import PluginSelection, build_plugin_manager
from slime.ray import placement_group, rollout
from slime.ray.actor_group import RayTrainGroup
from slime.ray.settings import (
    DEFAULT_DATA_SOURCE,
    ClusterSettings,
    DriverSettings,
    InputSettings,
    ManagerSettings,
    ServingSettings,
    TrainGroupSettings,
    check_run_settings,
)
from slime.utils.arguments import build_parser, parse_args

#: Classes a namespace holding nothing builds (DriverSettings needs a step count).
PARTIAL_CLASSES = [ClusterSettings, ServingSettings, ManagerSettings, TrainGroupSettings, InputSettings]


@pytest.fixture(scope="module")
def parser():
    return build_parser(build_plugin_manager(PluginSelection()))


@pytest.mark.parametrize("settings_class", PARTIAL_CLASSES, ids=lambda cls: cls.__name__)
def test_settings_of_partial_args_equal_settings_of_the_flags_defaults(parser, settings_class):
    assert settings_class.from_args(SimpleNamespace()) == settings_class.from_args(parser.parse_args([]))


def test_driver_settings_of_partial_args_equal_the_flags_defaults(parser):
    assert DriverSettings.from_args(SimpleNamespace(num_rollout=3)) == DriverSettings.from_args(
        parser.parse_args(["--num-rollout", "3"])
    )


def test_the_default_data_source_is_the_default_transports():
    """A namespace without `data_source_path` reads the prompts as `parse_args` would have it read them."""
    args = parse_args([])
    assert args.data_source_path == DEFAULT_DATA_SOURCE
    assert ManagerSettings.from_args(args).data_source == ManagerSettings.from_args(SimpleNamespace()).data_source


@pytest.mark.parametrize(
    "settings_class, values, message",
    [
        (DriverSettings, {}, "--num-rollout must be given (or --num-epoch)"),
        (DriverSettings, {"num_rollout": 0}, "--num-rollout must be >= 1, got 0"),
        (DriverSettings, {"num_epoch": 0}, "--num-epoch must be >= 1, got 0"),
        (DriverSettings, {"num_rollout": "many"}, "--num-rollout must be int, got 'many'"),
        (DriverSettings, {"num_rollout": 3, "save_interval": 0}, "--save-interval must be >= 1, got 0"),
        (DriverSettings, {"num_rollout": 3, "eval_interval": -2}, "--eval-interval must be >= 1, got -2"),
        (DriverSettings, {"num_rollout": 3, "num_critic_only_steps": -1}, "--num-critic-only-steps must be >= 0"),
        (ClusterSettings, {"actor_num_nodes": 0}, "--actor-num-nodes must be >= 1, got 0"),
        (ClusterSettings, {"critic_num_gpus_per_node": 0}, "--critic-num-gpus-per-node must be >= 1, got 0"),
        (ClusterSettings, {"train_num_cpus_per_rank": 0}, "--train-num-cpus-per-rank must be > 0.0, got 0.0"),
        (ClusterSettings, {"kl_coef": -0.1}, "--kl-coef must be >= 0.0, got -0.1"),
        (ServingSettings, {"rollout_router": "nginx"}, "--rollout-router must be one of auto, none, sglang-router"),
        (ServingSettings, {"rollout_num_engines": 0}, "--rollout-num-engines must be >= 1, got 0"),
        (ManagerSettings, {"rollout_batch_size": 0}, "--rollout-batch-size must be >= 1, got 0"),
        (ManagerSettings, {"rollout_http_timeout": 0}, "--rollout-http-timeout must be > 0.0, got 0.0"),
        (ManagerSettings, {"load_debug_rollout_data_subsample": 1.5}, "must be in (0, 1], got 1.5"),
        (ManagerSettings, {"load_debug_rollout_data_subsample": 0}, "--load-debug-rollout-data-subsample must be >"),
        (ManagerSettings, {"update_weight_start_version": -1}, "--update-weight-start-version must be >= 0"),
        (TrainGroupSettings, {"release_train": True}, "--release-train needs --save"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(settings_class, values, message):
    with pytest.raises(ValueError) as failure:
        settings_class.from_args(SimpleNamespace(**values))
    assert message in str(failure.value)


def test_derived_values():
    manager = ManagerSettings.from_args(SimpleNamespace(rollout_function_path="user.generate"))
    assert manager.eval_function == "user.generate"  # no --eval-function-path: the rollout function evaluates
    assert ManagerSettings.from_args(SimpleNamespace(eval_function_path="user.eval")).eval_function == "user.eval"
    cluster = ClusterSettings.from_args(SimpleNamespace(actor_num_gpus_per_node=2, critic_num_nodes=3))
    assert (cluster.actor_ranks, cluster.critic_ranks, cluster.with_ref) == (2, 0, False)
    cluster = ClusterSettings.from_args(SimpleNamespace(use_critic=True, critic_num_nodes=3, kl_coef=0.1))
    assert (cluster.critic_ranks, cluster.with_ref) == (3, True)
    assert ClusterSettings.from_args(SimpleNamespace(use_kl_loss=True, kl_loss_coef=0.1)).with_ref
    assert not ClusterSettings.from_args(SimpleNamespace(kl_loss_coef=0.1)).with_ref  # weighs nothing alone
    assert TrainGroupSettings.from_args(SimpleNamespace()).disk_weights
    old_name = TrainGroupSettings.from_args(SimpleNamespace(update_weight_transport="nccl"))
    assert old_name.update_weight_transport == "distributed" and not old_name.disk_weights
    assert ManagerSettings.from_args(SimpleNamespace()).pause_mode == "abort"
    assert ManagerSettings.from_args(SimpleNamespace(partial_rollout=True)).pause_mode == "retract"


def test_check_run_settings_refuses_a_bad_flag_of_any_component(parser):
    check_run_settings(parse_args(["--num-rollout", "2"]))
    for argv, message in (
        (["--rollout-batch-size", "0"], "--rollout-batch-size must be >= 1, got 0"),
        (["--rollout-num-engines", "0"], "--rollout-num-engines must be >= 1, got 0"),
        (["--actor-num-nodes", "0"], "--actor-num-nodes must be >= 1, got 0"),
        (["--release-train"], "--release-train needs --save"),
        (["--save-interval", "0"], "--save-interval must be >= 1, got 0"),
    ):
        with pytest.raises(ValueError, match=message):
            check_run_settings(parser.parse_args(["--num-rollout", "2", *argv]))


def test_train_refuses_bad_loop_flags(monkeypatch):
    from slime import train

    monkeypatch.setattr(train, "create_training_models", lambda *a: (None, None))
    with pytest.raises(ValueError, match="--save-interval must be >= 1, got 0"):
        train.train(SimpleNamespace(num_rollout=2, save_interval=0), {}, None, None, None)
    with pytest.raises(ValueError, match="train\\(\\) needs --num-rollout"):
        train.train(SimpleNamespace(num_epoch=2), {}, None, None, None)


def test_create_rollout_manager_turns_epochs_into_rollout_steps(monkeypatch):
    handle = fake_actor_handle(rollout.RolloutManager, get_num_rollout_per_epoch=5)
    started = SimpleNamespace(remote=lambda *a, **kw: handle)
    monkeypatch.setattr(rollout, "RolloutManager", SimpleNamespace(options=lambda **kw: started))
    monkeypatch.setattr(placement_group.ray, "get", lambda value: value)
    args = SimpleNamespace(num_epoch=3)
    assert placement_group.create_rollout_manager(args, None) == (handle, 5)
    assert args.num_rollout == 15
    args = SimpleNamespace(num_rollout=4, num_epoch=3)
    assert placement_group.create_rollout_manager(args, None) == (handle, None)
    assert args.num_rollout == 4 and len(handle.get_num_rollout_per_epoch.calls) == 1
    with pytest.raises(ValueError, match="--num-rollout must be given"):
        placement_group.create_rollout_manager(SimpleNamespace(), None)


def test_manager_reads_its_settings_from_args_when_made_without_its_constructor():
    manager = object.__new__(rollout.RolloutManager.__ray_metadata__.modified_class)
    manager.args = SimpleNamespace(rollout_batch_size=4)
    manager.data_source = SimpleNamespace(dataset=list(range(10)))
    assert manager.get_num_rollout_per_epoch() == 2
    assert manager.settings == ManagerSettings(batch_size=4)


def test_train_group_refuses_bad_settings_at_construction():
    with pytest.raises(ValueError, match="--release-train needs --save"):
        RayTrainGroup(SimpleNamespace(release_train=True), 1, 1, pg=None)
    group = RayTrainGroup(SimpleNamespace(update_weight_start_version=4, save="/ckpt"), 1, 1, pg=None)
    assert group.settings.update_weight_start_version == 4 and group._weight_version == 4


def test_the_rollout_manager_class_pickles_for_ray():
    """Ray ships the actor class by pickling it; a `functools.cached_property` (a lock on Python 3.11) broke that."""
    from ray import cloudpickle

    from slime.ray.rollout import RolloutManager

    cloudpickle.dumps(RolloutManager.__ray_metadata__.modified_class)


def test_the_command_line_names_weight_transports_by_what_they_do(parser, capsys):
    args = parser.parse_args(["--update-weight-transport", "distributed", "--update-weight-buffer-size", "1024"])
    settings = TrainGroupSettings.from_args(args)
    assert (settings.update_weight_transport, settings.update_weight_buffer_size) == ("distributed", 1024)
    with pytest.raises(SystemExit):  # "nccl" names a backend, not a transport: the command line refuses it
        parser.parse_args(["--update-weight-transport", "nccl"])
    assert "invalid choice: 'nccl' (choose from 'disk', 'distributed', 'tensor')" in capsys.readouterr().err
    manager = ManagerSettings.from_args(parser.parse_args(["--partial-rollout", "--offload-rollout"]))
    assert (manager.pause_mode, manager.offload_rollout) == ("retract", True)


def test_auto_router_fronts_several_engines_when_sglang_router_is_installed(monkeypatch):
    from slime.ray import router

    monkeypatch.setattr(router, "sglang_router_available", lambda: True)
    assert ServingSettings.from_args(SimpleNamespace(rollout_num_engines=2)).router_to_start == "sglang-router"
    assert ServingSettings.from_args(SimpleNamespace(rollout_num_engines=1)).router_to_start == "none"
    explicit = SimpleNamespace(rollout_num_engines=2, rollout_router="none")
    assert ServingSettings.from_args(explicit).router_to_start == "none"
    # --deterministic sends batched groups with a seed per sample, which the router cannot forward.
    deterministic = SimpleNamespace(rollout_num_engines=2, deterministic=True)
    assert ServingSettings.from_args(deterministic).router_to_start == "none"
    deterministic.rollout_router = "sglang-router"
    assert ServingSettings.from_args(deterministic).router_to_start == "sglang-router"
    monkeypatch.setattr(router, "sglang_router_available", lambda: False)
    assert ServingSettings.from_args(SimpleNamespace(rollout_num_engines=4)).router_to_start == "none"
