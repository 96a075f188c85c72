"""Test sessions. `nox` runs lint and the test suite; nothing here needs a GPU.

Sessions reuse the torch already installed on the machine (venvs see system site packages), so no
session ever downloads a CUDA build of torch: install it first with `pip install torch==2.13.0`.

    nox                      lint + tests + e2e (the CI default)
    nox -s "transport(straw)"  the transport conformance suite for one transport (object-store, nixl, straw)
    nox -s e2e               end-to-end CPU runs (slow)
    nox -s bench             benchmarks/: transport.py and e2e.py (JSON reports under benchmarks/results/)
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests", "e2e"]
nox.options.reuse_existing_virtualenvs = True

VENV = {"venv_backend": "venv", "venv_params": ["--system-site-packages"]}
TRANSPORTS = ["object-store", "nixl", "straw"]


def _install(session: nox.Session) -> None:
    session.run("python", "-c", "import torch", silent=True)  # fails early with a clear message if torch is absent
    session.install("-e", ".[cpu,test]")


@nox.session(**VENV)
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(**VENV)
def tests(session: nox.Session) -> None:
    """The whole suite except GPU and end-to-end tests, acceptance spec included."""
    _install(session)
    session.run("pytest", "-m", "not gpu and not e2e", "--timeout=600", *session.posargs, env={"HF_HUB_OFFLINE": "1"})


@nox.session(name="transport", **VENV)
@nox.parametrize("transport", TRANSPORTS, ids=TRANSPORTS)
def transport_conformance(session: nox.Session, transport: str) -> None:
    """The conformance suite every transport passes, for one transport."""
    _install(session)
    session.run(
        "pytest",
        "tests/test_transport_conformance.py",
        "-k",
        transport,
        *session.posargs,
        env={"HF_HUB_OFFLINE": "1", "SLIME_TEST_TRANSPORT": transport},
    )


@nox.session(**VENV)
def e2e(session: nox.Session) -> None:
    _install(session)
    session.run("pytest", "-m", "e2e", *session.posargs, env={"HF_HUB_OFFLINE": "1"})


@nox.session(**VENV)
def bench(session: nox.Session) -> None:
    _install(session)
    session.run("python", "-m", "benchmarks.run", *session.posargs)
    session.run("python", "-m", "benchmarks.e2e")
