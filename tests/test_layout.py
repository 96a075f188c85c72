"""The run's layout on the cluster (`slime.ray.layout`): custom resources from the command line, the fit of training
bundles and engines on the nodes, the refusal naming what each node lacks, and engine relaunches after a node loss."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slime.errors import RunInterrupted
from slime.ray import layout
from slime.ray.layout import EngineDemand, LayoutError, Node, NodeGroup, fit_layout, parse_resources


def _node(name: str, head: bool = False, **resources: float) -> Node:
    return Node(node_id=f"{name}{'0' * 30}", address=f"10.0.0.{len(name)}", resources=resources, is_head=head)


# ------------------------------------------------------------------------------------------------ the flags


def test_custom_resources_are_name_amount_pairs():
    assert parse_resources("rollout_node=1") == {"rollout_node": 1.0}
    assert parse_resources(" a=0.5 , b=2") == {"a": 0.5, "b": 2.0}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rollout_node", "expected NAME=AMOUNT"),
        ("=1", "expected NAME=AMOUNT"),
        ("a=one", "a: amount 'one' is not a number"),
        ("a=0", "a: amount must be positive, got 0"),
        ("a=-1", "amount must be positive"),
        ("CPU=2", "CPU is not a custom resource"),
        ("GPU=1", "GPU is not a custom resource"),
        ("node:10.0.0.1=1", "is not a custom resource"),
    ],
)
def test_malformed_custom_resources_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_resources(text)


def test_the_flags_are_refused_at_parse_time_naming_the_flag(capsys):
    from slime.utils.arguments import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--num-rollout", "1", "--rollout-resources", "GPU=1"])
    assert exit_info.value.code == 2
    assert "argument --rollout-resources: GPU is not a custom resource" in capsys.readouterr().err


def test_parsed_flags_reach_the_settings():
    from slime.ray.settings import ClusterSettings, ServingSettings
    from slime.utils.arguments import parse_args

    args = parse_args(["--num-rollout", "1", "--train-resources", "t=1", "--rollout-resources", "r=0.5,s=1"])
    assert ClusterSettings.from_args(args).rank_resources(use_gpu=False) == {"CPU": 1.0, "t": 1.0}
    assert ClusterSettings.from_args(args).rank_resources(use_gpu=True) == {"GPU": 1.0, "CPU": 1.0, "t": 1.0}
    assert ServingSettings.from_args(args).rollout_resources == (("r", 0.5), ("s", 1.0))


# ------------------------------------------------------------------------------------------------- the fit


def test_a_role_on_several_nodes_takes_distinct_nodes():
    nodes = [_node("a", CPU=4), _node("b", CPU=4)]
    placed = fit_layout(nodes, [NodeGroup("actor", 2, {"CPU": 2})], None)
    assert sorted(placed["actor"]) == sorted(node.node_id for node in nodes)
    # One node holds four CPUs' worth, but two nodes are asked for.
    with pytest.raises(LayoutError, match=r"the actor needs 2 distinct node\(s\) with \{CPU: 2\} each") as refused:
        fit_layout(nodes[:1], [NodeGroup("actor", 2, {"CPU": 2})], None)
    assert "node 10.0.0.1 (a0000000): has room" in str(refused.value)


def test_the_search_finds_a_fit_that_first_fit_misses():
    # First fit puts the actor on the big node, leaving no node for the critic's 4 CPUs.
    nodes = [_node("big", CPU=4), _node("sm", CPU=2)]
    groups = [NodeGroup("actor", 1, {"CPU": 2}), NodeGroup("critic", 1, {"CPU": 4})]
    placed = fit_layout(nodes, groups, None)
    assert placed == {"actor": [nodes[1].node_id], "critic": [nodes[0].node_id]}


def test_engines_go_where_their_custom_resource_is():
    nodes = [_node("head", head=True, CPU=2, train=1), _node("w", CPU=2, rollout=2)]
    groups = [NodeGroup("actor", 1, {"CPU": 1, "train": 1})]
    placed = fit_layout(nodes, groups, EngineDemand(2, {"rollout": 1}))
    assert placed == {"actor": [nodes[0].node_id], "engines": [nodes[1].node_id] * 2}


def test_a_layout_that_does_not_fit_names_what_each_node_lacks():
    nodes = [_node("head", head=True, CPU=2, train=1), _node("w", CPU=2, rollout=2)]
    groups = [NodeGroup("actor", 1, {"CPU": 2, "train": 1})]
    with pytest.raises(LayoutError) as refused:
        fit_layout(nodes, groups, EngineDemand(3, {"rollout": 1, "CPU": 1}))
    message = str(refused.value)
    assert "3 rollout engine(s) need {CPU: 1, rollout: 1} each and 2 fit beside the training ranks" in message
    assert "node 10.0.0.4 (head0000, head): lacks CPU 1 (has 0), rollout 1 (has 0); total {CPU: 2, train: 1}" in message
    assert "node 10.0.0.1 (w0000000): lacks CPU 1 (has 0), rollout 1 (has 0); total {CPU: 2, rollout: 2}" in message
    assert "lower --rollout-num-engines or --rollout-resources" in message
    with pytest.raises(
        LayoutError, match=r"the critic needs 1 distinct node\(s\) with \{GPU: 1\} each beside the actor"
    ):
        fit_layout(nodes, [*groups, NodeGroup("critic", 1, {"GPU": 1})], None)
    with pytest.raises(LayoutError, match="no alive node"):
        fit_layout([], groups, None)


def test_engines_asking_for_nothing_fit_anywhere():
    assert fit_layout([_node("a")], [], EngineDemand(4, {})) == {"engines": [_node("a").node_id] * 4}


# ------------------------------------------------------------------------------------ engines and relaunches


def test_engine_demand_is_the_plugins_declaration_plus_the_flag_on_this_machine(monkeypatch):
    from slime.plugin_manager import registry_for
    from slime.plugins import cpu_engine

    monkeypatch.setattr(layout, "this_machine", lambda: "10.0.0.9")
    assert registry_for(None).get("rollout_engines", "cpu").resources is cpu_engine.engine_resources
    args = SimpleNamespace(rollout_engine="cpu", cpu_engine_num_cpus=0.5, rollout_resources={"r": 1.0})
    assert layout.engine_demand(args, 3) == EngineDemand(3, {"CPU": 0.5, "r": 1.0}, machine="10.0.0.9")
    assert layout.engine_actor_options(args, {"CPU": 0.5}) == {
        "num_cpus": 0.5,
        "num_gpus": 0.0,
        "resources": {"r": 1.0, "node:10.0.0.9": layout.MACHINE_MARKER_AMOUNT},
    }
    assert layout.engine_actor_options(SimpleNamespace(), {}) == {
        "num_cpus": 0.0,
        "num_gpus": 0.0,
        "resources": {"node:10.0.0.9": layout.MACHINE_MARKER_AMOUNT},
    }


def test_engines_stay_on_the_machine_whose_loopback_they_listen_on():
    """Engines listen on 127.0.0.1: a node of another machine is never chosen for them, and a layout that would need
    one says so; nodes of the same machine (same address) are all usable."""
    here, there = _node("a", CPU=1), _node("cc", CPU=4, rollout=2)
    also_here = Node(node_id="b" * 32, address=here.address, resources={"CPU": 2.0}, is_head=False)
    assert fit_layout([there, here, also_here], [], EngineDemand(3, {"CPU": 1}, machine=here.address)) == {
        "engines": [here.node_id, also_here.node_id, also_here.node_id]
    }
    with pytest.raises(LayoutError) as refused:
        fit_layout([here, there], [], EngineDemand(1, {"rollout": 1}, machine=here.address))
    message = str(refused.value)
    assert "node 10.0.0.1 (a0000000): lacks rollout 1 (has 0); total {CPU: 1}" in message
    assert "node 10.0.0.2 (cc000000): on another machine than the rollout manager's (10.0.0.1)" in message
    assert message.endswith("engines listen on 127.0.0.1, so they run on the driver's machine only")


class _Launcher:
    """An engine launcher (`target(args, num_engines)`) whose launch fails or returns URLs."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.calls = 0

    def __call__(self, args, num_engines):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return [f"http://127.0.0.1:{9000 + i}" for i in range(num_engines)]


