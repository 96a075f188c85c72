"""Hugging Face directories out of a run: torch-backend checkpoints carry the tokenizer, `--save-hf` copies each
checkpoint to a directory of its own, and `slime-run export` copies one checkpoint, found along the run's lineage;
`AutoModelForCausalLM` and `AutoTokenizer` load all three."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch_batches import tiny_model_batch

from slime.cli import main
from slime.plugins import torch_checkpoint as ckpt
from slime.plugins.tiny_model import ensure_tiny_model
from slime.plugins.torch_backend import TorchTrainRayActor
from slime.plugins.torch_settings import TrainSettings
from slime.utils.arguments import parse_args


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    """A torch-backend run of the tiny model with checkpoints of steps 0 and 1 and `--save-hf hf/{rollout_id}`."""
    root = tmp_path_factory.mktemp("hf-export")
    tiny = ensure_tiny_model(root / "tiny")
    args = types.SimpleNamespace(
        hf_checkpoint=str(tiny),
        lr=1e-2,
        eps_clip=0.2,
        kl_coef=0.0,
        n_samples_per_prompt=2,
        micro_batch_size=2,
        save=str(root / "save"),
        save_hf=str(root / "hf" / "{rollout_id}"),
        load=None,
        seed=7,
    )
    actor = TorchTrainRayActor(world_size=1, rank=0)
    actor.init(args, "actor")
    actor.save_model(0)
    actor.train_from_data(0, tiny_model_batch())
    actor.save_model(1)
    return types.SimpleNamespace(root=root, tiny=tiny, save=root / "save", hf=root / "hf", actor=actor)


def _export(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    status = main(["export", *map(str, argv)])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _assert_loads_and_generates(directory: Path, expected_weights: dict[str, torch.Tensor]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    state = model.state_dict()
    assert all(torch.equal(tensor, state[name]) for name, tensor in expected_weights.items())
    prompt = tokenizer("1+1=", return_tensors="pt")
    output = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert output.shape[1] > prompt["input_ids"].shape[1]
    assert isinstance(tokenizer.decode(output[0]), str)


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def _hidden_leftovers(directory: Path) -> list[str]:
    return [path.name for path in directory.iterdir() if path.name.startswith(".")]


def test_checkpoints_hold_the_tokenizer_and_load_with_the_auto_classes(run) -> None:
    from transformers import AutoTokenizer

    checkpoint = ckpt.iter_dir(run.save, 1)
    names = {path.name for path in checkpoint.iterdir()}
    hf_names = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert hf_names <= names
    assert {ckpt.OPTIMIZER_FILE, ckpt.SCHEDULER_FILE, ckpt.rng_file(0)} <= names
    expected = AutoTokenizer.from_pretrained(run.tiny)
    assert AutoTokenizer.from_pretrained(checkpoint)("2*3=6").input_ids == expected("2*3=6").input_ids
    _assert_loads_and_generates(checkpoint, _weights(checkpoint))


def test_save_hf_writes_each_checkpoint_as_a_hugging_face_directory(run) -> None:
    assert sorted(path.name for path in run.hf.iterdir()) == ["0", "1"]
    for step in (0, 1):
        checkpoint = ckpt.iter_dir(run.save, step)
        assert sorted(path.name for path in (run.hf / str(step)).iterdir()) == [
            path.name for path in ckpt.hf_files(checkpoint)
        ]
        _assert_loads_and_generates(run.hf / str(step), _weights(checkpoint))
    assert not any(torch.equal(_weights(run.hf / "0")[k], v) for k, v in _weights(run.hf / "1").items())


def test_save_hf_replaces_an_older_directory_of_the_same_name(run, tmp_path) -> None:
    actor = run.actor
    settings = actor.settings
    try:
        flags = {"save": str(tmp_path / "save"), "save_hf": str(tmp_path / "hf"), "hf_checkpoint": str(run.tiny)}
        actor.settings = TrainSettings.from_args(types.SimpleNamespace(**flags))
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "stale.txt").write_text("from an older save")
        actor.save_model(3)
    finally:
        actor.settings = settings
    assert [path.name for path in ckpt.hf_files(tmp_path / "hf")] == sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert _hidden_leftovers(tmp_path) == []
    assert all(torch.equal(v, actor.model.state_dict()[k]) for k, v in _weights(tmp_path / "hf").items())


def test_export_writes_the_latest_checkpoint_by_default(run, capsys) -> None:
    out = run.root / "export-latest"
    status, stdout, err = _export(capsys, run.save, out)
    assert status == 0, err
    assert stdout.startswith(f"exported step 1 ({ckpt.iter_dir(run.save, 1)}) to {out}: chat_template.jinja, ")
    assert stdout.count("\n") == 1 and "tokenizer.json" in stdout
    assert not (out / ckpt.OPTIMIZER_FILE).exists() and not (out / ckpt.rng_file(0)).exists()
    assert _hidden_leftovers(out.parent) == []
    _assert_loads_and_generates(out, _weights(ckpt.iter_dir(run.save, 1)))


def test_export_of_a_named_step_into_an_empty_directory(run, capsys) -> None:
    out = run.root / "export-step0"
    out.mkdir()
    status, stdout, err = _export(capsys, run.save, "--step", 0, out)
    assert status == 0, err
    assert stdout.startswith("exported step 0 ")
    _assert_loads_and_generates(out, _weights(ckpt.iter_dir(run.save, 0)))


def _write_json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def test_export_finds_the_step_in_the_branch_of_the_lineage(run, tmp_path, capsys) -> None:
    """A rerun resumed step 0 into a branch and trained step 1 there; the root's own step 1 is an abandoned future."""
    save = tmp_path / "save"
    branch = save / "branches" / "b1"
    _write_json(save / "rollout" / "branch.json", {"version": 1, "parent": None, "queue_id": "run:root"})
    parent = {"directory": str(save), "step": 0, "queue_snapshot": True}
    _write_json(branch / "rollout" / "branch.json", {"version": 1, "parent": parent, "queue_id": "run:b1"})
    _write_json(save / "rollout" / "current.json", {"version": 1, "directory": str(branch), "tracker": "1"})
    for directory, step, source in ((save, 0, 0), (save, 1, 0), (branch, 1, 1)):
        shutil.copytree(ckpt.iter_dir(run.save, source), ckpt.iter_dir(directory, step))
        _write_json(directory / "rollout" / f"committed_{step}.json", {"version": 1, "rollout_id": step})
    out = tmp_path / "out"
    status, stdout, err = _export(capsys, save, out)
    assert status == 0, err
    assert stdout.startswith(f"exported step 1 ({ckpt.iter_dir(branch, 1)}) to {out}")
    assert _weights(out).keys() == _weights(ckpt.iter_dir(run.save, 1)).keys()
    assert all(torch.equal(v, _weights(ckpt.iter_dir(run.save, 1))[k]) for k, v in _weights(out).items())


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing step", "has no checkpoint of step 7; its checkpoints are steps 0, 1: pass one of them with --step"),
        ("non-empty OUT", "exists and is not an empty directory; pass a new or empty directory as OUT"),
        ("beyond the tracker", "iter_0000001 is not part of the run's lineage or newer than its tracker); its "),
        ("no checkpoints", "holds no checkpoint (no iter_<step> directory of its lineage); pass the --save directory"),
        ("no SAVE_DIR", "no such directory; pass the --save directory of a slime-run run"),
        ("megatron", "it is a Megatron checkpoint (distributed shards), not a Hugging Face directory"),
    ],
)
def test_export_refuses_user_mistakes_naming_the_path_and_the_fix(run, tmp_path, capsys, case, expected) -> None:
    save, out, step = run.save, tmp_path / "out", []
    if case == "missing step":
        step = ["--step", 7]
    elif case == "non-empty OUT":
        out.mkdir()
        (out / "keep.txt").write_text("someone's file")
    elif case == "beyond the tracker":  # step 1 saved, but the save was interrupted before the tracker named it
        save, step = tmp_path / "save", ["--step", 1]
        for number in (0, 1):
            shutil.copytree(ckpt.iter_dir(run.save, number), ckpt.iter_dir(save, number))
        (save / ckpt.TRACKER_FILE).write_text("0")
    elif case == "no checkpoints":
        save = tmp_path / "empty-save"
        save.mkdir()
    elif case == "no SAVE_DIR":
        save = tmp_path / "nowhere"
    elif case == "megatron":
        save = tmp_path / "megatron-save"
        (ckpt.iter_dir(save, 0) / "dist").mkdir(parents=True)
        (save / ckpt.TRACKER_FILE).write_text("0")
    status, stdout, err = _export(capsys, save, *step, out)
    assert status == 2 and stdout == ""
    assert err.startswith("slime-run: error: ") and expected in err and "Traceback" not in err
    assert str(save) in err or str(out) in err
    if case == "non-empty OUT":
        assert sorted(path.name for path in out.iterdir()) == ["keep.txt"]
    else:
        assert not out.exists()


def test_export_help_explains_the_command(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "slime-run export" in text and "--step N" in text and "AutoTokenizer.from_pretrained" in text


def test_save_hf_is_a_core_option_the_torch_backend_reads() -> None:
    args = parse_args(["--train-backend", "torch", "--save-hf", "/tmp/hf/{rollout_id}"])
    assert TrainSettings.from_args(args).save_hf == "/tmp/hf/{rollout_id}"
    assert TrainSettings.from_args(parse_args(["--train-backend", "torch"])).save_hf is None
