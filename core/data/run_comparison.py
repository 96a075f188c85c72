"""`slime-run runs compare A B`: where the save directories of two runs differ, step by step.

For checking that a killed-and-resumed run reproduces an uninterrupted one, or for finding the first step at
which two runs diverge. It reads the two save directories (and the straw pools their records name) and never
writes:

* metrics: each run's `metrics.jsonl`, the last value per (step, key): a rerun after a kill logs a step again,
  later in the file, and that is the value that counts (as `slime.plugins.demo_report.reward_by_step` reads
  rewards). Every key both runs logged is compared, with exact equality (a reproducible run is bitwise equal),
  except timing and throughput keys (`is_timing_metric`), which differ between any two runs;
* trained samples: for each committed step of the final lineage, the samples it trained, followed through the
  straw records by the lineage audit (`trained_samples`), as sample index, group index and a sha256 of the
  tokens, response and reward, so equal ids with other content count as a difference. The object-store
  transport keeps no durable record of what a step trained;
* weights: the Hugging Face safetensors of each run's last checkpoint, tensor by tensor with `torch.equal`; when
  the runs' last checkpoints are different steps, the latest step both have.

The first divergence is the smallest step at which a metric or the trained samples differ; the weights, compared
at the end, decide only when every step agrees.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime.data.checkpoint import TRACKER, _is_checkpoint_dir
from slime.data.durable_files import DurableFileError
from slime.data.run_inspection import lineage, read_current

REWARD_KEY, LOSS_KEY = "rollout/reward", "train/loss"
#: Metric keys that measure time or speed, not what was trained: `perf/*` (the driver's phase times), `time`
#: (when a line was written), `rollout/time`, and any key named like a duration or a rate.
TIMING_PREFIXES = ("perf/",)
_TIMING_LEAF = re.compile(r"(^|_)(time|times|seconds|secs|sec|s|ms|per_s|per_sec|throughput|tps)$")
NOT_RECORDED = "not recorded (the object-store transport keeps no durable record of trained samples)"
#: What a sample's sha256 covers (also compared one by one, to say which of them differs).
SAMPLE_PARTS = ("tokens", "response", "reward")
#: How many differing tensors the weights comparison names with their largest difference.
SHOWN_TENSORS = 3
_ITER_DIR = re.compile(r"iter_(\d{7})")


def is_timing_metric(key: str) -> bool:
    """True for keys that measure time or throughput (`perf/step_time`, `time`, `rollout/time`, `x_s`, ...)."""
    name = key.lower()
    leaf = name.rsplit("/", 1)[-1]
    return name.startswith(TIMING_PREFIXES) or "throughput" in name or bool(_TIMING_LEAF.search(leaf))


def read_metric_values(path: Path) -> dict[int, dict[str, Any]]:
    """`{step: {key: value}}` from a `metrics.jsonl`, the last value per (step, key); a torn line is skipped."""
    steps: dict[int, dict[str, Any]] = {}
    if not path.is_file():
        return steps
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            continue
        values = steps.setdefault(step, {})
        values.update((key, value) for key, value in record.items() if key != "step")
    return dict(sorted(steps.items()))


# ------------------------------------------------------------------------------------------- trained samples


@dataclass(frozen=True)
class SampleIdentity:
    """One trained sample: its ids, and a sha256 of its tokens, response and reward (with a digest of each)."""

    index: int
    group_index: int | None
    sha256: str
    parts: tuple[str, ...]

    def label(self) -> str:
        return f"sample {self.index} (group {self.group_index})"


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()


def sample_identity(sample: Any) -> SampleIdentity:
    """The identity of a `slime.utils.types.Sample`."""
    content = {
        "tokens": [int(token) for token in sample.tokens],
        "response": sample.response,
        "reward": sample.reward,
    }
    parts = tuple(_digest(content[name]) for name in SAMPLE_PARTS)
    return SampleIdentity(int(sample.index), sample.group_index, _digest(content), parts)


def has_sample_records(save: Path) -> bool:
    """Whether `save` is a run with joint commits (the straw transport's branch records and commit markers: what
    each committed step trained); an object-store run keeps only model checkpoints."""
    return _is_checkpoint_dir(save) or (save / "branches").is_dir()


@dataclass
class TrainedSamples:
    """What each committed step of a run's final lineage trained; `recorded` is False for a run whose transport
    keeps no such record, and `problems` says what the lineage audit could not follow."""

    by_step: dict[int, list[SampleIdentity]] = field(default_factory=dict)
    recorded: bool = True
    problems: list[str] = field(default_factory=list)


def trained_samples(save: Path) -> TrainedSamples:
    """The samples each committed step of the final lineage of `save` trained, in the order it trained them."""
    save = Path(save)
    if not has_sample_records(save):
        return TrainedSamples(recorded=False)
    from slime.data.lineage_audit import trained_sample_records

    try:
        samples, report = trained_sample_records(save)
    except DurableFileError as exc:
        return TrainedSamples(problems=[str(exc)])
    by_step = {step: [sample_identity(sample) for sample in found] for step, found in samples.items()}
    problems = [f"[{v.check}] {v.message}" for v in report.violations]
    return TrainedSamples(by_step, True, problems)


def compare_samples(a: Sequence[SampleIdentity], b: Sequence[SampleIdentity]) -> list[str]:
    """What differs between the samples two runs trained at one step (empty when they are the same, in order)."""
    by_a = {sample.index: sample for sample in a}
    by_b = {sample.index: sample for sample in b}
    found = []
    for mine, theirs, side in ((a, by_b, "A"), (b, by_a, "B")):
        only = [sample for sample in mine if sample.index not in theirs]
        if only:
            more = f" (and {len(only) - 1} more)" if len(only) > 1 else ""
            found.append(f"{only[0].label()} trained only in {side}{more}")
    changed = [
        (sample, by_b[sample.index])
        for sample in a
        if sample.index in by_b
        and (sample.sha256, sample.group_index) != (by_b[sample.index].sha256, by_b[sample.index].group_index)
    ]
    if changed:
        mine, theirs = changed[0]
        what = [name for name, x, y in zip(SAMPLE_PARTS, mine.parts, theirs.parts, strict=True) if x != y]
        if mine.group_index != theirs.group_index:
            what.insert(0, f"group ({mine.group_index} vs {theirs.group_index})")
        found.append(f"{mine.label()} {', '.join(what)} differ ({len(changed)} of {len(a)} samples differ)")
    if not found and len(a) == len(b) and [s.index for s in a] != [s.index for s in b]:
        position = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x.index != y.index)
        found.append(
            f"the same samples trained in another order (position {position}: {a[position].label()} in A, "
            f"{b[position].label()} in B)"
        )
    if not found and len(a) != len(b):
        found.append(f"{len(a)} samples trained in A, {len(b)} in B")
    return found


# ------------------------------------------------------------------------------------------- weights


def _records_origin(save: Path) -> Path | None:
    """The save directory a copied or moved run's records still name (`rollout/current.json`), or None."""
    try:
        current = read_current(save)
    except DurableFileError:
        return None
    if not current:
        return None
    directory = Path(current["directory"]).resolve()
    origin = directory.parent.parent if directory.parent.name == "branches" else directory
    return None if origin == save else origin


