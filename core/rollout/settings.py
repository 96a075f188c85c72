"""The rollout functions' settings: what `sglang` and `fully-async` generation read from the run's arguments.

`RolloutSettings.from_args(args)` is built once per `args` object (by `GenerateState`, once per rollout
step by the rollout functions, once by a background worker) and validated there, with errors that name
the flag. The rollout manager never mutates the `args` it hands to rollout functions: when the engines
change it passes a copy with the new `rollout_engine_urls`, so settings built from one `args` stay true.
Attributes `args` lacks take the flags' defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from slime.data.prompt_sources import parse_chat_template_kwargs
from slime.utils.settings import Settings, option, options_from_args


@dataclass(frozen=True)
class RolloutSettings(Settings):
    """See the flags of the same names in `slime-run --help`."""

    #: Groups (prompts) one rollout step keeps (`--rollout-batch-size`).
    batch_size: int = option("rollout_batch_size", 8, convert=int, minimum=1)
    n_samples_per_prompt: int = option("n_samples_per_prompt", 4, convert=int, minimum=1)
    #: Prompts taken from the data source at a time (None in `args`: `batch_size`).
    over_sampling_batch_size: int = option("over_sampling_batch_size", 8, convert=int, minimum=1)
    #: Requests in flight at once per rollout process (per engine for the fully async worker).
    concurrency: int = option("sglang_server_concurrency", 64, convert=int, minimum=1)
    request_retries: int = option("rollout_request_retries", 3, convert=int, minimum=0)
    http_timeout_s: float = option("rollout_http_timeout", 600.0, convert=float, above=0.0)
    temperature: float = option("rollout_temperature", 1.0, convert=float, minimum=0.0)
    top_p: float = option("rollout_top_p", 1.0, convert=float, above=0.0)
    top_k: int = option("rollout_top_k", -1, convert=int)
    max_response_len: int = option("rollout_max_response_len", 16, convert=int, minimum=1)
    #: Evaluation overrides of the sampling parameters (None: the rollout's).
    eval_temperature: float | None = option("eval_temperature", convert=float, minimum=0.0)
    eval_top_p: float | None = option("eval_top_p", convert=float, above=0.0)
    eval_top_k: int | None = option("eval_top_k", convert=int)
    eval_max_response_len: int | None = option("eval_max_response_len", convert=int, minimum=1)
    #: The tokenizer to send token ids with (None: the engine's `/model_info` tokenizer, else text).
    hf_checkpoint: str | None = option("hf_checkpoint")
    #: Keyword arguments every chat prompt is rendered with (`--apply-chat-template-kwargs`).
    chat_template_kwargs: dict[str, Any] | None = option(
        "apply_chat_template_kwargs", convert=parse_chat_template_kwargs
    )
    custom_generate_function_path: str | None = option("custom_generate_function_path")
    sample_filter_path: str | None = option("rollout_sample_filter_path")
    all_samples_process_path: str | None = option("rollout_all_samples_process_path")
    #: `--deterministic`: seed each sample from `seed` and what identifies it, keep groups in issue order.
    deterministic: bool = option("deterministic", False)
    seed: int = option("rollout_seed", 42, convert=int)
    #: Set by the framework: the engines' base URLs (the rollout manager) and the router's (serving).
    engine_urls: tuple[str, ...] = option("rollout_engine_urls", (), convert=tuple)
    router_url: str | None = option("rollout_router_url")

    def __post_init__(self) -> None:
        super().__post_init__()
        for dest, value in (("--rollout-top-p", self.top_p), ("--eval-top-p", self.eval_top_p)):
            if value is not None and value > 1:
                raise ValueError(f"{dest} must be <= 1, got {value}")

    @classmethod
    def from_args(cls, args: Any) -> RolloutSettings:
        """The settings of `args`; ValueError naming the flag when one is out of range."""
        values = options_from_args(cls, args)
        values.setdefault("over_sampling_batch_size", values.get("batch_size", cls.batch_size))
        return cls(**values)

    def sampling_params(self, evaluation: bool = False) -> dict[str, Any]:
        """The `sampling_params` of a `/generate` request; with `evaluation`, the
        `--eval-{temperature,top-p,top-k,max-response-len}` given override the rollout's."""
        chosen = self
        if evaluation:
            overrides = {
                "temperature": self.eval_temperature,
                "top_p": self.eval_top_p,
                "top_k": self.eval_top_k,
                "max_response_len": self.eval_max_response_len,
            }
            chosen = replace(self, **{name: value for name, value in overrides.items() if value is not None})
        return {
            "temperature": chosen.temperature,
            "top_p": chosen.top_p,
            "top_k": chosen.top_k,
            "max_new_tokens": chosen.max_response_len,
        }

    def engines(self) -> list[str]:
        """Where requests go: the router when there is one, else the engines (RuntimeError when neither is set)."""
        if self.router_url:
            return [self.router_url]
        if not self.engine_urls:
            raise RuntimeError(
                "No rollout engine to send requests to: set args.rollout_engine_urls (the rollout manager does this "
                "after starting the engines) or args.rollout_router_url"
            )
        return list(self.engine_urls)
