"""Fixtures of the SGLang engine plugin's tests: real SGLang servers on CPU, launched as a run launches them.

These tests need SGLang installed (`nox -s sglang` builds that environment); elsewhere they are skipped with
that reason. Two engines are shared by the session: each server takes ~25 s to start and ~1.9 GB of memory.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slime.plugins.sglang_engine.server_args import installed_version


def pytest_collection_modifyitems(config, items):
    if installed_version() is not None:
        return
    skip = pytest.mark.skip(reason="SGLang is not installed here: nox -s sglang runs these tests in its own virtualenv")
    for item in items:
        if "sglang" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model():
    from slime.plugins.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _engine_args(model, tmp_path, **overrides) -> SimpleNamespace:
    values = dict(
        hf_checkpoint=str(model),
        rollout_seed=7,
        sglang_engine_log_dir=str(tmp_path / "engine-logs"),
        sglang_engine_startup_timeout=240.0,
        sglang_server_args=[],
    )
    values.update(overrides)
    return SimpleNamespace(**values)


@pytest.fixture(scope="session")
def engine_args():
    """`engine_args(model, tmp_path, **overrides)`: the arguments the launcher reads, logs under `tmp_path`."""
    return _engine_args


@pytest.fixture(scope="session")
def two_engines(ray_local, tiny_model, tmp_path_factory):
    from slime.plugins.sglang_engine.launcher import launch_sglang_engines

    engines = launch_sglang_engines(_engine_args(tiny_model, tmp_path_factory.mktemp("engines")), 2)
    yield engines
    engines.shutdown()
