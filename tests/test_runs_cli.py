"""`slime-run runs`: the durable-record loader, bad input, and the report on synthetic save directories.

The audit and the report on a real (killed and rerun) demo run are in tests/test_lineage_audit.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime.cli import main
from slime.data.durable_files import DurableFileError, load_json_record
from slime.data.lineage_audit import PLAN_IDENTITY_KEYS
from slime.data.run_inspection import TRAINING_CONSUMER


def _write(path: Path, value: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return path


def _listed(path: Path, *, hashed: bool = True) -> dict:
    entry: dict = {"size": path.stat().st_size}
    if hashed:
        entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return entry


@pytest.mark.parametrize(
    ("content", "options", "problem"),
    [
        (None, {}, "state is missing"),
        ("", {}, "state is empty"),
        ('{"version": 1, "consu', {}, "state is not valid JSON, truncated or edited"),
        ({"version": 2, "consumer": {}}, {"version": 1}, "state has format version 2; this slime-rl reads version 1"),
        ({"version": 1}, {"version": 1, "required_keys": ("consumer",)}, "state lacks 'consumer'"),
        ([1, 2], {"required_keys": ("consumer",)}, "state must hold a JSON object, not list"),
    ],
)
def test_load_json_record_names_the_file_the_problem_and_the_way_out(
    tmp_path: Path, content: object, options: dict, problem: str
) -> None:
    path = tmp_path / "rollout" / "builder_state_3.json"
    if content is not None:
        _write(path, content)
    with pytest.raises(DurableFileError) as caught:
        load_json_record(path, what="state", remedy="pick another checkpoint", **options)
    message = str(caught.value)
    assert message.startswith(f"{path}: {problem}") and message.endswith("; pick another checkpoint")
    assert caught.value.path == path


def test_load_json_record_checks_what_the_commit_marker_listed(tmp_path: Path) -> None:
    path = _write(tmp_path / "queue_state_0.json", {"version": 1, "manifest": {}, "root": "/pool"})
    listed = _listed(path)
    assert load_json_record(path, what="snapshot", version=1, listed=listed)["root"] == "/pool"
    _write(path, {"version": 1, "manifest": {}, "root": "/poo2"})  # same size, other bytes
    with pytest.raises(DurableFileError, match="differs from the sha256 the commit marker listed"):
        load_json_record(path, what="snapshot", listed=listed)
    _write(path, '{"version": 1')
    with pytest.raises(DurableFileError, match=r"has 13 bytes but the commit marker listed \d+"):
        load_json_record(path, what="snapshot", listed=listed)
    path.unlink()
    with pytest.raises(DurableFileError, match="listed by the commit marker is missing"):
        load_json_record(path, what="snapshot", listed=listed)


@pytest.mark.parametrize("audit", [False, True])
def test_runs_refuses_a_directory_that_is_not_a_save_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture, audit: bool
) -> None:
    (tmp_path / "notes.txt").write_text("not a run")
    argv = ["runs", "audit", str(tmp_path)] if audit else ["runs", str(tmp_path)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"slime-run: error: {tmp_path}: is not a slime-run save directory")
    assert "Traceback" not in captured.err
    assert main(["runs", str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'}: no such directory" in capsys.readouterr().err


def test_runs_help_explains_both_commands(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["runs", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "slime-run runs [audit] DIR [--json]" in text
    assert "slime-run runs audit DIR" in text and "trained exactly once" in text and "Exit status" in text


def _synthetic_save(save: Path, *, critic: bool = False) -> Path:
    """A committed step 0 whose model file was later truncated, in a save dir whose pool is gone (with `critic`, the
    commit also lists a critic checkpoint)."""
    configuration = {"hf_checkpoint": str(save / "model"), "prompt_data": str(save / "prompts.jsonl")}
    branch = {
        "version": 1,
        "parent": None,
        "initial_load": None,
        "initial_configuration": configuration,
        "queue_id": "run:synthetic",
        "pool": str(save / "rollout_data"),
    }
    _write(save / "rollout" / "branch.json", branch)
    _write(save / "rollout" / "current.json", {"version": 1, "directory": str(save), "tracker": "0"})
    _write(save / "latest_checkpointed_iteration.txt", "0")
    model = _write(save / "iter_0000000" / "model.safetensors", "x" * 100)
    files = {"iter_0000000/model.safetensors": _listed(model, hashed=False)}
    if critic:
        value_model = _write(save / "critic" / "iter_0000000" / "model.safetensors", "v" * 300)
        files["critic/iter_0000000/model.safetensors"] = _listed(value_model, hashed=False)
    for name in ("queue_state", "builder_state"):
        path = _write(save / "rollout" / f"{name}_0.json", {"version": 1})
        files[f"rollout/{name}_0.json"] = _listed(path)
    marker = {
        "version": 1,
        "rollout_id": 0,
        "files": files,
        "resumable": True,
        "weight_version": 1,
        "rollout_data_dir": str(save / "rollout_data"),
        "run_id": "rollout",
    }
    _write(save / "rollout" / "committed_0.json", marker)
    model.write_text("x" * 10)
    return model


def test_runs_reports_a_torn_commit_a_missing_pool_and_what_a_rerun_would_do(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    save = tmp_path / "save"
    model = _synthetic_save(save)
    assert main(["runs", str(save)]) == 1
    text = capsys.readouterr().out
    assert "(root)" in text and "why: new run" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("(root)") and "TORN" in line)
    assert row.split()[1] == "0"
    assert (
        f"{model}: step 0 component iter_0000000/model.safetensors has 10 bytes but the commit marker listed 100"
        in text
    )
    assert f"{save / 'rollout_data'}: the straw pool named by the branch records is missing" in text
    assert "refuse: a rerun would stop before training: Checkpoint component missing or changed" in text

    assert main(["runs", str(save), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    (commit,) = report["branches"][0]["commits"]
    assert commit["step"] == 0 and commit["problem"].startswith(str(model)) and report["rerun"]["action"] == "refuse"


def test_runs_shows_the_critics_part_of_each_commit_when_the_run_trains_one(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _synthetic_save(tmp_path / "plain")
    main(["runs", str(tmp_path / "plain")])
    assert "CRITIC" not in capsys.readouterr().out
    _synthetic_save(tmp_path / "ppo", critic=True)
    main(["runs", str(tmp_path / "ppo")])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.strip().startswith("BRANCH") and "STEP" in line)
    assert header.split()[4:6] == ["MODEL", "CRITIC"]
    row = next(line for line in lines if line.strip().startswith("(root)") and "TORN" in line)
    assert "1 files 300 B" in row


def test_runs_names_a_truncated_branch_record_and_audit_reports_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    save = tmp_path / "save"
    _synthetic_save(save)
    record = save / "rollout" / "branch.json"
    record.write_text(record.read_text()[:40])
    assert main(["runs", str(save)]) == 1
    assert f"{record}: branch record is not valid JSON, truncated or edited" in capsys.readouterr().out
    assert main(["runs", "audit", str(save)]) == 1
    text = capsys.readouterr().out
    assert "[lineage] the lineage cannot be read: branch record is not valid JSON" in text and str(record) in text


def test_plan_identity_keys_are_what_the_batch_builder_digests() -> None:
    from straw.protocol import digest

    from slime.data.batch_builder import BatchBuilder
    from slime.utils.types import Sample

    builder = BatchBuilder(SimpleNamespace())
    builder.raw_ref = SimpleNamespace(manifest=SimpleNamespace(digest="raw"))
    identity = builder._identity([Sample(index=0), Sample(index=1)])
    assert set(identity) - {"digest"} == set(PLAN_IDENTITY_KEYS)
    assert identity["digest"] == digest({key: identity[key] for key in PLAN_IDENTITY_KEYS})


def test_training_consumer_is_the_controllers() -> None:
    from slime.data.queue_controller import TRAINING_CONSUMER as CONTROLLER_CONSUMER

    assert TRAINING_CONSUMER == CONTROLLER_CONSUMER