def _server(launcher: _Launcher):
    from slime.ray.serving import RolloutServer

    return RolloutServer(SimpleNamespace(), launcher, ["http://a", "http://b"], [None, "engine-b"])


def test_engines_whose_node_is_gone_stop_the_run_with_how_to_resume(monkeypatch):
    from slime.ray import serving

    def no_node_left(args, count):
        raise LayoutError(f"{count} rollout engine(s) need {{rollout: 1}} and no node has it")

    monkeypatch.setattr(serving, "check_engines_fit", no_node_left)
    launcher = _Launcher()
    server = _server(launcher)
    with pytest.raises(
        RunInterrupted, match=r"engine slot\(s\) 0 died and cannot be relaunched: 1 rollout engine"
    ) as stop:
        server.recover()
    assert "rerun the same command to resume" in str(stop.value)
    assert launcher.calls == 0 and server.all_engines == [None, "engine-b"]


def test_a_relaunch_that_fails_because_its_node_left_is_reported_as_such(monkeypatch):
    from slime.ray import serving

    checks = []

    def fits_then_not(args, count):
        checks.append(count)
        if len(checks) > 1:  # Ray noticed the node loss while the relaunch waited on it
            raise LayoutError("no node has rollout")

    monkeypatch.setattr(serving, "check_engines_fit", fits_then_not)
    with pytest.raises(RunInterrupted, match="no node has rollout"):
        _server(_Launcher(RuntimeError("engine 1/1 died"))).recover()
    # A launch that fails while the layout still fits is the launcher's own failure, raised as it is.
    checks.clear()
    monkeypatch.setattr(serving, "check_engines_fit", lambda args, count: checks.append(count))
    with pytest.raises(RuntimeError, match="engine 1/1 died"):
        _server(_Launcher(RuntimeError("engine 1/1 died"))).recover()
    assert checks == [1, 1]
    server = _server(_Launcher())
    server.recover()
    assert server.urls == ["http://127.0.0.1:9000", "http://b"] and server.num_new_engines == 1


