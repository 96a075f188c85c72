"""The SGLang rollout engine plugin: `--rollout-engine sglang` serves rollouts with real SGLang servers.

Built in (entry point `sglang_engine`), and imported whenever the plugin registry is built, so this module
imports nothing heavy and never SGLang itself: SGLang is imported only by the engines' server processes and
by the short subprocesses that read and check its server options (`server_args`).

- `launcher.launch_sglang_engines`: one Ray actor per engine, each owning a `python -m sglang.launch_server`
  process (CPU-only machines included; see the launcher's docstring).
- `server_args`: every SGLang server option as `--sglang-<name>`, validated by SGLang's own parser when the
  run's arguments are parsed.
- `settings.SGLangEngineSettings`: the plugin's typed settings.

Install: `pip install 'slime-rl[sglang]'` on GPU machines; on CPU-only machines see requirements/sglang-cpu.txt
(`nox -s sglang` builds such an environment and runs the plugin's tests).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from slime import hookimpl
from slime.plugins.sglang_engine.settings import STARTUP_TIMEOUT_S, SGLangEngineSettings
from slime.specs import RolloutEngineSpec

ENGINE_NAME = "sglang"


def _launch(args: Any, num_engines: int) -> Any:
    """The engine launcher (`slime.backend_interfaces.EngineLauncher`); imports Ray and the launcher lazily."""
    from slime.plugins.sglang_engine.launcher import launch_sglang_engines

    return launch_sglang_engines(args, num_engines)


def _resources(args: Any) -> dict[str, float]:
    """What one engine asks Ray for (`slime.specs.RolloutEngineSpec.resources`); imports the launcher lazily."""
    from slime.plugins.sglang_engine.launcher import engine_resources

    return engine_resources(args)


@hookimpl
def slime_rollout_engines() -> Iterable[RolloutEngineSpec]:
    return [
        RolloutEngineSpec(
            ENGINE_NAME,
            _launch,
            "SGLang servers (sglang.launch_server; CPU-only machines included), one Ray actor each",
            resources=_resources,
        )
    ]


@hookimpl(trylast=True)
def slime_configure(args: Any) -> None:
    """With `--rollout-engine sglang`: check the plugin's options, that SGLang is installed, and have SGLang's
    parser accept the `--sglang-*` options, before any engine (or Ray) starts."""
    if getattr(args, "rollout_engine", None) != ENGINE_NAME:
        return
    from slime.plugins.sglang_engine.launcher import check_host
    from slime.plugins.sglang_engine.server_args import SGLangUnavailableError, check_server_args

    settings = SGLangEngineSettings.from_args(args)
    check_host(settings)
    try:
        check_server_args(list(settings.server_args))
    except SGLangUnavailableError as exc:  # the user's environment to fix: reported like a bad flag
        raise ValueError(str(exc)) from exc


@hookimpl
def slime_addoption(parser: Any) -> None:
    from slime.plugins.sglang_engine.server_args import add_server_options, installed_version

    version = installed_version()
    listed = (
        "every SGLang server option is accepted as --sglang-<name> (listed below, with SGLang's help) and checked "
        "by SGLang's own parser"
        if version
        else "every SGLang server option is accepted as --sglang-<name> once SGLang is installed (then listed here)"
    )
    group = parser.add_argument_group(
        "sglang engine",
        f"--rollout-engine sglang (SGLang {version or 'not installed'}): {listed}. slime-rl sets --model-path "
        "(--hf-checkpoint), --host/--port, --random-seed (--rollout-seed + engine index), --tp-size "
        "(--rollout-num-gpus-per-engine) and, on machines without a GPU, --device cpu with CUDA graphs off; any of "
        "these except the model path and port can be overridden with --sglang-*.",
    )
    group.add_argument(
        "--rollout-num-gpus-per-engine",
        type=int,
        default=1,
        help="devices per engine: SGLang's tensor-parallel size (unless --sglang-tp-size) and Ray GPUs per engine",
    )
    group.add_argument(
        "--sglang-engine-startup-timeout",
        type=float,
        default=STARTUP_TIMEOUT_S,
        help="seconds an engine may take to load its model and answer /health_generate",
    )
    group.add_argument(
        "--sglang-engine-port-attempts",
        type=int,
        default=3,
        help="ports tried per engine when the chosen one is taken before the server binds it",
    )
    group.add_argument("--sglang-engine-num-cpus", type=float, default=0, help="Ray CPUs reserved per engine actor")
    group.add_argument(
        "--sglang-engine-log-dir",
        default=None,
        help="where each engine's server log goes (default: <save>/logs/sglang-engines, else a temporary directory)",
    )
    add_server_options(group)
    parser.set_defaults(sglang_server_args=None)  # the mirrored options' destination, also without SGLang
