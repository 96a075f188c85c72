"""The embedded default model: a tiny causal LM and a character-level tokenizer, built in code.

`ensure_tiny_model(directory)` builds, once, a real Hugging Face checkpoint directory (`config.json`,
`model.safetensors`, `generation_config.json`, `tokenizer.json`, `tokenizer_config.json`) that any
`from_pretrained` call loads. Nothing is downloaded. Building is deterministic: the same
`TINY_MODEL_VERSION` and seed give the same weights on every machine.

The directory is assembled in a temporary sibling, every file and the directory are fsynced, a marker
(`slime_tiny_model.json`) is written last, and only then is the directory renamed into place and its parent
fsynced. A directory that is visible under the final name is therefore complete; one without the marker is
never taken for a good model. Several processes may call this at once: the first rename wins, the others
discard their copy.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from slime.utils.atomic_files import fsync_path, fsync_tree

TINY_MODEL_VERSION = 1
MARKER_FILE = "slime_tiny_model.json"

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
# Inputs are lowercased by the tokenizer's normalizer, so upper-case text still maps onto this alphabet.
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*/=?.,:;!'\"()<>#_\n"

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

MODEL_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
}


def default_tiny_model_dir() -> Path:
    """Where the built-in model lives unless `--hf-checkpoint` names another: `$SLIME_TINY_MODEL_DIR`, or
    a versioned directory under `$XDG_CACHE_HOME` (default `~/.cache`)."""
    explicit = os.environ.get("SLIME_TINY_MODEL_DIR")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "slime-rl" / f"tiny-lm-v{TINY_MODEL_VERSION}"


def build_tokenizer():
    """The character-level tokenizer: one token per character of `ALPHABET`, special tokens first."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for char in ALPHABET:
        vocab[char] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer, seed: int = 0):
    """A randomly initialised Qwen3-architecture causal LM sized for the tokenizer (deterministic in `seed`).

    Qwen3 rather than Qwen2: transformers forces its Qwen2 tokenizer class onto every `qwen2` checkpoint,
    which would replace our character-level tokenizer on `AutoTokenizer.from_pretrained`.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **MODEL_SHAPE,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval()


def is_tiny_model_dir(directory: str | os.PathLike) -> bool:
    """True when `directory` holds a completely built tiny model of the current version."""
    marker = Path(directory) / MARKER_FILE
    try:
        return json.loads(marker.read_text()).get("version") == TINY_MODEL_VERSION
    except (OSError, ValueError):
        return False


def ensure_tiny_model(directory: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Return `directory` (default `default_tiny_model_dir()`), building the tiny model there first if needed.

    Raises `FileExistsError` when the directory exists, is not empty and is not a tiny model of this version (never
    overwritten: it may be someone's real checkpoint, or a model of another version).
    """
    target = Path(directory) if directory is not None else default_tiny_model_dir()
    if is_tiny_model_dir(target):
        return target
    if target.exists() and not (target.is_dir() and not any(target.iterdir())):  # an empty directory is replaced
        raise FileExistsError(
            f"{target} exists but is not a slime tiny model v{TINY_MODEL_VERSION} (no valid {MARKER_FILE}); "
            "remove it, or point SLIME_TINY_MODEL_DIR / --hf-checkpoint at another directory"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    try:
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, seed=seed)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        marker = {"version": TINY_MODEL_VERSION, "seed": seed, "vocab_size": len(tokenizer), **MODEL_SHAPE}
        (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2))
        fsync_tree(staging)
        try:
            os.rename(staging, target)
        except OSError:
            # Another process published first; theirs is as good as ours if it carries the marker.
            if is_tiny_model_dir(target):
                return target
            raise
        fsync_path(target.parent)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
