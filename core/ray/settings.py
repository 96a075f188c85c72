"""The orchestration's settings: what the driver, placement, serving, the rollout manager and the training
groups read from the run's arguments, each built once and validated there.

- `DriverSettings`: the training loop (`slime.train.train`) and the step count `create_rollout_manager` settles;
- `ClusterSettings`: the training ranks' placement and creation (`slime.ray.placement_group`);
- `ServingSettings`: the engines and router `launch_rollout_servers` starts (`slime.ray.serving`);
- `ManagerSettings`: the rollout manager (`slime.ray.rollout.RolloutManager`);
- `TrainGroupSettings`: one training role's group and its weight updates (`slime.ray.actor_group.RayTrainGroup`);
- `InputSettings`: the model directory and prompt file `check_run_inputs` checks before Ray starts.

Errors name the flag ("--save-interval must be >= 1, got 0"). Attributes `args` lacks, or holds as None, take the
flags' defaults, so tools and tests may build these from a namespace holding only a few attributes. `args`
itself still travels, unchanged, to what takes it (plugins, Ray actors, hooks, the transport).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slime.data.prompt_sources import PromptSource, parse_prompt_data
from slime.ray.layout import resource_items
from slime.ray.router import ROUTER_CHOICES, router_for
from slime.utils.settings import Settings, option, options_from_args
from slime.weight_sync import DEFAULT_BUCKET_BYTES, TRANSPORTS, canonical_transport

if TYPE_CHECKING:
    from slime.plugin_manager import PluginSelection

__all__ = [
    "DEFAULT_DATA_SOURCE",
    "DEFAULT_ROLLOUT_FUNCTION",
    "ClusterSettings",
    "DriverSettings",
    "InputSettings",
    "ManagerSettings",
    "ServingSettings",
    "TrainGroupSettings",
    "check_run_settings",
]

#: The data source and rollout function of a run whose arguments name none (the parser's defaults).
DEFAULT_DATA_SOURCE = "prompts"
DEFAULT_ROLLOUT_FUNCTION = "sglang"


@dataclass(frozen=True)
class DriverSettings(Settings):
    """The training loop's settings (see the flags of the same names in `slime-run --help`)."""

    #: Rollout steps of the whole run (None with `--num-epoch` until `create_rollout_manager` sets it).
    num_rollout: int | None = option("num_rollout", convert=int, minimum=1)
    num_epoch: int | None = option("num_epoch", convert=int, minimum=1)
    #: Set by the framework (checkpoint restore, `create_training_models`): the run's first step.
    start_rollout_id: int = option("start_rollout_id", 0, convert=int, minimum=0)
    save: str | None = option("save")
    save_interval: int | None = option("save_interval", convert=int, minimum=1)
    eval_interval: int | None = option("eval_interval", convert=int, minimum=1)
    skip_eval_before_train: bool = option("skip_eval_before_train", False)
    #: Evaluate the loaded model once and stop (no step is trained).
    eval_only: bool = option("eval_only", False)
    use_critic: bool = option("use_critic", False)
    num_critic_only_steps: int = option("num_critic_only_steps", 0, convert=int, minimum=0)
    release_train: bool = option("release_train", False)
    #: Set by the framework: the run's plugins, whose lifecycle hooks the driver calls (None: no hooks).
    plugin_selection: PluginSelection | None = option("plugin_selection")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_rollout is None and self.num_epoch is None and not self.eval_only:
            raise ValueError("--num-rollout must be given (or --num-epoch)")


