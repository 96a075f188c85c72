"""The prompt data sources' settings: what reading `--prompt-data` into prompt groups takes from the arguments.

`PromptSettings.from_args(args)` is built once by each `RolloutDataSource` (the run's start-up check of the
prompts builds one too) and validated there, with errors that name the flag. Attributes
`args` lacks take the flags' defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime.data.prompt_sources import PromptSource, parse_prompt_data
from slime.utils.settings import Settings, option


@dataclass(frozen=True)
class PromptSettings(Settings):
    """See the flags of the same names in `slime-run --help`."""

    #: Where the prompts are: one location, or a weighted mixture (empty: no prompts).
    prompt_data: tuple[PromptSource, ...] = option("prompt_data", (), convert=parse_prompt_data)
    #: The split read from a `datasets` directory or Hub dataset that has several (None: `train`).
    prompt_data_split: str | None = option("prompt_data_split")
    #: The field of each row that holds the prompt, and the optional ones with its label, its metadata and the
    #: tools (function schemas) its chat template is rendered with.
    input_key: str = option("input_key", "input")
    label_key: str | None = option("label_key")
    metadata_key: str = option("metadata_key", "metadata")
    tool_key: str | None = option("tool_key")
    #: Send a string prompt as one user message.
    apply_chat_template: bool = option("apply_chat_template", False)
    #: Shuffle the prompts each epoch, seeded with `seed` + epoch.
    shuffle: bool = option("rollout_shuffle", False)
    seed: int = option("rollout_seed", 42, convert=int)
    n_samples_per_prompt: int = option("n_samples_per_prompt", 4, convert=int, minimum=1)
    #: Where the cursor is saved with each checkpoint, and restored from.
    save: str | None = option("save")
    load: str | None = option("load")

    def record_keys(self) -> dict[str, str]:
        """The fields every prompt row must have, each with the flag that names it."""
        keys = {self.input_key: "--input-key"}
        if self.label_key:
            keys.setdefault(self.label_key, "--label-key")
        return keys