def _relocate(save: Path, origin: Path | None, directory: Path) -> Path:
    """`directory` (named by records written under `origin`) inside `save`, when `save` is a copy of `origin`."""
    if origin is None or not directory.is_relative_to(origin):
        return directory
    moved = save / directory.relative_to(origin)
    return moved if moved.is_dir() else directory


def checkpoints(save: Path, notes: list[str], label: str) -> dict[int, Path]:
    """`{step: model checkpoint directory}` of a run: the joint commits of its final lineage (straw), else the
    `iter_<step>` directories up to its tracker (a run without joint commits)."""
    if has_sample_records(save):
        origin = _records_origin(save)
        try:
            segments = lineage(save)
        except DurableFileError as exc:
            notes.append(f"{label}: the lineage cannot be read, so its checkpoints are unknown: {exc}")
            return {}
        return {
            step: _relocate(save, origin, segment.directory) / f"iter_{step:07d}"
            for segment in segments
            for step in segment.commits
        }
    tracker = None
    if (save / TRACKER).is_file():
        try:
            tracker = int((save / TRACKER).read_text().strip())
        except ValueError:
            notes.append(f"{label}: {save / TRACKER} does not hold a step number; every iter_<step> directory counts")
    found = {}
    for path in save.glob("iter_*"):
        match = _ITER_DIR.fullmatch(path.name)
        if match and path.is_dir() and (tracker is None or int(match.group(1)) <= tracker):
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