@dataclass(frozen=True)
class ClusterSettings(Settings):
    """How the training ranks are placed and created (see the flags of the same names in `slime-run --help`)."""

    actor_num_nodes: int = option("actor_num_nodes", 1, convert=int, minimum=1)
    #: Ranks per node (CPU processes on a cluster without GPUs).
    actor_num_gpus_per_node: int = option("actor_num_gpus_per_node", 1, convert=int, minimum=1)
    use_critic: bool = option("use_critic", False)
    critic_num_nodes: int = option("critic_num_nodes", 1, convert=int, minimum=1)
    critic_num_gpus_per_node: int = option("critic_num_gpus_per_node", 1, convert=int, minimum=1)
    #: Ray CPUs per training rank on a cluster without GPUs.
    train_num_cpus_per_rank: float = option("train_num_cpus_per_rank", 1.0, convert=float, above=0.0)
    #: `--train-resources`: custom Ray resources per rank, as sorted (name, amount) pairs.
    train_resources: tuple[tuple[str, float], ...] = option("train_resources", (), convert=resource_items)
    #: A KL penalty in the reward (`--kl-coef`) or a KL loss (`--use-kl-loss --kl-loss-coef`) gives the actor ranks a
    #: reference model.
    kl_coef: float = option("kl_coef", 0.0, convert=float, minimum=0.0)
    use_kl_loss: bool = option("use_kl_loss", False)
    kl_loss_coef: float = option("kl_loss_coef", 0.0, convert=float, minimum=0.0)
    #: Set by checkpoint restore: the step the run must start at (None: the step after what the trainers load).
    start_rollout_id: int | None = option("start_rollout_id", convert=int, minimum=0)

    @property
    def actor_ranks(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def critic_ranks(self) -> int:
        """The critic's ranks; 0 without `--use-critic`."""
        return self.critic_num_nodes * self.critic_num_gpus_per_node if self.use_critic else 0

    def rank_resources(self, use_gpu: bool) -> dict[str, float]:
        """What one training rank asks of its node: a GPU and a CPU on a cluster with GPUs, else
        `--train-num-cpus-per-rank` CPUs; plus `--train-resources`."""
        resources = {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": self.train_num_cpus_per_rank}
        resources.update(self.train_resources)
        return resources

    @property
    def with_ref(self) -> bool:
        return self.kl_coef != 0.0 or (self.use_kl_loss and self.kl_loss_coef != 0.0)


@dataclass(frozen=True)
class ServingSettings(Settings):
    """The engines and router a run starts (see the flags of the same names in `slime-run --help`)."""

    #: The rollout-engine plugin's name.
    engine: str = option("rollout_engine", "cpu")
    #: As given; `router_to_start` is what runs ("auto" resolved).
    router: str = option("rollout_router", "auto", choices=ROUTER_CHOICES)
    num_engines: int = option("rollout_num_engines", 2, convert=int, minimum=1)
    #: `--rollout-resources`: custom Ray resources per engine, as sorted (name, amount) pairs.
    rollout_resources: tuple[tuple[str, float], ...] = option("rollout_resources", (), convert=resource_items)
    #: The router's log goes to `<save>/logs/sglang-router.log` (a temporary file without `--save`).
    save: str | None = option("save")
    #: `--deterministic`: "auto" starts no router (see `slime.ray.router.router_for`).
    deterministic: bool = option("deterministic", False)

    @property
    def router_to_start(self) -> str:
        """ "sglang-router" or "none" (`slime.ray.router.router_for`)."""
        return router_for(self.router, self.num_engines, self.deterministic)


@dataclass(frozen=True)
class ManagerSettings(Settings):
    """The rollout manager's settings (see the flags of the same names in `slime-run --help`)."""

    #: No engines and no generation: train on replayed rollouts (`--load-debug-rollout-data`).
    debug_train_only: bool = option("debug_train_only", False)
    #: Generate only: steps return no training batch.
    debug_rollout_only: bool = option("debug_rollout_only", False)
    #: Registered names or dotted paths.
    data_source: str = option("data_source_path", DEFAULT_DATA_SOURCE)
    rollout_function: str = option("rollout_function_path", DEFAULT_ROLLOUT_FUNCTION)
    #: None in `args`: `rollout_function`.
    eval_function: str = option("eval_function_path", DEFAULT_ROLLOUT_FUNCTION)
    #: Prompts per rollout step (an epoch is the dataset size over this).
    batch_size: int = option("rollout_batch_size", 8, convert=int, minimum=1)
    #: Seconds a request to an engine may take (weight updates).
    http_timeout_s: float = option("rollout_http_timeout", 600.0, convert=float, above=0.0)
    #: Pause engines with mode "retract" rather than "abort" for weight updates.
    partial_rollout: bool = option("partial_rollout", False)
    #: Engines release their memory after each rollout step and take it back before the next weight update.
    offload_rollout: bool = option("offload_rollout", False)
    #: Path templates (`{rollout_id}`) to dump every step's rollout to, and to replay steps from.
    save_debug_rollout_data: str | None = option("save_debug_rollout_data")
    load_debug_rollout_data: str | None = option("load_debug_rollout_data")
    #: The fraction, in (0, 1], of each replayed rollout to keep (None: all).
    load_debug_rollout_data_subsample: float | None = option(
        "load_debug_rollout_data_subsample", convert=float, above=0.0
    )
    #: Set by the framework (checkpoint restore): the weight version the engines serve at the start.
    update_weight_start_version: int = option("update_weight_start_version", 0, convert=int, minimum=0)
    #: Log every step's metrics (and library INFO lines) in the manager's process too.
    verbose: bool = option("verbose", False)

    def __post_init__(self) -> None:
        super().__post_init__()
        subsample = self.load_debug_rollout_data_subsample
        if subsample is not None and subsample > 1:
            raise ValueError(f"--load-debug-rollout-data-subsample must be in (0, 1], got {subsample}")

    @property
    def pause_mode(self) -> str:
        """How engines pause for a weight update: "retract" keeps running requests (`--partial-rollout`), to finish
        with the new weights; "abort" ends them."""
        return "retract" if self.partial_rollout else "abort"

    @classmethod
    def from_args(cls, args: Any) -> ManagerSettings:
        """The settings of `args`; ValueError naming the flag when one is out of range."""
        values = options_from_args(cls, args)
        values.setdefault("eval_function", values.get("rollout_function", cls.rollout_function))
        return cls(**values)


@dataclass(frozen=True)
class TrainGroupSettings(Settings):
    """One training role's group: weight updates (`slime.weight_sync.WeightUpdate`) and `--release-train` (see
    `slime-run --help`)."""

    #: Set by the framework (checkpoint restore, the rollout manager): the weight version engines serve.
    update_weight_start_version: int = option("update_weight_start_version", 0, convert=int, minimum=0)
    update_weight_mode: str = option("update_weight_mode", "full", choices=("full",))
    #: One of `slime.weight_sync.TRANSPORTS`; "nccl", the old name of "distributed", is read as it.
    update_weight_transport: str = option(
        "update_weight_transport", "disk", convert=canonical_transport, choices=TRANSPORTS
    )
    #: Bytes per bucket of a distributed or tensor update.
    update_weight_buffer_size: int = option("update_weight_buffer_size", DEFAULT_BUCKET_BYTES, convert=int, minimum=1)
    update_weight_disk_dir: str | None = option("update_weight_disk_dir")
    update_weight_disk_keep_files: bool = option("update_weight_disk_keep_files", False)
    #: Kill the ranks after each weight export; they are re-created from the checkpoint saved every step.
    release_train: bool = option("release_train", False)
    save: str | None = option("save")
    no_save_optim: bool = option("no_save_optim", False)
    #: Seconds any one wait on an engine (a request, joining the update's group, a broadcast) may take.
    http_timeout_s: float = option("rollout_http_timeout", 600.0, convert=float, above=0.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.release_train and not self.save:
            raise ValueError("--release-train needs --save (the ranks are re-created from the checkpoint saved there)")

    @property
    def disk_weights(self) -> bool:
        """Weights travel through `--update-weight-disk-dir` (the rollout manager has the engines load them)."""
        return self.update_weight_transport == "disk"


@dataclass(frozen=True)
class InputSettings(Settings):
    """The files a run reads before Ray starts."""

    hf_checkpoint: str | None = option("hf_checkpoint")
    prompt_data: tuple[PromptSource, ...] = option("prompt_data", (), convert=parse_prompt_data)
    data_source: str = option("data_source_path", DEFAULT_DATA_SOURCE)


def check_run_settings(args: Any) -> None:
    """Build every orchestration settings class from `args`, so a bad flag is refused, naming it, before Ray
    starts (rather than inside the actor that reads it)."""
    for settings_class in (DriverSettings, ClusterSettings, ServingSettings, ManagerSettings, TrainGroupSettings):
        settings_class.from_args(args)
