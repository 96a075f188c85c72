"""The CPU engine plugin's settings: what launching CPU engines reads from the run's arguments.

`launch_cpu_engines(args, num_engines)` builds `CPUEngineSettings.from_args(args)` once and reads only it;
the plugin's `slime_configure` validates the "cpu engine" option group when the run's arguments are parsed, with
errors that name the flag. Attributes `args` lacks take the flags' defaults. Imports nothing heavy: the
plugin registry imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime.utils.settings import Settings, option

ENGINE_STARTUP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class CPUEngineSettings(Settings):
    """See the flags of the same names in `slime-run --help` (group "cpu engine")."""

    #: The model the engines serve (None: the built-in tiny model).
    hf_checkpoint: str | None = option("hf_checkpoint")
    #: Engine i seeds its sampling with `seed` + i.
    seed: int = option("rollout_seed", 42, convert=int)
    max_batch_size: int = option("cpu_engine_max_batch_size", 32, convert=int, minimum=1)
    batch_wait_ms: float = option("cpu_engine_batch_wait_ms", 5.0, convert=float, minimum=0.0)
    #: Ray CPUs reserved per engine (0: engines never starve training ranks of scheduling slots).
    num_cpus: float = option("cpu_engine_num_cpus", 0.0, convert=float, minimum=0.0)
    num_threads: int = option("cpu_engine_num_threads", 1, convert=int, minimum=1)
    startup_timeout_s: float = option("cpu_engine_startup_timeout", ENGINE_STARTUP_TIMEOUT_S, convert=float, above=0.0)
    log_dir: str | None = option("cpu_engine_log_dir")
    #: The run's checkpoint directory: engine logs go to `<save>/logs/cpu-engines` without `log_dir`.
    save: str | None = option("save")
    #: `--deterministic`: each request's inputs are batched on their own (see `batch_per_request`).
    deterministic: bool = option("deterministic", False)
    #: Set by the framework: the destinations given on the command line.
    explicit_options: frozenset[str] = option("explicit_options", frozenset(), convert=frozenset)

    @property
    def batch_per_request(self) -> bool:
        """Under `--deterministic` a batch holds one `/generate` request's inputs (in chunks of `max_batch_size`), so
        no row's matmuls depend on what else was in flight: a row's result can change with the batch's size and
        padding, and which requests arrive together is timing. Otherwise requests arriving within
        `batch_wait_ms` share batches."""
        return self.deterministic

    def check_deterministic(self) -> None:
        """ValueError when `--deterministic` meets an explicit `--cpu-engine-batch-wait-ms`, which it cannot honour."""
        if self.deterministic and "cpu_engine_batch_wait_ms" in self.explicit_options:
            raise ValueError(
                f"--deterministic batches each request's own inputs and never waits for others; drop "
                f"--cpu-engine-batch-wait-ms {self.batch_wait_ms:g} (or run without --deterministic)"
            )