@dataclass
class WeightComparison:
    """The model weights of both runs: `outcome` is "equal", "differ" or "not compared" (`note` says why)."""

    last_a: int | None = None
    last_b: int | None = None
    #: The step compared: the runs' last checkpoint, or the latest step both have one of.
    step: int | None = None
    directory_a: str | None = None
    directory_b: str | None = None
    outcome: str = "not compared"
    tensors: int = 0
    #: `{"tensor": name, "problem": ..., "max_abs_diff": float | None}` per differing tensor, by name.
    differing: list[dict[str, Any]] = field(default_factory=list)
    #: Why the weights were not compared, or how they differ when no tensor can say (a checkpoint only one run
    #: has), or at which step they were compared when the last checkpoints are different steps.
    note: str | None = None

    def difference(self) -> str:
        """The weights' difference in words (for the verdict)."""
        if not self.differing:
            return f"weights: {self.note}"
        first = self.differing[0]
        diff = f" (max abs diff {first['max_abs_diff']:.6g})" if first["max_abs_diff"] is not None else ""
        more = f", and {len(self.differing) - 1} more of {self.tensors} tensors" if len(self.differing) > 1 else ""
        return f"weights of step {self.step}: tensor {first['tensor']} {first['problem']}{diff}{more}"


def _tensor_files(directory: Path) -> dict[str, Path]:
    """`{tensor name: safetensors file}` of a Hugging Face checkpoint directory (one file or shards)."""
    from safetensors import safe_open

    names: dict[str, Path] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            names.update(dict.fromkeys(handle.keys(), path))
    return names


def _load_tensor(path: Path, name: str) -> Any:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor(name)


def compare_tensors(directory_a: Path, directory_b: Path) -> tuple[int, list[dict[str, Any]]]:
    """`(tensors compared, differing tensors)` of two Hugging Face safetensors checkpoint directories, one tensor
    in memory at a time."""
    import torch

    files_a, files_b = _tensor_files(directory_a), _tensor_files(directory_b)
    differing: list[dict[str, Any]] = []
    for name in sorted(files_a.keys() | files_b.keys()):
        if name not in files_b or name not in files_a:
            side = "A" if name in files_a else "B"
            differing.append({"tensor": name, "problem": f"exists only in {side}", "max_abs_diff": None})
            continue
        a, b = _load_tensor(files_a[name], name), _load_tensor(files_b[name], name)
        if a.shape != b.shape or a.dtype != b.dtype:
            problem = f"is {list(a.shape)} {a.dtype} in A, {list(b.shape)} {b.dtype} in B"
            differing.append({"tensor": name, "problem": problem, "max_abs_diff": None})
        elif not torch.equal(a, b):
            diff = (a.to(torch.float64) - b.to(torch.float64)).abs().max().item()
            differing.append({"tensor": name, "problem": "differs", "max_abs_diff": diff})
    return len(files_a.keys() | files_b.keys()), differing


def compare_weights(save_a: Path, save_b: Path, notes: list[str]) -> WeightComparison:
    """Compare the weights of the runs' last checkpoints, or of the latest step both have (see `WeightComparison`)."""
    from safetensors import SafetensorError

    found_a, found_b = checkpoints(save_a, notes, "A"), checkpoints(save_b, notes, "B")
    result = WeightComparison(max(found_a, default=None), max(found_b, default=None))
    if not found_a and not found_b:
        result.note = "no checkpoint in either run"
        return result
    if not found_a or not found_b:
        have, last = ("A", result.last_a) if found_a else ("B", result.last_b)
        result.outcome, result.step = "differ", last
        result.note = f"only {have} has a checkpoint (its last: step {last})"
        return result
    common = sorted(found_a.keys() & found_b.keys())
    if not common:
        result.outcome = "differ"
        result.note = f"no step has a checkpoint in both runs (A: steps {sorted(found_a)}, B: steps {sorted(found_b)})"
        return result
    result.step = common[-1]
    directory_a, directory_b = found_a[result.step], found_b[result.step]
    result.directory_a, result.directory_b = str(directory_a), str(directory_b)
    for label, directory in (("A", directory_a), ("B", directory_b)):
        if not any(directory.glob("*.safetensors")):
            kind = " (a Megatron dist checkpoint)" if (directory / "dist").is_dir() else ""
            result.note = (
                f"{label}'s checkpoint of step {result.step} ({directory}) holds no Hugging Face safetensors "
                f"weights{kind}: not comparable"
            )
            return result
    try:
        result.tensors, result.differing = compare_tensors(directory_a, directory_b)
    except (OSError, ValueError, SafetensorError) as exc:
        result.note = f"the weights of step {result.step} cannot be read ({type(exc).__name__}: {exc})"
        return result
    result.outcome = "differ" if result.differing else "equal"
    if result.last_a != result.last_b:
        result.note = (
            f"the last checkpoints differ (A: step {result.last_a}, B: step {result.last_b}); compared at step "
            f"{result.step}, the latest step both runs have a checkpoint of"
        )
    return result


