"""LoRA in the torch backend (`--lora-rank`): adapters only are trained and checkpointed, engines get merged
weights, a resume restores adapters and optimizer, `--save-hf` and `slime-run export` write merged weights or the
adapter, and the flags a run cannot use are refused at parse time."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from torch_batches import tiny_model_batch  # noqa: E402

from slime.cli import main  # noqa: E402
from slime.plugins import torch_checkpoint as ckpt  # noqa: E402
from slime.plugins import torch_lora  # noqa: E402
from slime.plugins.tiny_model import ensure_tiny_model  # noqa: E402
from slime.plugins.torch_backend import TorchTrainRayActor  # noqa: E402
from slime.utils.arguments import parse_args  # noqa: E402
from slime.weight_sync import WeightUpdate  # noqa: E402


def _args(tiny: Path, save: Path, **overrides: object) -> types.SimpleNamespace:
    values = {
        "hf_checkpoint": str(tiny),
        "lr": 5e-2,
        "eps_clip": 0.2,
        "kl_coef": 0.0,
        "n_samples_per_prompt": 2,
        "micro_batch_size": 2,
        "save": str(save),
        "load": None,
        "seed": 7,
        "lora_rank": 4,
        "lora_alpha": 8.0,
    }
    values.update(overrides)
    return types.SimpleNamespace(**values)


def _actor(args: types.SimpleNamespace) -> TorchTrainRayActor:
    actor = TorchTrainRayActor(world_size=1, rank=0)
    actor.init(args, "actor")
    return actor


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def _size(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir() if path.is_file())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("lora-tiny") / "tiny")


@pytest.fixture(scope="module")
def trained(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    """A LoRA run: checkpoint of step 0 (after one trained step) with `--save-hf` merged copies."""
    root = tmp_path_factory.mktemp("lora-run")
    args = _args(tiny, root / "save", save_hf=str(root / "hf" / "{rollout_id}"))
    actor = _actor(args)
    actor.train_from_data(0, tiny_model_batch())
    actor.save_model(0)
    return types.SimpleNamespace(root=root, args=args, actor=actor, checkpoint=ckpt.iter_dir(root / "save", 0))


# ----------------------------------------------------------------------------------------------- the adapters


def test_adapters_start_as_the_base_model_and_only_they_train(tiny: Path) -> None:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    expected = _logits(base, tokens)
    rng_before = torch.get_rng_state()
    wrapped = torch_lora.add_adapters(base, torch_lora.LoraSettings(rank=4), seed=3, base=str(tiny))
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG stream is untouched
    assert torch.allclose(_logits(wrapped, tokens), expected)  # B starts at zero
    trainable = {name for name, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    again = torch_lora.add_adapters(
        AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32),
        torch_lora.LoraSettings(rank=4),
        seed=3,
        base=str(tiny),
    )
    for (name, first), (_, second) in zip(
        torch_lora.adapter_state(wrapped).items(), torch_lora.adapter_state(again).items(), strict=True
    ):
        assert torch.equal(first, second), name  # the same seed gives the same adapters, whatever the rank


def test_merged_state_computes_the_adapted_model_under_the_base_names(tiny: Path) -> None:
    from transformers import AutoModelForCausalLM

    base_names = set(AutoModelForCausalLM.from_pretrained(tiny).state_dict())
    wrapped = torch_lora.add_adapters(
        AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32),
        torch_lora.LoraSettings(
            rank=4, alpha=8.0, target_modules="q_proj,v_proj,down_proj", modules_to_save="model.norm"
        ),
        seed=0,
        base=str(tiny),
    )
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if ".lora_B." in name or ".modules_to_save." in name:
                parameter.normal_(std=0.2)
    before = {name: tensor.clone() for name, tensor in wrapped.state_dict().items()}
    merged = torch_lora.merged_state(wrapped)
    assert set(merged) == base_names
    plain = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    plain.load_state_dict(merged)
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert torch.allclose(_logits(plain, tokens), _logits(wrapped, tokens), atol=1e-5)
    # merging computed new tensors: the adapted model itself is unchanged
    assert all(torch.equal(tensor, wrapped.state_dict()[name]) for name, tensor in before.items())
    changed = [name for name in merged if not torch.equal(merged[name], plain.state_dict()[name])]
    assert not changed
    untouched = AutoModelForCausalLM.from_pretrained(tiny).state_dict()
    assert torch.equal(merged["model.layers.0.mlp.up_proj.weight"], untouched["model.layers.0.mlp.up_proj.weight"])
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
        assert not torch.equal(merged[name], untouched[name]), name


def test_target_modules_that_match_nothing_are_refused_naming_the_flag(tiny: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    with pytest.raises(ValueError, match="--lora-target-modules no_such_proj"):
        torch_lora.add_adapters(
            model, torch_lora.LoraSettings(rank=2, target_modules="no_such_proj"), seed=0, base=str(tiny)
        )


# ------------------------------------------------------------------------------------------------ the backend


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_only(trained: types.SimpleNamespace, tiny: Path) -> None:
    names = {path.name for path in trained.checkpoint.iterdir()}
    assert {torch_lora.ADAPTER_CONFIG_FILE, torch_lora.ADAPTER_WEIGHTS_FILE, ckpt.OPTIMIZER_FILE} <= names
    assert "model.safetensors" not in names and "config.json" not in names
    assert "tokenizer.json" in names  # the tokenizer travels with the adapters
    config = torch_lora.read_adapter_config(trained.checkpoint)
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["base_model_name_or_path"] == str(tiny)
    optimizer = torch.load(trained.checkpoint / ckpt.OPTIMIZER_FILE, weights_only=True)
    assert optimizer["state"] and all("lora_" in name for name in optimizer["state"])
    adapter_bytes = (trained.checkpoint / torch_lora.ADAPTER_WEIGHTS_FILE).stat().st_size
    assert adapter_bytes < (tiny / "model.safetensors").stat().st_size / 3


def test_training_moves_the_adapters_and_never_the_base_weights(trained: types.SimpleNamespace, tiny: Path) -> None:
    from safetensors.torch import load_file

    base = load_file(tiny / "model.safetensors")
    model = trained.actor.model.get_base_model()
    frozen = {name.replace(".base_layer.", "."): t for name, t in model.state_dict().items() if "lora_" not in name}
    assert all(torch.equal(frozen[name], tensor) for name, tensor in base.items())
    lora_b = [t for name, t in torch_lora.adapter_state(trained.actor.model).items() if "lora_B" in name]
    assert any(t.abs().sum() > 0 for t in lora_b)  # B started at zero and has been trained


def test_resume_restores_adapters_optimizer_and_the_next_step(trained: types.SimpleNamespace, tmp_path: Path) -> None:
    resumed = _actor(_args(Path(trained.args.hf_checkpoint), tmp_path / "unused", load=trained.args.save))
    first = torch_lora.adapter_state(trained.actor.model)
    assert all(torch.equal(t, torch_lora.adapter_state(resumed.model)[name]) for name, t in first.items())
    saved = trained.actor.optimizer.state_dict()["state"]
    restored = resumed.optimizer.state_dict()["state"]
    assert saved.keys() == restored.keys()
    for index, values in saved.items():
        assert torch.equal(values["exp_avg"], restored[index]["exp_avg"])
    assert resumed.global_step == trained.actor.global_step


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"lora_rank": 8}, r"trained with r=4, but this run's --lora-rank gives 8"),
        ({"lora_alpha": 32.0}, r"lora_alpha=8.0, but this run's --lora-alpha gives 32.0"),
        ({"lora_target_modules": "q_proj"}, r"this run's --lora-target-modules gives \['q_proj'\]"),
        ({"lora_rank": 0}, r"holds LoRA adapters; to resume it, add the LoRA flags \(--lora-rank, \.\.\.\)"),
    ],
)
def test_resume_with_other_lora_flags_is_refused(trained, tmp_path, overrides, expected) -> None:
    args = _args(Path(trained.args.hf_checkpoint), tmp_path / "unused", load=trained.args.save, **overrides)
    with pytest.raises(ValueError, match=expected):
        _actor(args)


def test_resume_on_another_base_model_is_refused_naming_both(trained, tmp_path) -> None:
    other = ensure_tiny_model(tmp_path / "other-tiny")
    with pytest.raises(ValueError, match=rf"trained on the base model {trained.args.hf_checkpoint}.*--hf-checkpoint"):
        _actor(_args(other, tmp_path / "unused", load=trained.args.save))


def test_a_full_weight_checkpoint_is_not_resumed_as_lora(tiny: Path, tmp_path: Path) -> None:
    full = _actor(_args(tiny, tmp_path / "save", lora_rank=0, lora_alpha=None))
    full.save_model(0)
    with pytest.raises(ValueError, match="holds full weights; to resume it, drop --lora-rank"):
        _actor(_args(tiny, tmp_path / "other", load=str(tmp_path / "save")))


def test_corrupt_adapter_weights_are_named(trained, tmp_path) -> None:
    import shutil

    copy = tmp_path / "save"
    shutil.copytree(trained.args.save, copy)
    (ckpt.iter_dir(copy, 0) / torch_lora.ADAPTER_WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=r"adapter_model.safetensors cannot be read"):
        _actor(_args(Path(trained.args.hf_checkpoint), tmp_path / "unused", load=str(copy)))


def test_engines_receive_merged_weights(trained: types.SimpleNamespace, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    target = tmp_path / "weights"
    trained.actor.update_weights(WeightUpdate(version=1, transport="disk", disk_dir=str(target)))
    served = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.allclose(_logits(served, tokens), _logits(trained.actor.model, tokens), atol=1e-5)
    trained.actor.model.train()


def test_save_hf_writes_merged_weights_by_default(trained: types.SimpleNamespace) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = trained.root / "hf" / "0"
    assert not torch_lora.is_adapter_checkpoint(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    AutoTokenizer.from_pretrained(directory)
    merged = torch_lora.merged_state(trained.actor.model)
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in merged.items())


def test_save_hf_adapter_copies_the_adapter(tiny: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    args = _args(tiny, tmp_path / "save", save_hf=str(tmp_path / "hf"), lora_save_hf="adapter")
    actor = _actor(args)
    actor.train_from_data(0, tiny_model_batch())
    actor.save_model(0)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), tmp_path / "hf")
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.allclose(_logits(loaded, tokens), _logits(actor.model, tokens), atol=1e-5)


# ----------------------------------------------------------------------------------------------------- export


def test_export_merges_an_adapter_checkpoint_into_its_base(trained, tmp_path, capsys) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    assert main(["export", trained.args.save, str(out)]) == 0
    line = capsys.readouterr().out
    assert f"merged into {trained.args.hf_checkpoint}" in line
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    AutoTokenizer.from_pretrained(out)
    merged = torch_lora.merged_state(trained.actor.model)
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in merged.items())


def test_export_adapter_copies_it_and_a_missing_base_is_named(trained, tmp_path, capsys) -> None:
    out = tmp_path / "adapter"
    assert main(["export", trained.args.save, str(out), "--adapter"]) == 0
    assert torch_lora.is_adapter_checkpoint(out) and (out / torch_lora.ADAPTER_WEIGHTS_FILE).is_file()
    capsys.readouterr()
    status = main(["export", trained.args.save, str(tmp_path / "x"), "--base", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert status == 2 and "pass --base DIR" in err and "Traceback" not in err


def test_export_refuses_lora_options_for_a_full_checkpoint(tiny, tmp_path, capsys) -> None:
    full = _actor(_args(tiny, tmp_path / "save", lora_rank=0, lora_alpha=None))
    full.save_model(0)
    status = main(["export", str(tmp_path / "save"), str(tmp_path / "out"), "--adapter"])
    err = capsys.readouterr().err
    assert status == 2 and "holds full weights, not LoRA adapters; drop --adapter" in err


# ------------------------------------------------------------------------------------------------- parse time


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--lora-alpha", "32"], "--lora-alpha shape LoRA adapters; add --lora-rank N"),
        (["--lora-rank", "-1"], "--lora-rank must be >= 0"),
        (["--lora-rank", "8", "--lora-dropout", "1.0"], "--lora-dropout must be < 1"),
        (["--lora-rank", "8", "--lora-target-modules", " , "], "--lora-target-modules names no module"),
        (["--lora-rank", "8", "--fsdp"], "--lora-rank with --fsdp is not supported"),
        (["--lora-rank", "8", "--train-backend", "megatron"], "--train-backend megatron trains the full weights"),
    ],
)
def test_lora_flags_a_run_cannot_use_are_refused_at_parse_time(argv, expected, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--plugin", "straw", *argv])
    assert expected in capsys.readouterr().err


def test_lora_without_peft_names_the_install_command(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    with pytest.raises(SystemExit):
        parse_args(["--plugin", "straw", "--lora-rank", "8"])
    assert "pip install 'slime-rl[lora]'" in capsys.readouterr().err


def test_lora_flags_parse_into_the_backend_settings() -> None:
    from slime.plugins.torch_settings import TrainSettings

    args = parse_args(["--plugin", "straw", "--lora-rank", "8", "--lora-target-modules", "q_proj,v_proj"])
    settings = TrainSettings.from_args(args).lora
    assert settings.enabled and settings.rank == 8 and settings.targets == ["q_proj", "v_proj"]
    assert settings.save_hf == "merged"


def test_adapters_train_under_gradient_checkpointing_and_bf16(tiny: Path, tmp_path: Path) -> None:
    actor = _actor(_args(tiny, tmp_path / "save", gradient_checkpointing=True, bf16=True))
    before = {name: tensor.clone() for name, tensor in torch_lora.adapter_state(actor.model).items()}
    metrics = actor.train_from_data(0, tiny_model_batch())
    assert metrics["train/grad_norm"] > 0
    after = torch_lora.adapter_state(actor.model)
    assert any(not torch.equal(before[name], after[name]) for name in before if "lora_B" in name)
