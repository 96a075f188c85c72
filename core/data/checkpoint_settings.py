"""Checkpoints' settings: what saving, selecting and pruning checkpoints read from the run's arguments.

`CheckpointSettings.from_args(args)` is built once per call of `resolve_checkpoint`, `commit_checkpoint` (and
once per model's arguments there), `save_checkpoint`, the checkpoint policies and `prune_checkpoints`, from
the arguments of that moment: restoring a checkpoint points `args.save` at a new branch and sets `args.load`,
`args.ckpt_step` and `args.start_rollout_id` by contract, so settings built before it no longer describe the
run. The checkpoint-policies plugin validates them once more when the run's arguments are parsed
(`slime_configure`). Attributes `args` lacks take the flags' defaults.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from slime.data.prompt_sources import chat_template_kwargs_text, prompt_data_text
from slime.utils.settings import Settings, option, options_from_args

#: `InitialConfiguration` fields recorded only when set (see `record`).
ADDED_LATER = frozenset({"prompt_data_split", "apply_chat_template_kwargs"})


@dataclass(frozen=True)
class InitialConfiguration(Settings):
    """What a run interrupted before its first checkpoint must keep identical to resume its write-ahead log.

    Field names are the flags' destinations: `record()` is what `rollout/branch.json` stores and compares.
    """

    hf_checkpoint: str | None = option("hf_checkpoint")
    prompt_data: str | None = option("prompt_data", convert=prompt_data_text)
    prompt_data_split: str | None = option("prompt_data_split")
    input_key: str = option("input_key", "input")
    label_key: str | None = option("label_key")
    metadata_key: str = option("metadata_key", "metadata")
    tool_key: str | None = option("tool_key")
    apply_chat_template: bool = option("apply_chat_template", False)
    apply_chat_template_kwargs: str | None = option("apply_chat_template_kwargs", convert=chat_template_kwargs_text)
    n_samples_per_prompt: int = option("n_samples_per_prompt", 4)
    rollout_seed: int = option("rollout_seed", 42)
    rollout_shuffle: bool = option("rollout_shuffle", False)
    rollout_function_path: str = option("rollout_function_path", "sglang")
    custom_generate_function_path: str | None = option("custom_generate_function_path")
    custom_rm_path: str | None = option("custom_rm_path")
    rollout_queue_run_id: str | None = option("rollout_queue_run_id")

    def record(self) -> dict[str, Any]:
        """`{flag destination: value}`, as `rollout/branch.json` records it; the flags added after the first
        release are left out while unset, so a branch file written before they existed still matches."""
        return {name: value for name, value in asdict(self).items() if not (name in ADDED_LATER and value is None)}


@dataclass(frozen=True)
class CheckpointSettings(Settings):
    """See the flags of the same names in `slime-run --help` (group "checkpoints")."""

    #: Where this run writes checkpoints (after a restore: its branch directory).
    save: str | None = option("save")
    #: A checkpoint directory or `rollout/committed_<step>.json` to restore (after a restore: the selected one).
    load: str | None = option("load")
    ckpt_step: int | None = option("ckpt_step", convert=int, minimum=0)
    #: The checkpoint policy's name (None: the transport's).
    policy: str | None = option("checkpoint_policy")
    transport: str = option("rollout_data_transport", "object-store")
    #: Joint commits of a branch to keep (None: all), and steps divisible by `keep_every` kept besides.
    keep_last: int | None = option("keep_last_checkpoints", convert=int, minimum=1)
    keep_every: int | None = option("keep_every_checkpoint", convert=int, minimum=1)
    no_save_optim: bool = option("no_save_optim", False)
    no_save_rng: bool = option("no_save_rng", False)
    no_load_optim: bool = option("no_load_optim", False)
    no_load_rng: bool = option("no_load_rng", False)
    use_stateless_adam: bool = option("use_stateless_adam", False)
    use_critic: bool = option("use_critic", False)
    release_train: bool = option("release_train", False)
    num_rollout: int | None = option("num_rollout", convert=int)
    #: Set by the framework: the first rollout step of the run (None: not chosen yet).
    start_rollout_id: int | None = option("start_rollout_id", convert=int, minimum=0)
    debug_train_only: bool = option("debug_train_only", False)
    debug_rollout_only: bool = option("debug_rollout_only", False)
    load_debug_rollout_data: str | None = option("load_debug_rollout_data")
    initial: InitialConfiguration = field(default_factory=InitialConfiguration)

    @classmethod
    def from_args(cls, args: Any) -> CheckpointSettings:
        """The settings of `args`; ValueError naming the flag when one is out of range."""
        return cls(**options_from_args(cls, args), initial=InitialConfiguration.from_args(args))

    @property
    def debug(self) -> bool:
        """A `--debug-train-only` or `--debug-rollout-only` run: it owns no live queue and commits nothing."""
        return self.debug_train_only or self.debug_rollout_only

    @property
    def restores_joint_commits(self) -> bool:
        """Debug and replay runs own no live queue and restore nothing; a run without --save has nothing to restore."""
        return not (self.debug or self.load_debug_rollout_data) and bool(self.save)

    @property
    def saves_resumable(self) -> bool:
        """This model's saves hold the optimizer state (none needed with stateless Adam) and the RNG state."""
        return not self.no_save_rng and not (self.no_save_optim and not self.use_stateless_adam)

    @property
    def loads_full_state(self) -> bool:
        """A restore loads the optimizer state (none needed with stateless Adam) and the RNG state."""
        return not self.no_load_rng and not (self.no_load_optim and not self.use_stateless_adam)

    def is_last_step(self, rollout_id: int) -> bool:
        return self.num_rollout is not None and rollout_id == self.num_rollout - 1
