"""Test tools for slime-rl plugins: the transport conformance suite and its pytest fixtures.

Every rollout data transport, built in or third party, must pass `TransportConformance`. Subclass it in a
test module of your package and name your transport (the name of the `TransportSpec` your plugin registers):

    from slime.testing import TransportConformance

    class TestMyTransport(TransportConformance):
        transport_name = "my-transport"
        extra_args = ("--plugin", "my_transport")  # optional: more `slime-run` options for the run

        def hardware_missing(self) -> str | None:  # optional: why shards cannot move here (those checks skip)
            return None if gpu_available() else "my-transport needs a GPU"

        def transport_argv(self, tmp_path):  # optional: options that need the class's temporary directory
            return [*super().transport_argv(tmp_path), "--my-transport-dir", str(tmp_path / "shared")]

Your package must be installed (its `slime` entry point loads the plugin) or named with `--plugin` as above.
The suite's tests of one class share one run of the transport (fixture `transport_harness`, a
`TransportHarness`) in a local Ray session with two CPUs (fixture `slime_ray`), both from the pytest plugin
`slime.testing.pytest_plugin`, which installing slime-rl registers with pytest (entry point `pytest11: slime`;
with `PYTEST_DISABLE_PLUGIN_AUTOLOAD=1` add `-p slime.testing.pytest_plugin`). The plugin also adds
`--slime-transport NAME` (or `SLIME_TEST_TRANSPORT=NAME`): run only that transport's conformance tests.
`assert_same`, `example_groups` and `training_samples` are there for your own tests too.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DTYPES",
    "TransportConformance",
    "TransportHarness",
    "assert_same",
    "example_groups",
    "training_samples",
]


def __getattr__(name: str) -> Any:
    """The suite's names, imported on first use: pytest loads the plugin (a submodule) in every test run."""
    if name in __all__:
        from slime.testing import transport_conformance

        return getattr(transport_conformance, name)
    raise AttributeError(f"module 'slime.testing' has no attribute {name!r}")
