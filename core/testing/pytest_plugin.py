"""The pytest plugin of slime-rl (entry point `pytest11: slime`): fixtures for the transport conformance suite.

Fixtures:
- `slime_ray` (class scope): the `ray` module with a local Ray session (`num_cpus=2`) started for the test
  class and shut down after it; a session that was already running is used and left running.
- `transport_harness` (class scope): a `slime.testing.TransportHarness` for the requesting `TransportConformance`
  subclass (its `transport_name` and `transport_argv(directory)`): one run's transport, set up as a run sets it
  up, shared by the class's tests and torn down after them as the rollout manager tears it down.

Option `--slime-transport NAME` (repeatable; or `SLIME_TEST_TRANSPORT=NAME[,NAME]`): keep only the conformance
tests of those transports and deselect every other test.

Nothing heavy is imported until a fixture runs: pytest loads this module in every test run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

ENV_TRANSPORT = "SLIME_TEST_TRANSPORT"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("slime", "slime-rl transport conformance")
    group.addoption(
        "--slime-transport",
        action="append",
        default=[],
        metavar="NAME",
        help=f"run only the conformance tests of transport NAME (repeatable; or {ENV_TRANSPORT}=NAME[,NAME])",
    )


def selected_transports(config: pytest.Config) -> list[str]:
    """The transports named by `--slime-transport` and `SLIME_TEST_TRANSPORT`, in order."""
    names = [*os.environ.get(ENV_TRANSPORT, "").split(","), *config.getoption("slime_transport")]
    return list(dict.fromkeys(name.strip() for name in names if name.strip()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = selected_transports(config)
    if not wanted:
        return
    from slime.testing.transport_conformance import TransportConformance

    def checks_a_wanted_transport(item: pytest.Item) -> bool:
        cls = getattr(item, "cls", None)
        return cls is not None and issubclass(cls, TransportConformance) and cls.transport_name in wanted

    kept = [item for item in items if checks_a_wanted_transport(item)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if not checks_a_wanted_transport(item)])
        items[:] = kept


def pytest_report_header(config: pytest.Config) -> str | None:
    wanted = selected_transports(config)
    return f"slime transport conformance: {', '.join(wanted)}" if wanted else None


@pytest.fixture(scope="class")
def slime_ray() -> Iterator[Any]:
    """A local Ray session for the test class (two CPUs), shut down after it unless it was already running."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="class")
def transport_harness(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, slime_ray: Any
) -> Iterator[Any]:
    """The transport of the requesting `TransportConformance` subclass: one run, shared by the class's tests."""
    from slime.testing.transport_conformance import TransportHarness

    suite = request.cls() if request.cls is not None else None
    name = getattr(suite, "transport_name", "")
    if not name:
        raise pytest.UsageError(
            f"{request.node.nodeid}: transport_harness needs a TransportConformance subclass with transport_name set"
        )
    directory = tmp_path_factory.mktemp(f"transport-{name}")
    harness = TransportHarness(suite.transport_argv(directory))
    try:
        yield harness
    finally:
        harness.close()
