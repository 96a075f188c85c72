"""What a person running `slime-run` sees: a progress bar, metrics lines, a reward curve and a summary.

Driven by the driver's lifecycle hooks. Rollout metrics (reward, time) are written to `<save>/metrics.jsonl`
by the rollout manager (through `--metrics-dir`, which this plugin points at the logical `--save` directory:
a resumed run saves into a new branch directory, and its lines must continue the same file). This plugin
adds the trainers' metrics, the driver's phase times (`perf/*`) and commits to that file, shows a tqdm bar
over the run's steps (reward mean, step time, last commit) with a summary line above it every `--log-interval`
steps (`summary_line`), and at the last step draws
`<save>/reward_curve.png` from every run's lines (a step trained again after a crash counts with its latest
line) and prints where everything was written. Each run's report reads one `ReportSettings`, built from the
run's arguments when its first step reports.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime import hookimpl
from slime.observability.logging_utils import log_metrics, metrics_path
from slime.utils.settings import Settings, option

logger = logging.getLogger(__name__)

REWARD_KEY = "rollout/reward"


@dataclass(frozen=True)
class ReportSettings(Settings):
    """What the report shows and where it writes (see the flags of the same names in `slime-run --help`)."""

    #: The run's last step is `num_rollout - 1` (the driver sets it from `--num-epoch` when not given).
    num_rollout: int | None = option("num_rollout", convert=int)
    #: Set by the framework: the first step of this run (a resumed run starts after its checkpoint).
    start_rollout_id: int = option("start_rollout_id", 0, convert=int, minimum=0)
    save: str | None = option("save")
    metrics_dir: str | None = option("metrics_dir")
    hf_checkpoint: str | None = option("hf_checkpoint")
    rollout_data_dir: str | None = option("rollout_data_dir")
    log_interval: int = option("log_interval", 10, convert=int, minimum=1)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of a metrics file (a torn last line of a killed run is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def eval_rewards(metrics: dict[str, Any]) -> dict[str, float]:
    """`{dataset: mean reward}` of one eval metrics dict (`eval/<name>/reward` keys)."""
    return {
        key[len("eval/") : -len("/reward")]: float(value)
        for key, value in metrics.items()
        if key.startswith("eval/") and key.endswith("/reward")
    }


def eval_by_step(records: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """Each eval dataset's mean reward by step (a step evaluated again after a resume: its latest value)."""
    curves: dict[str, dict[int, float]] = {}
    for record in records:
        for name, reward in eval_rewards(record).items():
            curves.setdefault(name, {})[int(record["step"])] = reward
    return {name: dict(sorted(curve.items())) for name, curve in sorted(curves.items())}


def format_evals(evals: dict[str, float]) -> str:
    """`eval held 0.531` (one dataset) or `eval a 0.5 b 0.25`."""
    return "eval " + " ".join(f"{name} {reward:.3f}" for name, reward in evals.items())


def reward_by_step(records: list[dict[str, Any]]) -> dict[int, float]:
    """The reward mean of each step; when a step ran again after a resume, its latest value."""
    rewards: dict[int, float] = {}
    for record in records:
        if REWARD_KEY in record:
            rewards[int(record["step"])] = float(record[REWARD_KEY])
    return dict(sorted(rewards.items()))


#: The train metrics a summary line shows, when the step reports them: (label, metric key). The KL penalty only
#: with `--kl-coef`, the value loss only with a critic (`--use-critic`).
SUMMARY_TRAIN_METRICS = (
    ("loss", "train/loss"),
    ("grad_norm", "train/grad_norm"),
    ("entropy", "train/entropy"),
    ("kl_reward", "train/kl_reward"),
    ("value_loss", "critic/value_loss"),
)


def summary_line(
    steps: tuple[int, int],
    rewards: list[float],
    step_times: list[float],
    train: dict[str, float],
    last_commit: int | None,
    evals: dict[str, float] | None = None,
) -> str:
    """One console line for the steps `steps` (first, last): mean reward and step time over them, the last train
    metrics of `SUMMARY_TRAIN_METRICS`, the interval's last eval rewards (`evals`) and the last committed step."""
    span = f"step {steps[0]}" if steps[0] == steps[1] else f"steps {steps[0]}-{steps[1]}"
    parts = [span, f"reward {sum(rewards) / len(rewards):.3f}" if rewards else "reward ?"]
    if step_times:
        parts.append(f"{sum(step_times) / len(step_times):.1f}s/step")
    shown = [f"{label} {train[key]:.4g}" for label, key in SUMMARY_TRAIN_METRICS if key in train]
    if shown:
        parts.append(" ".join(shown))
    if evals:
        parts.append(format_evals(evals))
    parts.append("no commit yet" if last_commit is None else f"last commit {last_commit}")
    return " | ".join(parts)


