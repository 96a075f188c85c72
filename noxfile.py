"""Test sessions. `nox` runs lint and the test suite; nothing here needs a GPU.

Sessions reuse the torch already installed on the machine (venvs see system site packages), so no
session ever downloads a CUDA build of torch: install it first with `pip install torch==2.13.0`.

    nox                      lint + tests + e2e + sglang (the CI default)
    nox -s "transport(straw)"  the transport conformance suite of one transport (object-store, nixl, straw)
    nox -s e2e               end-to-end CPU runs (slow; those marked `extended` are left out)
    nox -s extended          the end-to-end runs beyond CI's time budget (marker `extended`)
    nox -s sglang            the SGLang engine plugin against real SGLang 0.5.19 servers on CPU (own venv)
    nox -s megatron          the Megatron train backend (megatron-core 0.16.1) on CPU over gloo: TP, PP, DP
    nox -s bench             benchmarks/: transport.py and e2e.py (JSON reports under benchmarks/results/)
"""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree

import nox

nox.options.sessions = ["lint", "tests", "e2e", "megatron", "sglang"]
nox.options.reuse_existing_virtualenvs = True

VENV = {"venv_backend": "venv", "venv_params": ["--system-site-packages"]}
TRANSPORTS = ["object-store", "nixl", "straw"]
#: A separately installable transport built on the plugin interface; the suite and the e2e sessions run its tests.
CONTRIB_TRANSPORT = "contrib/slime-safetensors-transport"
#: Experiment-tracker plugins (observers, off unless --use-tensorboard / --use-wandb / --use-trackio); the suite and
#: e2e run their tests. Installed with their dependencies (tensorboardX, wandb, trackio; tensorboard for reading
#: events back in tests).
CONTRIB_TRACKERS = ("contrib/slime-tensorboard[test]", "contrib/slime-wandb[test]", "contrib/slime-trackio[test]")


def _install(session: nox.Session, extras: str = "cpu,test") -> None:
    session.run("python", "-c", "import torch", silent=True)  # fails early with a clear message if torch is absent
    session.install("-e", f".[{extras}]")


def _install_suite(session: nox.Session) -> None:
    """The project with the router, math and data extras (their tests run), the contrib transport and the contrib
    trackers (their tests run). The trackers' dependencies come in with them; the machine's torch stays (nothing
    they need asks for another)."""
    _install(session, "cpu,test,router,math,data,lora")
    session.install("--no-deps", "-e", CONTRIB_TRANSPORT)
    session.install(*(argument for tracker in CONTRIB_TRACKERS for argument in ("-e", tracker)))


def _run_suite(session: nox.Session, markers: str, *options: str) -> None:
    """Install the suite's packages and run pytest on the tests `markers` selects (none selected fails: exit 5)."""
    _install_suite(session)
    session.run("python", "-m", "pytest", "-m", markers, *options, *session.posargs, env={"HF_HUB_OFFLINE": "1"})


@nox.session(**VENV)
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(**VENV)
def tests(session: nox.Session) -> None:
    """The whole suite except GPU and end-to-end tests, acceptance spec and contrib transport included."""
    _run_suite(session, "not gpu and not e2e and not sglang and not megatron", "--timeout=600")


@nox.session(name="transport", **VENV)
@nox.parametrize("transport", TRANSPORTS, ids=TRANSPORTS)
def transport_conformance(session: nox.Session, transport: str) -> None:
    """slime.testing's conformance suite for one transport; fails when no test of it ran."""
    _install(session)
    # Not under session.create_tmp(): it points TMPDIR there, and Ray's socket paths under it grow too long.
    report = f"{session.virtualenv.location}/conformance-{transport}.xml"
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/test_transport_conformance.py",
        f"--slime-transport={transport}",
        f"--junitxml={report}",
        "--timeout=600",
        *session.posargs,
        env={"HF_HUB_OFFLINE": "1"},
        success_codes=[0, 5],  # 5: no test collected; failing tests (1) end the session here
    )
    suite = ElementTree.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    skipped = int(suite.get("skipped", 0))
    ran = int(suite.get("tests", 0)) - skipped
    session.log(f"transport({transport}): {ran} conformance tests ran, {skipped} skipped")
    if ran == 0:
        session.error(f"transport({transport}): no conformance test ran (pytest selected none of its tests)")


@nox.session(**VENV)
def e2e(session: nox.Session) -> None:
    _run_suite(session, "e2e and not sglang and not megatron and not extended", "--durations=15")


@nox.session(**VENV)
def extended(session: nox.Session) -> None:
    """End-to-end runs left out of CI to keep it within its time budget (marker `extended`): the demo trained to its
    target by each estimator (PPO with a critic included) and by the torch backend's bf16 and FSDP runs, LoRA's
    reward rise, the object-store transport's killed-run reproducibility and the quick end-to-end benchmark's own
    check."""
    _run_suite(session, "extended and not sglang and not megatron", "--durations=15")


SGLANG_CONSTRAINTS = "requirements/sglang-cpu-constraints.txt"


@nox.session(**VENV)
def sglang(session: nox.Session) -> None:
    """The SGLang engine plugin's tests (tests/sglang_engine, marker `sglang`) against real SGLang servers on CPU.

    A virtualenv of its own: SGLang 0.5.19 pins transformers 5.12.1, older than the project's. SGLang is installed
    without its CUDA dependencies plus what its CPU path imports (requirements/sglang-cpu.txt), with constraints
    that keep the machine's torch 2.13.0; the project goes in with the same constraints.
    """
    session.run("python", "-c", "import torch", silent=True)
    session.install("--no-deps", "sglang==0.5.19", "-c", SGLANG_CONSTRAINTS)
    session.install("-r", "requirements/sglang-cpu.txt", "-c", SGLANG_CONSTRAINTS)
    session.install("-e", ".[cpu,test,router]", "-c", SGLANG_CONSTRAINTS)
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/sglang_engine",
        "-m",
        "sglang",
        "--timeout=900",
        "--durations=10",
        *session.posargs,
        env={"HF_HUB_OFFLINE": "1"},
    )


@nox.session(**VENV)
def megatron(session: nox.Session) -> None:
    """The Megatron train backend's tests (tests/megatron_backend, marker `megatron`, end-to-end runs included) on CPU.

    A virtualenv of its own with the pinned megatron-core (`.[megatron]`); the machine's torch stays (a
    constraint keeps the resolver from replacing it with a CUDA build).
    """
    session.run("python", "-c", "import torch", silent=True)
    # Not under session.create_tmp(): it points TMPDIR there, and Ray's socket paths under it grow too long.
    constraint = f"{session.virtualenv.location}/torch-constraint.txt"
    torch_version = session.run("python", "-c", "import torch; print(torch.__version__.split('+')[0])", silent=True)
    with open(constraint, "w") as handle:
        handle.write(f"torch=={torch_version.strip()}\n")
    session.install("-e", ".[cpu,test,megatron]", "-c", constraint)
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/megatron_backend",
        "-m",
        "megatron",
        "--timeout=900",
        "--durations=10",
        *session.posargs,
        env={"HF_HUB_OFFLINE": "1"},
    )


@nox.session(**VENV)
def bench(session: nox.Session) -> None:
    _install(session)
    session.install("trl>=1.0")  # the peer row of benchmarks/e2e.py
    session.run("python", "-m", "benchmarks.run", *session.posargs)
    session.run("python", "-m", "benchmarks.e2e")
