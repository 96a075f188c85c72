"""Debug archives (`slime.data.archive.RolloutArchive`) and `slime-run archive show`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("straw")

from straw.tensor import TensorRef  # noqa: E402

from slime.archive_cli import run_archive_cli  # noqa: E402
from slime.data.archive import CHUNK_SIZE, RolloutArchive  # noqa: E402
from slime.data.codec import SampleCodec  # noqa: E402
from slime.data.transport import pack_rollout_payload, rollout_store  # noqa: E402
from slime.observability.rollout_data_utils import load_debug_rollout_data  # noqa: E402
from slime.utils.types import Sample  # noqa: E402


@pytest.fixture
def args(tmp_path):
    return SimpleNamespace(rollout_data_transport="straw", rollout_data_dir=str(tmp_path / "pool"))


def _samples(count: int = 3) -> list[Sample]:
    samples = []
    for i in range(count):
        sample = Sample(index=i, tokens=[1, 2, i], response_length=2, reward=0.5 * i, metadata={"n": i})
        sample.rollout_routed_experts = torch.full((2, 1, 2), i, dtype=torch.int32)
        sample.custom_note = f"note-{i}"
        samples.append(sample)
    return samples


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_standalone_round_trip_keeps_fields_and_lazy_tensors(tmp_path):
    path = tmp_path / "dump" / "rollout_3.straw.json"
    path.parent.mkdir()
    samples = _samples()
    samples[1]._queue_receipt = {"task_id": "prompt:1", "position": 5}
    samples[2]._queue_lease = {"task_id": "prompt:2", "attempt_id": "a"}
    samples[2]._queue_generation_start = 3
    assert RolloutArchive.save(path, samples, rollout_id=3) == path
    index = json.loads(path.read_text())
    assert index["format"] == "slime.straw-debug" and index["version"] == 1 and index["rollout_id"] == 3
    assert index["root"] == str((tmp_path / "dump" / "straw-data").resolve())
    assert index["storage_owner"].startswith(f"debug:{path.resolve()}:")
    assert not list(path.parent.glob("*.partial"))
    with RolloutArchive(path) as archive:
        assert archive.manifest.manifest.segment.run_id == "debug-rollout"
        assert archive.keys() == [("sample:0", None), ("sample:1", "prompt:1"), ("sample:2", "prompt:2")]
        restored = archive.load_samples()
        assert [s.tokens for s in restored] == [s.tokens for s in samples]
        assert [s.custom_note for s in restored] == ["note-0", "note-1", "note-2"]
        assert [s.metadata for s in restored] == [{"n": 0}, {"n": 1}, {"n": 2}]
        for sample in restored:
            assert isinstance(sample.rollout_routed_experts, TensorRef)
            assert not any(
                hasattr(sample, name) for name in ("_queue_receipt", "_queue_lease", "_queue_generation_start")
            )
        assert torch.equal(restored[2].rollout_routed_experts.load(), samples[2].rollout_routed_experts)
        # Loading twice gives fresh copies: stripping never mutates what a later load returns.
        assert archive.load_samples(task_key="prompt:2")[0].tokens == [1, 2, 2]


def test_evaluation_archive_and_export_are_self_contained(tmp_path):
    path = tmp_path / "eval.straw.json"
    RolloutArchive.save(path, _samples(2), rollout_id=4, evaluation=True)
    export = tmp_path / "out" / "eval.pt"
    with RolloutArchive(path) as archive:
        assert archive.rollout_id == "eval_4" and archive.index["evaluation"] is True
        assert archive.export_pt(export) == export
    shutil.rmtree(tmp_path / "straw-data")
    dump = torch.load(export, weights_only=True)
    assert dump["rollout_id"] == "eval_4"
    [first, second] = load_debug_rollout_data(str(export), rollout_id=4)
    assert isinstance(second.rollout_routed_experts, torch.Tensor)
    assert second.rollout_routed_experts.tolist() == [[[1, 1]], [[1, 1]]]
    assert not list(export.parent.glob("*.partial"))


def test_reads_only_the_selected_chunks_and_keeps_duplicate_and_positional_keys(args, tmp_path, monkeypatch):
    samples = [Sample(index=i, tokens=[i]) for i in range(2 * CHUNK_SIZE + 2)]
    samples[CHUNK_SIZE + 1].index = 0  # duplicate of a sample in the first chunk
    samples[-1].index = None  # positional key
    path = tmp_path / "big.straw.json"
    RolloutArchive.save(path, samples, rollout_id=0, args=args)
    with RolloutArchive(path) as archive:
        assert len(archive.sample_refs()) == 3 and archive.mode == "chunks"
        assert archive.keys()[-1] == (f"position:{len(samples) - 1}", None)
        reads = []
        load = archive.codec.load

        def tracked(ref, **kwargs):
            if not kwargs:  # the codec re-enters `load` with its read session
                reads.append(ref)
            return load(ref, **kwargs)

        monkeypatch.setattr(archive.codec, "load", tracked)
        assert [s.tokens for s in archive.load_samples(sample_key="sample:0")] == [[0], [CHUNK_SIZE + 1]]
        assert reads == [archive.sample_refs()[0].manifest, archive.sample_refs()[1].manifest]
        reads.clear()
        assert [s.tokens for s in archive.load_samples(sample_key=f"position:{len(samples) - 1}")] == [
            [len(samples) - 1]
        ]
        assert reads == [archive.sample_refs()[2].manifest]
        reads.clear()
        assert len(archive.load_samples()) == len(samples) and len(reads) == 3
        with pytest.raises(KeyError):
            archive.load_samples(sample_key="sample:0", task_key="prompt:0")


def test_archives_are_immutable_and_a_rejected_save_writes_nothing(args, tmp_path):
    path = tmp_path / "once.straw.json"
    RolloutArchive.save(path, _samples(1), rollout_id=0, args=args)
    before, index = _files(tmp_path), path.read_bytes()
    with pytest.raises(FileExistsError, match="immutable"):
        RolloutArchive.save(path, _samples(2), rollout_id=0, args=args)
    with pytest.raises(FileExistsError, match="immutable"):
        RolloutArchive.save(path, _samples(2), rollout_id=0)
    assert _files(tmp_path) == before and path.read_bytes() == index


def test_reference_mode_copies_nothing_and_must_share_the_pool(args, tmp_path, monkeypatch):
    samples = _samples(2)
    for sample in samples:
        sample._queue_receipt = {"task_id": f"prompt:{sample.index}", "position": 9}
    raw = pack_rollout_payload(samples, args, 0)
    path = tmp_path / "ref.straw.json"
    with monkeypatch.context() as guard:
        guard.setattr(SampleCodec, "_prepare_sample", lambda *a: pytest.fail("re-encoded an archived Sample"))
        RolloutArchive.save(path, samples, rollout_id=0, args=args, reference=raw)
    with RolloutArchive(path) as archive:
        assert archive.mode == "reference" and archive.sample_refs() == [raw]
        assert archive.keys() == [("sample:0", "prompt:0"), ("sample:1", "prompt:1")]
        [second] = archive.load_samples(sample_key="sample:1")
        assert second.tokens == [1, 2, 1] and not hasattr(second, "_queue_receipt")
        assert second.rollout_routed_experts.record_ref == raw.load()[1].rollout_routed_experts.record_ref
    other = SimpleNamespace(rollout_data_transport="straw", rollout_data_dir=str(tmp_path / "other"))
    for kwargs, target in ((dict(args=other), "a.straw.json"), ({}, "b.straw.json")):
        with pytest.raises(ValueError, match="must belong to its storage pool"):
            RolloutArchive.save(tmp_path / target, samples, rollout_id=0, reference=raw, **kwargs)
        assert not (tmp_path / target).exists()
    assert not (tmp_path / "straw-data").exists()


def test_archive_retention_outlives_the_run_until_release(args, tmp_path):
    args.rollout_queue_online_gc = True
    original = pack_rollout_payload(_samples(2), args, 0)
    loaded = original.load()
    tensor_pack = Path(loaded[0].rollout_routed_experts.path)
    path = tmp_path / "kept.straw.json"
    RolloutArchive.save(path, loaded, rollout_id=0, args=args)
    store, _, _ = rollout_store(args)
    store.release_publications([original.manifest])
    store.seal()
    store.collect_garbage()
    assert tensor_pack.exists()
    with RolloutArchive(path) as archive:
        [sample] = archive.load_samples(sample_key="sample:1")
        assert sample.rollout_routed_experts.record_ref == loaded[1].rollout_routed_experts.record_ref
        assert sample.rollout_routed_experts.load().tolist() == [[[1, 1]], [[1, 1]]]
        archive.release()
    store.seal()
    store.collect_garbage()
    assert not tensor_pack.exists()
    assert path.exists()
    with pytest.raises(ValueError, match=r"kept\.straw\.json.*missing packs"):
        RolloutArchive(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda index: index.update(format="other.format"), "Unsupported straw rollout archive"),
        (lambda index: index.update(version=2), "Unsupported straw rollout archive"),
        (lambda index: index.pop("manifest"), "missing manifest"),
    ],
)
def test_bad_index_is_rejected_naming_the_file(tmp_path, edit, message):
    path = tmp_path / "bad.straw.json"
    RolloutArchive.save(tmp_path / "good.straw.json", _samples(1), rollout_id=0)
    index = json.loads((tmp_path / "good.straw.json").read_text())
    edit(index)
    path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=message) as error:
        RolloutArchive(path)
    assert str(path) in str(error.value)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="Unsupported straw rollout archive"):
        RolloutArchive(path)
    with pytest.raises(FileNotFoundError):
        RolloutArchive(tmp_path / "absent.straw.json")


def test_unmounted_pool_is_reported_and_another_mount_point_works(tmp_path):
    path = tmp_path / "a" / "moved.straw.json"
    path.parent.mkdir()
    RolloutArchive.save(path, _samples(2), rollout_id=1)
    pool = tmp_path / "a" / "straw-data"
    mounted = tmp_path / "elsewhere"
    shutil.copytree(pool, mounted)
    shutil.rmtree(pool)
    with pytest.raises(FileNotFoundError, match=r"not mounted.*moved\.straw\.json|moved\.straw\.json.*not mounted"):
        RolloutArchive(path)
    assert not pool.exists()
    with RolloutArchive(path, root=str(mounted)) as archive:
        [sample] = archive.load_samples(sample_key="sample:1")
        assert sample.rollout_routed_experts.load().tolist() == [[[1, 1]], [[1, 1]]]


def test_missing_chunk_is_reported_naming_the_archive(args, tmp_path):
    args.rollout_queue_segment_mib = 0.05  # chunk and contents land in different packs
    samples = [Sample(index=i, tokens=[i], metadata={"pad": "x" * 40000}) for i in range(2)]
    path = tmp_path / "holes.straw.json"
    RolloutArchive.save(path, samples, rollout_id=0, args=args)
    with RolloutArchive(path) as archive:
        [chunk] = archive.sample_refs()
        chunk_pack = Path(archive.index["root"]) / chunk.manifest.manifest.segment.path
        assert chunk.manifest.manifest.segment.path != archive.manifest.manifest.segment.path
    chunk_pack.unlink()
    with pytest.raises(ValueError, match=r"holes\.straw\.json.*missing packs: raw/"):
        RolloutArchive(path)


def test_cli_show_prints_the_summary_and_exports(tmp_path, capsys):
    samples = [Sample(index=i, tokens=[i]) for i in range(25)]
    for sample in samples[:3]:
        sample._queue_lease = {"task_id": f"prompt:{sample.index}"}
    path = tmp_path / "cli.straw.json"
    RolloutArchive.save(path, samples, rollout_id=12)
    export = tmp_path / "cli.pt"
    assert run_archive_cli(["show", str(path), "--export", str(export)]) == 0
    out = capsys.readouterr().out
    assert "rollout id: 12" in out
    assert f"pool:       {(tmp_path / 'straw-data').resolve()}" in out
    assert "run id:     debug-rollout" in out
    assert "samples:    25" in out
    assert "sample keys (25): sample:0, sample:1," in out and "sample:19 ... (+5 more)" in out
    assert "sample:20" not in out
    assert "task keys (3): prompt:0, prompt:1, prompt:2; 22 samples without a task" in out
    assert "layout:     1 chunks" in out and "index file:" in out and "stored:" in out
    assert f"exported 25 samples to {export}" in out
    assert [s.tokens for s in load_debug_rollout_data(str(export), rollout_id=12)] == [[i] for i in range(25)]
    from slime.cli import main

    assert main(["archive", "show", str(path)]) == 0
    assert "samples:    25" in capsys.readouterr().out


def test_cli_reports_a_bad_archive(tmp_path, capsys):
    path = tmp_path / "bad.straw.json"
    path.write_text(json.dumps({"format": "slime.straw-debug", "version": 9}))
    assert run_archive_cli(["show", str(path)]) == 1
    err = capsys.readouterr().err
    assert "slime-run archive: error: Unsupported straw rollout archive" in err and str(path) in err
    with pytest.raises(SystemExit):
        run_archive_cli([])


def test_contents_naming_an_absent_chunk_is_rejected(args, tmp_path):
    import dataclasses

    from straw.reporting import write_report

    store, codec, _ = rollout_store(args)
    contents = {"chunks": [], "entries": [{"sample_key": "sample:0", "task_key": None, "chunk": 0, "offset": 0}]}
    manifest = codec.publish(contents, submission_id="forged-contents")
    path = tmp_path / "forged.straw.json"
    index = {"format": "slime.straw-debug", "version": 1, "rollout_id": 0, "evaluation": False}
    write_report(
        path, {**index, "root": str(store.backend.root), "manifest": dataclasses.asdict(manifest), "storage_owner": "x"}
    )
    with pytest.raises(ValueError, match=r"forged\.straw\.json is corrupt: entry sample:0 names missing chunk 0"):
        RolloutArchive(path)
