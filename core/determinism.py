"""`--deterministic`: a run that, killed and resumed any number of times, ends with exactly the weights of an
uninterrupted run of the same command.

Durable groups and joint commits already make a resumed run train each prompt group exactly once; this module
makes it train the *same* samples in the same order with the same arithmetic:

* every sample's sampling seed is derived from what identifies it, never from when or where it was generated:
  `sample_seed(run seed, prompt group index, sample index, rollout step)`, sent as `sampling_seed`, so a sample
  regenerated after a resume is the sample the killed run generated;
* rollout functions hand groups to the transport in queue order (the order the data source issued them), never in
  the order they finished;
* engines give each request the tokens and log-probabilities it would get alone (the CPU engine runs every
  request as its own batch, so batched matmuls never depend on what else was in flight);
* training backends use deterministic kernels, a fixed micro-batch and reduction order, and restore every RNG state
  from the joint checkpoint.

Which components can do that is part of their contract: `RolloutEngineSpec`, `TrainBackendSpec` and
`RolloutFunctionSpec` carry `deterministic`, a check called with the run's arguments (None: the component cannot).
`check_deterministic_run` runs when the arguments are parsed, before anything starts, and refuses a run whose
components cannot honour the flag, naming them. `check_reproducible_resume` refuses to continue a
`--deterministic` save directory with a different seed or batch shape (`reproducibility.json` records them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slime.utils.settings import Settings, flag, option

logger = logging.getLogger(__name__)

#: The file under a save directory that records what a `--deterministic` run must keep to stay reproducible.
RECORD_FILE = "reproducibility.json"
#: The kinds of components that must declare they honour `--deterministic`, with the flag that selects each.
DETERMINISTIC_KINDS = {
    "rollout_engines": ("rollout_engine", "cpu", "rollout engine"),
    "train_backends": ("train_backend", "torch", "train backend"),
    "rollout_functions": ("rollout_function_path", "sglang", "rollout function"),
}


def sample_seed(run_seed: int, group_index: int, sample_index: int, rollout_id: int) -> int:
    """The sampling seed of one sample: a hash of the run seed, its prompt group, its index and the rollout step
    that generates it (the policy version in a synchronous run), in [0, 2**63).

    Independent of engine, arrival order and concurrency, so a sample generated again after a resume is the same.
    """
    values = (run_seed, group_index, sample_index, rollout_id)
    words = b"".join(int(value).to_bytes(8, "little", signed=True) for value in values)
    return int.from_bytes(hashlib.blake2b(words, digest_size=8, person=b"slime-sample").digest(), "little") >> 1


@dataclass(frozen=True)
class ReproducibilityRecord(Settings):
    """What a `--deterministic` run records in `<save>/reproducibility.json` and must keep across reruns: its
    seeds and everything that shapes a step's batch. Field names are the flags' destinations."""

    rollout_seed: int = option("rollout_seed", 42, convert=int)
    seed: int = option("seed", 1234, convert=int)
    rollout_batch_size: int = option("rollout_batch_size", 8, convert=int)
    n_samples_per_prompt: int = option("n_samples_per_prompt", 4, convert=int)
    over_sampling_batch_size: int | None = option("over_sampling_batch_size", convert=int)
    global_batch_size: int | None = option("global_batch_size", convert=int)
    micro_batch_size: int = option("micro_batch_size", 8, convert=int)
    actor_num_nodes: int = option("actor_num_nodes", 1, convert=int)
    actor_num_gpus_per_node: int = option("actor_num_gpus_per_node", 1, convert=int)
    rollout_max_response_len: int = option("rollout_max_response_len", 16, convert=int)
    rollout_temperature: float = option("rollout_temperature", 1.0, convert=float)
    rollout_top_p: float = option("rollout_top_p", 1.0, convert=float)
    rollout_top_k: int = option("rollout_top_k", -1, convert=int)


@dataclass(frozen=True)
class DeterminismSettings(Settings):
    """See `--deterministic` in `slime-run --help`."""

    deterministic: bool = option("deterministic", False)
    rollout_seed: int = option("rollout_seed", 42, convert=int)


def _component_value(args: Any, dest: str, default: str) -> str:
    value = getattr(args, dest, None)
    return value if isinstance(value, str) and value else default


def check_deterministic_run(args: Any, registry: Any) -> None:
    """Refuse a `--deterministic` run with a component that cannot honour it; ValueError naming the component,
    the plugin that provides it and the way out. Each selected component's `deterministic` check runs too (it
    raises ValueError naming an option of the run it cannot honour).

    Only a `--deterministic` the user gave is refused: one a plugin defaulted (the demo turns it on) is turned off
    instead, with a warning giving the reason, so that the demo on a backend or engine that cannot honour it runs
    as it did before the flag existed."""
    if not DeterminismSettings.from_args(args).deterministic:
        return
    try:
        _check_components(args, registry)
    except ValueError as exc:
        if "deterministic" in getattr(args, "explicit_options", ()):
            raise
        args.deterministic = False
        logger.warning("--deterministic (a plugin's default) is off for this run: %s", exc)


def _check_components(args: Any, registry: Any) -> None:
    for kind, (dest, default, label) in DETERMINISTIC_KINDS.items():
        name = _component_value(args, dest, default)
        spec = registry.kinds[kind].get(name)
        if spec is None:
            raise ValueError(
                f"--deterministic: the {label} {name!r} ({flag(dest)}) is not a registered {label}, so it cannot "
                f"declare that it honours --deterministic; register it from a plugin with a `deterministic` check, "
                "or run without --deterministic"
            )
        if spec.deterministic is None:
            plugin = registry.providers.get((kind, name), "?")
            raise ValueError(
                f"--deterministic: the {label} {name!r} (plugin {plugin!r}) does not declare that it can make runs "
                f"reproducible; choose another {flag(dest)} or run without --deterministic (--no-deterministic)"
            )
        spec.deterministic(args)


def check_reproducible_resume(save: str | os.PathLike | None, args: Any) -> None:
    """Record, or check against the record, what a `--deterministic` run under `save` must keep.

    The first `--deterministic` run of a save directory writes `reproducibility.json` (durably, before anything
    else of the run); a later `--deterministic` run of it whose seeds or batch shape differ is refused with
    ValueError naming each option, the recorded value and the file. Runs without `--deterministic` neither write
    nor check it.
    """
    if save is None or not DeterminismSettings.from_args(args).deterministic:
        return
    path = Path(save) / RECORD_FILE
    current = asdict(ReproducibilityRecord.from_args(args))
    if not path.exists():
        from slime.utils.atomic_files import write_atomically

        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        record = json.dumps({"version": 1, "options": current}, indent=2) + "\n"
        write_atomically(path, lambda handle: handle.write(record), binary=False)
        return
    try:
        recorded = json.loads(path.read_text())["options"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path} is not a readable reproducibility record ({exc}); restore it from a backup, or use a new --save"
        ) from exc
    changed = [
        f"{flag(dest)} {current.get(dest)!r} (recorded: {value!r})"
        for dest, value in recorded.items()
        if current.get(dest) != value
    ]
    if changed:
        raise ValueError(
            f"this --deterministic run cannot continue {save}: {'; '.join(changed)} differ from what {path} recorded "
            "when the run started, so the resumed run would not reproduce the uninterrupted one. Restore the "
            "recorded values, use a new --save, or continue without reproducibility with --no-deterministic"
        )
