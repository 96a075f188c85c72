"""The transport interface: every operation orchestration needs from a rollout data transport.

A transport moves rollout data from the rollout manager (groups, accepted steps, training batches) to the
training ranks. A plugin provides one with `TransportSpec(name, factory)`; `factory(args)` builds a
`Transport` for a run (it is cheap: build one whenever you need it, state lives in the run's storage and
services, not in the object). Orchestration (the driver, the rollout manager, rollout functions, batch
building, trainers) holds the run's transport from `run_transport(args)` and calls it; it never asks which
transport it is.

Who calls what, in one training step:

| when | caller | method |
|---|---|---|
| `slime-run` parses its arguments | `slime.utils.arguments.parse_args` | `resolve_restore()` |
| before Ray starts | the driver | `prepare_storage()` |
| the rollout manager starts | `RolloutManager` | `check_storage()`, `open_data_source(...)` |
| a rollout function runs | rollout functions, through `current_session(args)` | `RolloutSession` methods |
| a generation hook returned new samples | `generate_and_rm` | `adopt_generated(source, produced)` |
| the step's output comes back | `RolloutManager` | `accept_rollout(...)` or `replay_archive(...)` |
| the batch is converted | `BatchBuilder.split_by_dp` | `shard_batch(builder, data)` |
| a training rank loads its shard | `process_rollout_data` | the shard reference's `load()` |
| a checkpoint is saved / restored | `RolloutManager.save` / `.load` | `save_state(...)`, `load_state(...)` |
| the manager is disposed | `RolloutManager.dispose` | `seal()` |

The opaque `service` some methods take is whatever `open_data_source` returned as the run's service: a
Ray actor handle for a transport that keeps state in a service (straw's queue), or None. Orchestration
only passes it back and closes it (`service.close.remote()`) when it owns it.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from slime.plugin_manager import PluginError

__all__ = [
    "OpenedSource",
    "RolloutSession",
    "ShardReference",
    "Transport",
    "TransportInterfaceError",
    "current_session",
    "missing_methods",
    "rollout_session_scope",
    "run_transport",
]


class TransportInterfaceError(PluginError):
    """A transport plugin's factory built an object that does not implement `Transport` (`slime-run` prints it)."""


@dataclass(frozen=True)
class OpenedSource:
    """What `Transport.open_data_source` returns: the data source, the run's service and whether we own it.

    `owned` services are closed by the rollout manager at dispose (`service.close.remote()`, then killed).
    """

    source: Any
    service: Any = None
    owned: bool = False


class RolloutSession(abc.ABC):
    """One rollout step's view of the transport, for rollout functions.

    Rollout functions get it from `current_session(args)`: the rollout manager installs the session of its
    service around every rollout function call. Blocking methods may be called from worker threads.
    """

    @abc.abstractmethod
    async def publish_group(self, group: list, rollout_id: Any) -> Any:
        """Hand over one finished, kept group while generation continues; returns what the batch holds for it."""

    @abc.abstractmethod
    def publish_group_now(self, group: list, rollout_id: Any) -> Any:
        """`publish_group` for synchronous callers (a worker thread, a Ray actor)."""

    @abc.abstractmethod
    def discard_group(self, group: Any, reason: str) -> None:
        """Drop a group a filter rejected (or that was aborted), recording `reason` where records are kept."""

    @abc.abstractmethod
    def load_groups(self, groups: Any) -> list:
        """The groups of a batch as Samples (references followed), each group's nesting kept."""

    @abc.abstractmethod
    def publish_batch(self, groups: list, rollout_id: Any, *, dropped: list | None = None) -> Any:
        """The step's batch from its (published) groups; `dropped` are the Samples a batch filter removed."""


class ShardReference(abc.ABC):
    """What a transport may hand a training rank instead of the shard dict itself.

    It travels like a shard: `Box(ray.put(reference))` (trainers `ray.get` the box's object ref; the
    reference must be small and picklable). Trainers call `load()`; every rank of a step must name the same
    batch (`batch_id`, `plan_digest`) and its own `rank`, which `process_rollout_data` checks first.
    """

    batch_id: Any
    plan_digest: Any
    rank: int

    @abc.abstractmethod
    def load(self) -> dict:
        """This rank's training columns (the dict an in-memory transport would have sent)."""