# ------------------------------------------------------------------------------------------- the storage probe


def test_the_storage_check_names_each_node_that_cannot_use_the_pool(tmp_path, monkeypatch):
    """Three nodes: one answers, one cannot read the pool, one left the cluster during the check (skipped)."""
    from ray.exceptions import TaskUnschedulableError

    from slime.data import transport
    from slime.errors import UsageError

    args = SimpleNamespace(rollout_data_transport="straw", rollout_data_dir=str(tmp_path), save=None)
    nodes = [
        {"NodeID": hex_id * 28, "NodeManagerAddress": address, "Alive": True, "Resources": {"CPU": 1}}
        for hex_id, address in (("aa", "10.0.0.1"), ("bb", "10.0.0.2"), ("cc", "10.0.0.3"))
    ]
    monkeypatch.setattr(transport.ray, "nodes", lambda: nodes)

    class Probe:
        """`ray.remote(fn)`: each `.options(...).remote(...)` stands for the probe on the next node."""

        def __init__(self, fn):
            self.fn, self.node = fn, iter(nodes)

        def options(self, **_):
            return self

        def remote(self, reference, root, args):
            return next(self.node)["NodeID"][:4], reference, root, args

    monkeypatch.setattr(transport.ray, "remote", lambda **_: Probe)

    def get(pending, timeout=None):
        if isinstance(pending, list):
            raise FileNotFoundError("the whole check failed")
        name, reference, root, args = pending
        if name == "bbbb":  # no pool mounted
            raise FileNotFoundError(f"[Errno 2] No such file or directory: '{root}/marker'")
        if name == "cccc":  # left the cluster
            raise TaskUnschedulableError("The node specified via NodeAffinitySchedulingStrategy doesn't exist")
        return transport._probe_storage(reference, root, args)

    monkeypatch.setattr(transport.ray, "get", get)
    with pytest.raises(UsageError) as refused:
        transport.check_rollout_storage(args)
    message = str(refused.value)
    assert (
        f"All rollout/training nodes must share the run at --rollout-data-dir={tmp_path}, and this node does not"
        in message
    )
    assert (
        f"node 10.0.0.2 (bbbbbbbb): FileNotFoundError: [Errno 2] No such file or directory: '{tmp_path}/marker'"
        in message
    )
    assert "10.0.0.1" not in message and "10.0.0.3" not in message