def plot_reward_curve(rewards: dict[int, float], path: Path, evals: dict[str, dict[int, float]] | None = None) -> Path:
    """Draw the training reward mean over rollout steps, and each eval dataset's (`evals`), as a PNG
    (matplotlib, Agg backend); return `path`."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(list(rewards), list(rewards.values()), marker="o", markersize=3, label="train reward")
    for name, curve in (evals or {}).items():
        axes.plot(list(curve), list(curve.values()), marker="s", linestyle="--", label=f"eval {name}")
    if evals:
        axes.legend()
    axes.set_xlabel("rollout step")
    axes.set_ylabel("reward mean")
    axes.set_title("slime-run: reward")
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    partial = path.with_name(path.name + ".partial.png")
    figure.savefig(partial, dpi=100)
    plt.close(figure)
    partial.replace(path)
    return path


class RunReport:
    """The progress bar and the closing summary of one run (one per `--save` directory)."""

    def __init__(self, args: Any) -> None:
        from tqdm import tqdm

        settings = self.settings = ReportSettings.from_args(args)
        if settings.num_rollout is None:
            raise ValueError("the run's report needs --num-rollout (or --num-epoch, from which the run sets it)")
        self.num_rollout: int = settings.num_rollout
        self.args = args
        self.metrics_file = metrics_path(args)
        self.bar = tqdm(
            total=self.num_rollout,
            initial=settings.start_rollout_id,
            desc="rollout",
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=False,  # TQDM_DISABLE (logging_utils.QUIET_ENV) is meant for the libraries' bars
        )
        self.last_commit: tuple[int, str] | None = None
        self.postfix: dict[str, str] = {}
        self.finished = False
        #: What the next summary line averages or shows: the interval's first step, rewards and step times.
        self.interval_start: int | None = None
        self.interval_rewards: list[float] = []
        self.interval_step_times: list[float] = []
        self.train: dict[str, float] = {}
        #: The last evaluation's mean reward per dataset, and whether it ran in the current interval.
        self.evals: dict[str, float] = {}
        self.interval_evaluated = False

    def _show(self, refresh: bool) -> None:
        self.bar.set_postfix_str(" ".join(f"{key}={value}" for key, value in self.postfix.items()), refresh=refresh)

    def rollout_reward(self, rollout_id: int, metrics: dict[str, Any]) -> float | None:
        if REWARD_KEY in metrics:
            return float(metrics[REWARD_KEY])
        if self.metrics_file is None:
            return None
        return reward_by_step(read_metrics(self.metrics_file)).get(rollout_id)

    def after_rollout(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        reward = self.rollout_reward(rollout_id, metrics)
        if reward is not None:
            self.interval_rewards.append(reward)
        self.postfix["reward"] = "?" if reward is None else f"{reward:.3f}"
        self._show(refresh=True)

    def after_train_step(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        train = {
            key if "/" in key else f"train/{key}": value
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        if train:
            log_metrics(self.args, rollout_id, train)
            self.train = train

    def after_eval(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        """The bar shows the latest eval rewards; the next summary line too."""
        evals = eval_rewards(metrics)
        if evals:
            self.evals = evals
            self.interval_evaluated = True
            for name, reward in evals.items():
                self.postfix[name] = f"{reward:.3f}"
            self._show(refresh=True)

    def checkpoint_committed(self, rollout_id: int, path: str) -> None:
        self.last_commit = (rollout_id, path)
        log_metrics(self.args, rollout_id, {"checkpoint/committed": rollout_id})
        self.postfix["committed"] = str(rollout_id)
        self._show(refresh=True)

    def step_end(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        """The driver's phase times go to the metrics; the bar advances; the last step closes the run."""
        log_metrics(self.args, rollout_id, metrics)
        first = rollout_id if self.interval_start is None else self.interval_start
        self.interval_start = first
        if "perf/step_time" in metrics:
            self.postfix["step_time"] = f"{metrics['perf/step_time']:.1f}s"
            self.interval_step_times.append(float(metrics["perf/step_time"]))
        self._show(refresh=False)
        self.bar.update(1)
        last = rollout_id + 1 >= self.num_rollout
        if last or (rollout_id + 1) % self.settings.log_interval == 0:
            self.summarize((first, rollout_id))
        if last:
            self.finish()

    def summarize(self, steps: tuple[int, int]) -> None:
        """Print the summary line of `steps` (first, last), above the bar, and start a new interval."""
        commit = None if self.last_commit is None else self.last_commit[0]
        evals = self.evals if self.interval_evaluated else None
        line = summary_line(steps, self.interval_rewards, self.interval_step_times, self.train, commit, evals)
        self.bar.write(line, file=sys.stderr)
        self.interval_evaluated = False
        self.interval_start = None
        self.interval_rewards = []
        self.interval_step_times = []

    def finish(self) -> None:
        """Close the bar, draw the reward curve and print where the run's outputs are."""
        if self.finished:
            return
        self.finished = True
        self.bar.close()
        lines = ["", "slime-run finished"]
        if self.metrics_file is not None:
            records = read_metrics(self.metrics_file)
            rewards, evals = reward_by_step(records), eval_by_step(records)
            lines.append(f"  metrics:      {self.metrics_file}")
            if rewards:
                curve = plot_reward_curve(rewards, self.metrics_file.parent / "reward_curve.png", evals)
                first, last = next(iter(rewards.values())), list(rewards.values())[-1]
                lines.append(f"  reward curve: {curve}  (reward {first:.3f} -> {last:.3f})")
            for name, curve in evals.items():
                first, last = next(iter(curve.items())), list(curve.items())[-1]
                lines.append(f"  eval {name}: {first[1]:.3f} (step {first[0]}) -> {last[1]:.3f} (step {last[0]})")
        if self.settings.save:
            lines.append(f"  checkpoints:  {self.settings.save}")
        if self.last_commit is not None:
            step = self.last_commit[0]
            if step + 1 >= self.num_rollout:
                hint = "complete; rerun with a larger --num-rollout to continue"
            else:
                hint = "rerun the same command to resume"
            lines.append(f"  last commit:  step {step}  ({hint})")
        if self.settings.hf_checkpoint:
            lines.append(f"  model:        {self.settings.hf_checkpoint}")
        if self.settings.rollout_data_dir:
            lines.append(f"  rollout data: {self.settings.rollout_data_dir}")
        print("\n".join(lines), flush=True)