class Transport(abc.ABC):
    """One run's rollout data transport; see the module docstring for who calls each method and when."""

    #: The registered name, set by the factory's spec at build time.
    name: str = ""

    def __init__(self, args: Any) -> None:
        self.args = args

    # ---------------------------------------------------------------------------------- driver

    @abc.abstractmethod
    def resolve_restore(self) -> tuple[Any, Any]:
        """Decide what the run restores (reads files only): returns `(args, RestorePlan)`."""

    @abc.abstractmethod
    def prepare_storage(self) -> None:
        """Before Ray starts: settle where the run's data lives (every process must see the same paths)."""

    # --------------------------------------------------------------------------- rollout manager

    @abc.abstractmethod
    def check_storage(self) -> None:
        """Prove that every node of the cluster can use the run's storage; raise naming the path otherwise."""

    @abc.abstractmethod
    def open_data_source(self, source_cls: Any, *, restore_plan: Any, serving: Any, service: Any) -> OpenedSource:
        """Build the data source from its class and bind it to the run's service (creating one if needed).

        `service` is a service the serving deployment already holds (or None); `serving` is the serving
        cluster actor when the manager is attached to one (or None).
        """

    @abc.abstractmethod
    def rollout_session(self, service: Any) -> RolloutSession:
        """The session rollout functions use while the manager runs a step with this service."""

    @abc.abstractmethod
    def adopt_generated(self, source: Any, produced: Any) -> None:
        """A custom generate function turned `source` into `produced` samples: carry the transport's bookkeeping."""

    @abc.abstractmethod
    def accept_rollout(self, output: Any, rollout_id: int, *, service: Any) -> tuple[Any, dict | None, Any]:
        """Accept a rollout function's output: returns `(groups, metrics, accepted)`.

        `accepted` is the transport's durable record of the step (None when it keeps none); the batch
        builder stores it as `raw_ref`.
        """

    @abc.abstractmethod
    def replay_archive(self, template: str, rollout_id: int, *, service: Any) -> tuple[list, Any] | None:
        """Replay an archived step of this transport's own format: `(groups, accepted)`, or None for other formats."""

    @abc.abstractmethod
    def shard_batch(self, builder: Any, data: Any) -> list:
        """One `Box` per data-parallel rank for the converted batch `data` (the builder computes the schedule)."""

    @abc.abstractmethod
    def save_state(self, builder: Any, rollout_id: int) -> None:
        """Contribute the transport's state for training step `rollout_id` to the checkpoint being saved."""

    @abc.abstractmethod
    def load_state(self, builder: Any, rollout_id: int | None, source_restore: Any) -> None:
        """Restore what `save_state` saved (`source_restore`: what the data source's `load` returned)."""

    @abc.abstractmethod
    def seal(self) -> None:
        """The rollout manager is done: finish open writes so everything published stays readable."""


def missing_methods(obj: Any) -> list[str]:
    """The `Transport` methods `obj` lacks (not callable, or still abstract)."""
    missing = []
    for name in sorted(Transport.__abstractmethods__):
        member = getattr(obj, name, None)
        if member is None or not callable(member) or getattr(member, "__isabstractmethod__", False):
            missing.append(name)
    return missing


@functools.lru_cache(maxsize=64)
def _checked_factory(factory: Any, name: str, plugin: str) -> Any:
    """The factory, once its product class has been checked (a class factory is checked without building)."""
    if inspect.isclass(factory):
        missing = missing_methods(factory)
        if missing:
            raise TransportInterfaceError(
                f"Transport {name!r} (plugin {plugin!r}): {factory.__qualname__} does not implement "
                f"{', '.join(missing)} of slime.interfaces.Transport"
            )
    return factory


def run_transport(args: Any) -> Transport:
    """The run's transport (`args.rollout_data_transport`, default object-store), built by its spec's factory.

    A factory whose product lacks an interface method is refused with the plugin and the method named.
    """
    from slime.plugin_manager import registry_for

    name = getattr(args, "rollout_data_transport", None) or "object-store"
    registry = registry_for(args)
    spec = registry.get("transports", name)
    plugin = registry.providers.get(("transports", name), "?")
    if spec.target is None or not callable(spec.target):
        raise TransportInterfaceError(
            f"Transport {name!r} (plugin {plugin!r}): TransportSpec.target must be a factory taking the run's "
            f"args, got {spec.target!r}"
        )
    transport = _checked_factory(spec.target, name, plugin)(args)
    missing = missing_methods(transport)
    if missing:
        raise TransportInterfaceError(
            f"Transport {name!r} (plugin {plugin!r}): {type(transport).__qualname__} does not implement "
            f"{', '.join(missing)} of slime.interfaces.Transport"
        )
    transport.name = name
    return transport


_ACTIVE_SESSION: contextvars.ContextVar[RolloutSession | None] = contextvars.ContextVar(
    "slime_rollout_session", default=None
)


@contextlib.contextmanager
def rollout_session_scope(session: RolloutSession) -> Iterator[RolloutSession]:
    """Make `session` the one `current_session` returns inside this block (tasks and threads started in it too)."""
    token = _ACTIVE_SESSION.set(session)
    try:
        yield session
    finally:
        _ACTIVE_SESSION.reset(token)


def current_session(args: Any) -> RolloutSession:
    """The session the rollout manager installed, or a session of the run's transport without a service."""
    session = _ACTIVE_SESSION.get()
    return session if session is not None else run_transport(args).rollout_session(None)
