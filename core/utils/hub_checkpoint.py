"""`--hf-checkpoint` given as a Hugging Face Hub id (`Qwen/Qwen3-0.6B`): fetched into the local cache before Ray starts.

Every process of a run (engines, trainers, the demo's checks) loads the model from a local directory, so the
driver resolves a Hub id once, at start-up: `huggingface_hub.snapshot_download` fetches the files a causal LM and
its tokenizer need (or finds them in the cache when the Hub is unreachable or `HF_HUB_OFFLINE=1`), and the run
goes on with `--hf-checkpoint` set to the snapshot directory. On a cluster that directory must be one every node
sees: point `HF_HUB_CACHE` at the shared filesystem, or download once and pass the directory.

A value that names an existing path is a local directory and is never looked up on the Hub.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

FLAG = "--hf-checkpoint"
#: `owner/name` (or a bare `name`, as the Hub accepts for some models): what a Hub repository id looks like.
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")
#: What a causal LM and its tokenizer need; not other frameworks' weights, not the repository's extras.
MODEL_FILE_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")


def looks_like_hub_id(value: str) -> bool:
    """True when `value` is not an existing path and has the form of a Hub repository id."""
    return not Path(value).expanduser().exists() and _HUB_ID.match(value) is not None and ".." not in value


def resolve_hf_checkpoint(value: str, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """The local directory of `--hf-checkpoint VALUE`: the path itself, or the Hub id's snapshot, downloaded (or
    found in the cache) now. ValueError naming the flag, the id and what to do when the Hub cannot provide it."""
    if not looks_like_hub_id(value):
        return Path(value).expanduser()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    fix = (
        f"download it where the Hub is reachable (`hf download {value} --local-dir DIR`) and pass "
        f"{FLAG} DIR, or fill this machine's Hugging Face cache (HF_HUB_CACHE)"
    )
    try:
        return Path(snapshot_download(value, allow_patterns=list(MODEL_FILE_PATTERNS), cache_dir=cache_dir))
    except GatedRepoError as exc:
        raise ValueError(f"{FLAG} {value}: the Hub refuses access (gated model): log in with `hf auth login`") from exc
    except RepositoryNotFoundError as exc:
        raise ValueError(
            f"{FLAG} {value}: no such model on the Hugging Face Hub and no such local directory "
            "(a private model needs `hf auth login`)"
        ) from exc
    except LocalEntryNotFoundError as exc:
        from huggingface_hub import constants

        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hugging Face Hub is not reachable"
        raise ValueError(
            f"{FLAG} {value}: not a local directory, {why} and the model is not in this machine's Hugging Face "
            f"cache; {fix}"
        ) from exc
    except (HfHubHTTPError, OSError) as exc:
        raise ValueError(f"{FLAG} {value}: fetching it from the Hugging Face Hub failed ({exc}); {fix}") from exc