# ------------------------------------------------------------------------------------------- comparison


@dataclass
class StepComparison:
    """One step of both runs: the compared metrics of each, what differs, and the trained samples' verdict."""

    step: int
    metrics_a: dict[str, Any]
    metrics_b: dict[str, Any]
    #: `{key: [value in A, value in B]}` (None: the run has no value for the key at this step), the reward and
    #: the loss first.
    differing_metrics: dict[str, list[Any]] = field(default_factory=dict)
    #: "equal", "differ", "not recorded" (a run keeps no sample records) or "not committed" (in neither run).
    samples: str = "not recorded"
    sample_counts: list[int | None] = field(default_factory=lambda: [None, None])
    sample_differences: list[str] = field(default_factory=list)

    def differences(self) -> list[str]:
        """What differs at this step in words: the trained samples first (they decide the rest), then metrics."""
        shown = [f"{key} {_value(a)} vs {_value(b)}" for key, (a, b) in self.differing_metrics.items()]
        return [*self.sample_differences, *shown]


def _value(value: Any) -> str:
    return "(absent)" if value is None else repr(value) if isinstance(value, float) else json.dumps(value)


def _same(a: Any, b: Any) -> bool:
    """Exact equality, where two NaNs are the same value (a run that logs NaN reproduces NaN)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@dataclass
class RunComparison:
    """What `slime-run runs compare A B` reports."""

    a: Path
    b: Path
    compared_metrics: list[str]
    excluded_metrics: list[str]
    only_in_a: list[str]
    only_in_b: list[str]
    samples_a: str
    samples_b: str
    steps: list[StepComparison]
    weights: WeightComparison
    notes: list[str]

    @property
    def first_divergence(self) -> tuple[int | None, list[str]] | None:
        """`(step, what differs there)` of the first step that differs, else the weights' difference, else None."""
        for step in self.steps:
            found = step.differences()
            if found:
                return step.step, found
        if self.weights.outcome == "differ":
            return self.weights.step, [self.weights.difference()]
        return None

    @property
    def identical(self) -> bool:
        return self.first_divergence is None

    def verdict(self) -> str:
        """The one-line result: IDENTICAL with what was compared, or DIVERGE at the first step that differs."""
        first = self.first_divergence
        if first is not None:
            step, found = first
            where = f"at step {step}" if step is not None else "in the weights"
            more = f"; {len(found) - 1} more difference(s) at step {step}" if len(found) > 1 else ""
            return f"DIVERGE {where}: {found[0]}{more}"
        samples = self.samples_a == "recorded" and self.samples_b == "recorded"
        weights = self.weights.outcome == "equal"
        equal = ", ".join(["every metric", *(["sample"] if samples else [])])
        equal = f"{equal} and weight tensor" if weights else equal.replace(", sample", " and sample")
        caveats = [
            *([] if samples else ["sample ids not recorded"]),
            *([] if weights else [f"weights not compared: {self.weights.note}"]),
        ]
        caveat = f" ({'; '.join(caveats)})" if caveats else ""
        return f"IDENTICAL: {len(self.steps)} steps, {equal} equal{caveat}"


