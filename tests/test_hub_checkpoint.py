"""`--hf-checkpoint` as a Hugging Face Hub id: resolved to a local snapshot before Ray starts, or refused clearly.

This machine has no route to the Hub, so the fetch itself is exercised through huggingface_hub's cache: a
snapshot laid out as the library lays it out is found with the Hub unreachable, and a model missing from the
cache is refused naming the flag, the id and the fix.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub import constants

from slime.plugins.tiny_model import ensure_tiny_model
from slime.train import fetch_hub_model
from slime.utils.hf_checkpoint import validate_hf_checkpoint_dir
from slime.utils.hub_checkpoint import looks_like_hub_id, resolve_hf_checkpoint

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _cached_snapshot(cache: Path, repo_id: str, model: Path) -> Path:
    """`model`'s files as huggingface_hub caches `repo_id` at `REVISION` (refs/main names the snapshot)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(model, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize(
    ("value", "hub_id"),
    [
        ("Qwen/Qwen3-0.6B", True),
        ("gpt2", True),
        ("/models/qwen", False),
        ("./qwen", False),
        ("a/b/c", False),
        ("../qwen", False),
        ("owner/..", False),
    ],
)
def test_hub_ids_are_told_from_paths(value: str, hub_id: bool) -> None:
    assert looks_like_hub_id(value) is hub_id


def test_an_existing_path_is_never_looked_up_on_the_hub(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner" / "model").mkdir(parents=True)
    assert not looks_like_hub_id("owner/model")
    assert resolve_hf_checkpoint("owner/model") == Path("owner/model")


def test_a_cached_model_resolves_with_the_hub_unreachable(tmp_path: Path, offline) -> None:
    model = ensure_tiny_model(tmp_path / "tiny")
    snapshot = _cached_snapshot(tmp_path / "cache", "slime/tiny", model)
    resolved = resolve_hf_checkpoint("slime/tiny", cache_dir=tmp_path / "cache")
    assert resolved == snapshot
    assert validate_hf_checkpoint_dir(resolved) == resolved.resolve()


def test_the_run_uses_the_snapshot_directory(tmp_path: Path, offline, monkeypatch) -> None:
    snapshot = _cached_snapshot(tmp_path / "cache", "slime/tiny", ensure_tiny_model(tmp_path / "tiny"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    args = SimpleNamespace(hf_checkpoint="slime/tiny")
    fetch_hub_model(args)
    assert Path(args.hf_checkpoint) == snapshot
    local = SimpleNamespace(hf_checkpoint=str(snapshot))
    fetch_hub_model(local)
    assert local.hf_checkpoint == str(snapshot)


def test_a_model_neither_local_nor_cached_is_refused_naming_the_flag_and_the_fix(tmp_path: Path, offline) -> None:
    with pytest.raises(ValueError) as caught:
        resolve_hf_checkpoint("slime/absent", cache_dir=tmp_path / "cache")
    message = str(caught.value)
    assert message.startswith("--hf-checkpoint slime/absent: not a local directory, HF_HUB_OFFLINE is set")
    assert "hf download slime/absent --local-dir DIR" in message


def test_slime_run_refuses_an_unreachable_hub_model_before_ray_starts(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input": "x", "label": "x"}\n')
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-m", "slime.cli", "--hf-checkpoint", "slime/absent", "--prompt-data", str(prompts)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "slime-run: error: --hf-checkpoint slime/absent: not a local directory" in result.stderr
    assert "Traceback" not in result.stderr