def test_a_refusal_raised_while_an_actor_starts_reaches_the_console_as_itself():
    """Ray keeps only the text of an exception raised in an actor's constructor (the rollout manager's storage check,
    a layout refusal); the driver rebuilds the user's error from it instead of reporting a dead actor."""
    from ray.exceptions import ActorDiedError

    from slime.errors import UsageError
    from slime.train import _error_of_creation

    died = ActorDiedError()
    died.error_msg = (
        "The actor died because of an error raised in its creation task, \x1b[36mray::RolloutManager.__init__()\x1b[39m"
        '\n  File "core/ray/rollout.py", line 119, in __init__\nslime.errors.UsageError: All rollout/training nodes '
        "must share the run at --rollout-data-dir=/pool, and this node does not:\n  node 10.0.0.2 (bbbbbbbb): why"
    )
    reported = _error_of_creation(died)
    assert type(reported) is UsageError
    assert str(reported) == (
        "All rollout/training nodes must share the run at --rollout-data-dir=/pool, and this node does not:\n"
        "  node 10.0.0.2 (bbbbbbbb): why"
    )
    died.error_msg = "...\nslime.ray.layout.LayoutError: the cluster cannot hold this run's layout: ..."
    assert type(_error_of_creation(died)) is UsageError
    died.error_msg = "...\nslime.errors.RunInterrupted: rollout engine slot(s) 0 died and cannot be relaunched"
    assert type(_error_of_creation(died)) is RunInterrupted
    died.error_msg = "The actor died unexpectedly before finishing this task.\n\tclass_name: CPUEngineActor"
    assert _error_of_creation(died) is None


def test_the_storage_check_probes_its_own_node_in_process(tmp_path, monkeypatch):
    """The node the check runs on is probed by the checking process itself (no Ray task, no worker importing torch);
    every other node still gets a task, and a failure on either is named."""
    from slime.data import transport
    from slime.errors import UsageError

    args = SimpleNamespace(rollout_data_transport="straw", rollout_data_dir=str(tmp_path), save=None)
    here, there = "aa" * 28, "bb" * 28
    nodes = [
        {"NodeID": node_id, "NodeManagerAddress": address, "Alive": True, "Resources": {"CPU": 1}}
        for node_id, address in ((here, "10.0.0.1"), (there, "10.0.0.2"))
    ]
    monkeypatch.setattr(transport.ray, "nodes", lambda: nodes)
    monkeypatch.setattr(transport.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(
        transport.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: here), raising=False
    )
    tasks = []

    class Probe:
        def options(self, scheduling_strategy):
            tasks.append(scheduling_strategy.node_id)
            return self

        def remote(self, reference, root, args):
            return probe(reference, root, args)

    probe = transport._probe_storage  # the remote node's, which the second check leaves able to read the pool
    monkeypatch.setattr(transport.ray, "remote", lambda **_: lambda fn: Probe())
    monkeypatch.setattr(transport.ray, "get", lambda pending, timeout=None: pending)
    transport.check_rollout_storage(args)
    assert tasks == [there]

    def local_pool_missing(reference, root, args):
        raise FileNotFoundError(f"[Errno 2] No such file or directory: '{root}/marker'")

    monkeypatch.setattr(transport, "_probe_storage", local_pool_missing)
    with pytest.raises(UsageError, match=r"this node does not:\n  node 10\.0\.0\.1 \(aaaaaaaa\): FileNotFoundError"):
        transport.check_rollout_storage(args)

    def a_bug(reference, root, args):
        raise TypeError("a bug in the probe")

    monkeypatch.setattr(transport, "_probe_storage", a_bug)
    with pytest.raises(TypeError, match="a bug in the probe"):  # not reported as the node's storage failing
        transport.check_rollout_storage(args)