#: The report of each run's arguments, by `id(args)` (the driver passes the same object to every hook).
_reports: dict[int, RunReport] = {}


@hookimpl(trylast=True)
def slime_configure(args: Any) -> None:
    """Keep one metrics file per logical `--save`: a resumed run writes to a new branch directory, and its lines
    must continue the same reward log. Runs last, after plugins that choose `--save`."""
    settings = ReportSettings.from_args(args)
    if settings.metrics_dir is None and settings.save:
        args.metrics_dir = str(Path(settings.save).expanduser().resolve())


def _report(args: Any) -> RunReport:
    report = _reports.get(id(args))
    if report is None or report.finished or report.args is not args:
        report = _reports[id(args)] = RunReport(args)
    return report


@hookimpl
def slime_after_rollout(args: Any, rollout_id: int, metrics: dict[str, Any]) -> None:
    _report(args).after_rollout(rollout_id, metrics)


@hookimpl
def slime_after_train_step(args: Any, rollout_id: int, metrics: dict[str, Any]) -> None:
    _report(args).after_train_step(rollout_id, metrics)


@hookimpl
def slime_step_end(args: Any, rollout_id: int, metrics: dict[str, Any]) -> None:
    _report(args).step_end(rollout_id, metrics)


@hookimpl
def slime_checkpoint_committed(args: Any, rollout_id: int, path: str) -> None:
    _report(args).checkpoint_committed(rollout_id, path)


def print_eval_only_result(args: Any, rollout_id: int, metrics: dict[str, Any]) -> None:
    """What an `--eval-only` run prints: one line per dataset with its metrics, and where they were written."""
    lines = ["", f"slime-run evaluated the weights of step {rollout_id}"]
    for name in eval_rewards(metrics):
        prefix = f"eval/{name}/"
        shown = {key[len(prefix) :]: value for key, value in metrics.items() if key.startswith(prefix)}
        values = " ".join(f"{label} {value:.3f}" for label, value in shown.items())
        lines.append(f"  {name}: {values}")
    if (path := metrics_path(args)) is not None:
        lines.append(f"  metrics: {path}")
    print("\n".join(lines), flush=True)


@hookimpl
def slime_after_eval(args: Any, rollout_id: int, metrics: dict[str, Any]) -> None:
    if getattr(args, "eval_only", False):
        print_eval_only_result(args, rollout_id, metrics)
    else:
        _report(args).after_eval(rollout_id, metrics)