def require_run_dir(path: Path) -> None:
    """Raise `DurableFileError` unless `path` is the `--save` directory of a run (straw or object store)."""
    if not path.is_dir():
        raise DurableFileError(path, "no such directory", "pass the --save directory of a slime-run run")
    plain = (path / "metrics.jsonl").is_file() or (path / TRACKER).is_file()
    plain = plain or any(_ITER_DIR.fullmatch(child.name) for child in path.glob("iter_*"))
    if not (plain or _is_checkpoint_dir(path) or (path / "branches").is_dir()):
        raise DurableFileError(
            path,
            "is not a slime-run save directory (it has no metrics.jsonl, latest_checkpointed_iteration.txt, "
            "iter_<step> directory or rollout/ commit records)",
            "pass the --save directory of a slime-run run",
        )


def _samples_note(label: str, samples: TrainedSamples) -> list[str]:
    if not samples.recorded:
        return []
    if samples.problems:
        return [
            f"{label}: the lineage audit found {len(samples.problems)} problem(s), so the samples of some steps may be "
            f"missing (slime-run runs audit tells more); the first: {samples.problems[0]}"
        ]
    return []


def compare_runs(save_a: Path, save_b: Path) -> RunComparison:
    """Compare the runs saved under `save_a` and `save_b` (see the module docstring)."""
    save_a, save_b = Path(save_a).resolve(), Path(save_b).resolve()
    require_run_dir(save_a)
    require_run_dir(save_b)
    notes: list[str] = []
    metrics_a = read_metric_values(save_a / "metrics.jsonl")
    metrics_b = read_metric_values(save_b / "metrics.jsonl")
    for label, save, found in (("A", save_a, metrics_a), ("B", save_b, metrics_b)):
        if not found:
            notes.append(f"{label}: {save / 'metrics.jsonl'} is missing or holds no metrics")
    keys_a = {key for values in metrics_a.values() for key in values}
    keys_b = {key for values in metrics_b.values() for key in values}
    excluded = sorted(key for key in keys_a | keys_b if is_timing_metric(key))
    compared = sorted((keys_a & keys_b) - set(excluded))
    samples_a, samples_b = trained_samples(save_a), trained_samples(save_b)
    for label, save, samples in (("A", save_a, samples_a), ("B", save_b, samples_b)):
        notes += _samples_note(label, samples)
        origin = _records_origin(save) if samples.recorded else None
        if origin is not None:
            notes.append(
                f"{label}: its records name {origin} (it is a copy or was moved from there): its trained samples are "
                "read where the records point, its weights from its own files"
            )
    both_recorded = samples_a.recorded and samples_b.recorded
    steps = []
    for step in sorted(metrics_a.keys() | metrics_b.keys() | samples_a.by_step.keys() | samples_b.by_step.keys()):
        values_a, values_b = metrics_a.get(step, {}), metrics_b.get(step, {})
        comparison = StepComparison(
            step,
            {key: values_a[key] for key in compared if key in values_a},
            {key: values_b[key] for key in compared if key in values_b},
        )
        for key in sorted(compared, key=lambda key: (key != REWARD_KEY, key != LOSS_KEY, key)):
            a, b = values_a.get(key), values_b.get(key)
            if (key in values_a or key in values_b) and not (key in values_a and key in values_b and _same(a, b)):
                comparison.differing_metrics[key] = [a, b]
        found_a, found_b = samples_a.by_step.get(step), samples_b.by_step.get(step)
        if both_recorded and (found_a is not None or found_b is not None):
            comparison.sample_counts = [
                None if found_a is None else len(found_a),
                None if found_b is None else len(found_b),
            ]
            if found_a is None or found_b is None:
                missing = "A" if found_a is None else "B"
                comparison.sample_differences = [f"{missing} has no record of the samples step {step} trained"]
            else:
                comparison.sample_differences = compare_samples(found_a, found_b)
            comparison.samples = "differ" if comparison.sample_differences else "equal"
        elif both_recorded:
            comparison.samples = "not committed"
        steps.append(comparison)
    weights = compare_weights(save_a, save_b, notes)
    return RunComparison(
        save_a,
        save_b,
        compared,
        excluded,
        sorted((keys_a - keys_b) - set(excluded)),
        sorted((keys_b - keys_a) - set(excluded)),
        "recorded" if samples_a.recorded else NOT_RECORDED,
        "recorded" if samples_b.recorded else NOT_RECORDED,
        steps,
        weights,
        notes,
    )
