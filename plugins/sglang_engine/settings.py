"""The SGLang engine plugin's settings: what launching SGLang engines reads from the run's arguments.

Built once per launch with `SGLangEngineSettings.from_args(args)`; the plugin's `slime_configure` builds it
when the run's arguments are parsed (with `--rollout-engine sglang`), so a bad value fails before Ray starts.
Imports nothing heavy: the plugin registry imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime.utils.settings import Settings, option

STARTUP_TIMEOUT_S = 600.0


def _tokens(value: object) -> tuple[str, ...]:
    return tuple(str(token) for token in value)  # type: ignore[union-attr]


@dataclass(frozen=True)
class SGLangEngineSettings(Settings):
    """See the flags of the same names in `slime-run --help` (group "sglang engine")."""

    #: The model the engines serve (None: the built-in tiny model).
    hf_checkpoint: str | None = option("hf_checkpoint")
    #: Engine i samples with SGLang's `--random-seed` seed + i (unless --sglang-random-seed is given).
    seed: int = option("rollout_seed", 42, convert=int)
    #: Devices per engine: SGLang's tensor-parallel size unless --sglang-tp-size is given; Ray GPUs per engine
    #: actor when the machine has GPUs.
    gpus_per_engine: int = option("rollout_num_gpus_per_engine", 1, convert=int, minimum=1)
    startup_timeout_s: float = option("sglang_engine_startup_timeout", STARTUP_TIMEOUT_S, convert=float, above=0.0)
    #: Ports tried per engine before giving up (a port taken between choosing it and the server binding it).
    port_attempts: int = option("sglang_engine_port_attempts", 3, convert=int, minimum=1)
    #: Ray CPUs reserved per engine actor.
    num_cpus: float = option("sglang_engine_num_cpus", 0.0, convert=float, minimum=0.0)
    log_dir: str | None = option("sglang_engine_log_dir")
    #: The `--sglang-*` options given, in SGLang's spelling (`("--tp-size", "2", ...)`).
    server_args: tuple[str, ...] = option("sglang_server_args", (), convert=_tokens)
    #: The run's checkpoint directory: engine logs go to `<save>/logs/sglang-engines` without `log_dir`.
    save: str | None = option("save")

    def given(self, *sglang_flags: str) -> bool:
        """Whether the user passed any of `sglang_flags` (SGLang's spelling and its aliases, e.g. "--tp-size",
        "--tensor-parallel-size") through `--sglang-*`."""
        return any(flag in self.server_args for flag in sglang_flags)
