"""The safetensors transport: slime's transport conformance suite, and what its files on disk look like.

The slime-rl repository collects these tests too (its `testpaths`); they are skipped where this package is not
installed (`pip install -e contrib/slime-safetensors-transport`).
"""

from __future__ import annotations

import pickle
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from slime.testing import TransportConformance, TransportHarness, training_samples
from slime.utils.arguments import parse_args

pytest.importorskip("slime_safetensors_transport", reason="pip install -e contrib/slime-safetensors-transport")

from slime_safetensors_transport import SafetensorsShard, SafetensorsTransport, batch_directory  # noqa: E402
from slime_safetensors_transport.shards import write_shard  # noqa: E402


class TestSafetensorsTransport(TransportConformance):
    transport_name = "safetensors"


class TestSafetensorsTransportWithItsOwnDirectory(TransportConformance):
    """The conformance suite again, with the batches outside `--save` (`--safetensors-transport-dir`)."""

    transport_name = "safetensors"

    def transport_argv(self, tmp_path: Path) -> list[str]:
        return [*super().transport_argv(tmp_path), "--safetensors-transport-dir", str(tmp_path / "shared" / "batches")]

    def test_batches_go_to_the_named_directory(self, transport_harness: TransportHarness, slime_ray: Any) -> None:
        directory = Path(transport_harness.args.safetensors_transport_dir)
        assert directory.name == "batches" and directory.parent.name == "shared"
        builder = transport_harness.batch_builder()
        boxes = transport_harness.transport.shard_batch(builder, builder.convert(training_samples()))
        references = [slime_ray.get(box.inner) for box in boxes]
        assert all(Path(reference.path).parent.parent == directory for reference in references)
        assert not (Path(transport_harness.args.save) / "safetensors_batches").exists()


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    return ["--rollout-data-transport", "safetensors", "--save", str(tmp_path / "save"), "--prompt-data", "p", *extra]


def test_directory_defaults_under_save_and_is_created_owner_only(tmp_path: Path) -> None:
    args = parse_args(_argv(tmp_path))
    assert args.safetensors_transport_dir is None
    existing = stat.S_IMODE(tmp_path.stat().st_mode)
    SafetensorsTransport(args).prepare_storage()
    directory = tmp_path / "save" / "safetensors_batches"
    assert args.safetensors_transport_dir == str(directory)
    for created in (tmp_path / "save", directory):
        assert stat.S_IMODE(created.stat().st_mode) == 0o700, created
    assert stat.S_IMODE(tmp_path.stat().st_mode) == existing, "an existing directory keeps its mode"


def test_directory_needs_an_option_or_save(tmp_path: Path) -> None:
    args = parse_args(["--rollout-data-transport", "safetensors", "--prompt-data", "p"])
    with pytest.raises(ValueError, match="--safetensors-transport-dir or --save"):
        batch_directory(args)


def test_unwritable_directory_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    args = parse_args(_argv(tmp_path, "--safetensors-transport-dir", str(blocker / "batches")))
    with pytest.raises(RuntimeError, match=f"cannot write to its directory {blocker / 'batches'}"):
        SafetensorsTransport(args).check_storage()


def _shard() -> dict:
    return {
        "tokens": [torch.arange(5), torch.arange(3)],
        "rollout_mask_sums": torch.tensor([2.0, 1.0]),
        "view": torch.arange(100)[10:12],
        "rewards": [0.5, -0.5],
        "schedule": {"partition": [0, 2], "pair": (1, "two", None, True)},
    }


def test_shard_files_round_trip_and_leave_no_temporary_files(tmp_path: Path) -> None:
    reference = write_shard(tmp_path, "batch", "digest", 1, _shard())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rank_1.json", "rank_1.safetensors"]
    loaded = pickle.loads(pickle.dumps(reference)).load()
    assert list(loaded) == list(_shard())
    assert [t.tolist() for t in loaded["tokens"]] == [[0, 1, 2, 3, 4], [0, 1, 2]]
    assert loaded["view"].tolist() == [10, 11] and loaded["rewards"] == [0.5, -0.5]
    assert loaded["schedule"] == {"partition": [0, 2], "pair": (1, "two", None, True)}
    assert (tmp_path / "rank_1.safetensors").stat().st_size < 1024, "a view must not save its whole storage"


def test_a_corrupt_or_foreign_shard_is_refused(tmp_path: Path) -> None:
    reference = write_shard(tmp_path, "batch", "digest", 0, _shard())
    with pytest.raises(ValueError, match="is not rank 1 of batch batch"):
        SafetensorsShard(reference.path, "batch", "digest", 1).load()
    with pytest.raises(ValueError, match="is not rank 0 of batch other"):
        SafetensorsShard(reference.path, "other", "digest", 0).load()
    tensors = tmp_path / "rank_0.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{tensors} is corrupt"):
        reference.load()


def test_unstorable_column_is_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"column 'train_metadata'\[0\] of type object"):
        write_shard(tmp_path, "batch", "digest", 0, {"train_metadata": [object()]})
