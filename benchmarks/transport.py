"""Transport benchmark: the durable rollout data path (ARCHITECTURE.md §9) against its limits.

Measures, side by side in one run and reported as ratios:

1. durable publication throughput of `pack_rollout_payload` vs raw sequential write + fsync + directory
   fsync of the same number of bytes on the same disk (the physical limit) vs straw-queue's own tensor
   publication (`straw.tensor.publish_tensors`, the dependency's ceiling); repetitions are interleaved so
   that load from other processes hits every path alike;
2. read-back throughput (`DiskPayloadRef.load`, lazy and fully materialized, vs raw read vs `TensorRef.load`);
3. the Ray object store (`ray.put` / `ray.get`) on the same payload;
4. pickled reference sizes (`DiskPayloadRef`, `RolloutGroupRef`, `TrainBatchRef`);
5. batch assembly cost of `finalize_rollout_groups` and the bytes it reads as group payloads grow (neither
   may grow);
6. zstd on vs off for the sample-tree record (bytes on disk, publish and load time);
7. peak memory of publishing a large batch, in a fresh subprocess (`VmHWM` reset before publishing);
8. a cProfile split of one publication: where the time goes when it is below the raw limit.

Numbers are reported, never asserted. Run `python -m benchmarks.transport [--quick] [--out FILE] [--dir DIR]`
(`python -m benchmarks.run` is the same command).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import os
import pickle
import pstats
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.transport_report import machine_info, markdown_table
from slime.data import transport
from slime.data.refs import DiskPayloadRef, TrainBatchRef
from slime.data.tensor import TensorRef, materialize_tensor_refs
from slime.rollout.base_types import finalize_rollout_groups, iter_samples
from slime.utils.types import Sample

MB = 1_000_000
MIB = 1024**2
CHUNK = 4 * MIB
REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest.json"
#: Payload bytes per group in the batch-assembly section (binary units).
ASSEMBLY_SIZES = {"1MB": MIB, "16MB": 16 * MIB, "256MB": 256 * MIB, "1GB": 1024 * MIB}


@dataclasses.dataclass(frozen=True)
class Config:
    """Payload shapes and repetition counts of one benchmark run."""

    groups: int
    group_size: int
    tokens: int
    layers: int
    topk: int
    dict_rows: int
    reps: int
    assembly_groups: int
    assembly_sizes: tuple[str, ...]
    zstd_samples: int
    memory_bytes: int


QUICK = Config(
    groups=2,
    group_size=4,
    tokens=1024,
    layers=24,
    topk=8,
    dict_rows=384,
    reps=3,
    assembly_groups=4,
    assembly_sizes=("1MB", "16MB"),
    zstd_samples=16,
    memory_bytes=64 * MIB,
)
FULL = Config(
    groups=8,
    group_size=8,
    tokens=4096,
    layers=24,
    topk=8,
    dict_rows=3072,
    reps=5,
    assembly_groups=4,
    assembly_sizes=tuple(ASSEMBLY_SIZES),
    zstd_samples=64,
    memory_bytes=1024 * MIB,
)


def _progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _median(samples: list[float]) -> float:
    return statistics.median(samples)


def _interleaved(fns: dict[str, Callable[[int], Any]], reps: int) -> dict[str, list[float]]:
    """Seconds per call of each `fn(rep)`, `reps` times, the functions taking turns within every repetition."""
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(rep)
            seconds[name].append(time.perf_counter() - start)
    return seconds


def _timed(fn: Callable[[int], Any], reps: int) -> list[float]:
    """Seconds per call of `fn(rep)`, `reps` times."""
    return _interleaved({"fn": fn}, reps)["fn"]


def _tree_bytes(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / MB


# --------------------------------------------------------------------------------------------- payloads


def _rollout_sample(index: int, cfg: Config, rng: torch.Generator) -> Sample:
    response = cfg.tokens // 2
    sample = Sample(
        index=index,
        group_index=index // cfg.group_size,
        prompt="Solve the following problem step by step. " * 8,
        tokens=torch.randint(0, 150_000, (cfg.tokens,), generator=rng).tolist(),
        response="The answer follows from the argument above. " * 16,
        response_length=response,
        reward=1.0,
        loss_mask=[1] * response,
        rollout_log_probs=(-torch.rand(response, generator=rng)).tolist(),
        status=Sample.Status.COMPLETED,
    )
    sample.rollout_routed_experts = torch.randint(
        0, 64, (cfg.tokens - 1, cfg.layers, cfg.topk), dtype=torch.int32, generator=rng
    )
    return sample


def rollout_groups(cfg: Config) -> list[list[Sample]]:
    """Rollout-shaped groups: token lists, log-prob lists and a routed-experts tensor per Sample."""
    rng = torch.Generator().manual_seed(0)
    return [
        [_rollout_sample(g * cfg.group_size + k, cfg, rng) for k in range(cfg.group_size)] for g in range(cfg.groups)
    ]


def tensor_dict(cfg: Config) -> dict[str, torch.Tensor]:
    """A tensor-heavy training-batch-like dict (about as many bytes as the rollout groups)."""
    rng = torch.Generator().manual_seed(1)
    rows, width = cfg.dict_rows, cfg.tokens
    return {
        "tokens": torch.randint(0, 150_000, (rows, width), dtype=torch.int32, generator=rng),
        "log_probs": -torch.rand(rows, width, generator=rng),
        "advantages": torch.randn(rows, width, generator=rng),
        "loss_masks": torch.ones(rows, width, dtype=torch.int32),
        "routed_experts": torch.randint(0, 64, (rows, cfg.layers * cfg.topk), dtype=torch.int32, generator=rng),
    }


def payload_tensors(payload: Any) -> dict[str, torch.Tensor]:
    """The same data as flat tensors, for straw's own tensor publication and the Ray comparison baseline."""
    if isinstance(payload, dict):
        return dict(payload)
    tensors = {}
    for sample in iter_samples(payload):
        tensors[f"{sample.index}.tokens"] = torch.tensor(sample.tokens, dtype=torch.int32)
        tensors[f"{sample.index}.log_probs"] = torch.tensor(sample.rollout_log_probs, dtype=torch.float32)
        tensors[f"{sample.index}.routed_experts"] = sample.rollout_routed_experts
    return tensors


def materialize(value: Any) -> Any:
    """Load every lazy `TensorRef` a decoded payload holds (Sample replay fields and nested containers)."""
    if isinstance(value, dict):
        return materialize_tensor_refs(value)
    for sample in iter_samples(value):
        for key, item in list(vars(sample).items()):
            if isinstance(item, TensorRef):
                setattr(sample, key, item.load())
    return value


def _text(rng: random.Random, words: int) -> str:
    vocabulary = (
        "the of and to in is that for it as with was on be by this are or an which from at not but have "
        "we can if all their one has so equation solve value therefore function number step answer let "
        "proof since given first second result follows where then sum integer prime root square"
    ).split()
    return " ".join(rng.choice(vocabulary) for _ in range(words))


def zstd_samples(kind: str, cfg: Config) -> list[Sample]:
    """Samples without tensors: `text` (long prompts/responses) or `tokens` (long token and log-prob lists)."""
    rng = random.Random(2)
    samples = []
    for index in range(cfg.zstd_samples):
        if kind == "text":
            prompt, response, tokens = _text(rng, 600), _text(rng, 1500), list(range(64))
        else:
            prompt, response = "Solve.", "Done."
            tokens = [rng.randrange(150_000) for _ in range(cfg.tokens)]
        length = len(tokens) // 2
        samples.append(
            Sample(
                index=index,
                prompt=prompt,
                response=response,
                tokens=tokens,
                response_length=length,
                loss_mask=[1] * length,
                rollout_log_probs=[-rng.random() for _ in range(length)],
                reward=rng.random(),
                status=Sample.Status.COMPLETED,
                metadata={"source": "bench", "turn": index % 4},
            )
        )
    return samples


# --------------------------------------------------------------------------------------------- pools


class Pool:
    """A fresh straw pool under the benchmark directory, closed and deleted by `close()`."""

    def __init__(self, base: Path, name: str, **options: Any) -> None:
        self.root = base / f"{name}-{uuid.uuid4().hex[:8]}"
        self.root.mkdir(parents=True)
        self.args = types.SimpleNamespace(rollout_data_transport="straw", rollout_data_dir=str(self.root), **options)
        self.store = transport.rollout_store(self.args)[0]

    def with_options(self, **options: Any) -> types.SimpleNamespace:
        """Args for the same pool (same cached writer) with other codec options."""
        return types.SimpleNamespace(**{**vars(self.args), **options})

    def close(self) -> None:
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _raw_write(path: Path, data: memoryview) -> None:
    with open(path, "wb") as handle:
        for start in range(0, len(data), CHUNK):
            handle.write(data[start : start + CHUNK])
        handle.flush()
        os.fsync(handle.fileno())
    _fsync_dir(path.parent)


def _raw_read(path: Path, nbytes: int) -> bytearray:
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        filled = 0
        while filled < nbytes:
            count = handle.readinto(view[filled : filled + CHUNK])
            if not count:
                raise OSError(f"{path} is shorter than the {nbytes} bytes just written")
            filled += count
    return buffer


def _raw_source(tensors: dict[str, torch.Tensor], nbytes: int) -> memoryview:
    """`nbytes` bytes made of the payload's own tensor bytes (repeated if the record overhead needs more)."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors.values() if t.numel()]
    data = torch.cat(parts)
    if data.numel() < nbytes:
        data = data.repeat(nbytes // data.numel() + 1)
    return memoryview(data[:nbytes].numpy())


# --------------------------------------------------------------------------------------------- sections


def bench_publish_and_read(name: str, payload: Any, base: Path, cfg: Config, results: dict) -> None:
    """Sections 1 and 2 for one payload; also leaves the byte count for the Ray section.

    Each repetition runs every path once, in turn (pack, raw, straw; then the reads), so that load from
    other processes on a shared machine lands on all of them alike instead of on one path's block of runs.
    """
    from straw.tensor import publish_tensors

    pool = Pool(base, f"publish-{name}")
    raw_dir = base / f"raw-{name}"
    raw_dir.mkdir()
    try:
        before = _tree_bytes(pool.root)
        refs = [transport.pack_rollout_payload(payload, pool.args, "warmup")]
        nbytes = _tree_bytes(pool.root) - before
        tensors = payload_tensors(payload)
        source = _raw_source(tensors, nbytes)
        tensor_refs: list[tuple] = []
        timings = _interleaved(
            {
                "pack": lambda rep: refs.append(transport.pack_rollout_payload(payload, pool.args, rep)),
                "raw": lambda rep: _raw_write(raw_dir / f"{rep}.bin", source),
                "straw": lambda rep: tensor_refs.append(
                    publish_tensors(pool.store, tensors, submission_id=f"bench:{name}:{rep}:{uuid.uuid4().hex}")
                ),
            },
            cfg.reps,
        )
        pack, raw, straw = timings["pack"], timings["raw"], timings["straw"]
        _progress(
            f"publish {name}: pack_rollout_payload {_mbps(nbytes, _median(pack)):.0f} MB/s, raw write+fsync "
            f"{_mbps(nbytes, _median(raw)):.0f} MB/s, straw publish_tensors {_mbps(nbytes, _median(straw)):.0f} MB/s "
            f"({nbytes / MB:.1f} MB)"
        )
        results["publish"][name] = {
            "bytes": nbytes,
            "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "pack_rollout_payload_s": _median(pack),
            "raw_write_fsync_s": _median(raw),
            "straw_publish_tensors_s": _median(straw),
            "pack_rollout_payload_mbps": _mbps(nbytes, _median(pack)),
            "raw_write_fsync_mbps": _mbps(nbytes, _median(raw)),
            "straw_publish_tensors_mbps": _mbps(nbytes, _median(straw)),
            "pack_vs_raw": _median(raw) / _median(pack),
            "pack_vs_straw": _median(straw) / _median(pack),
            "timings_s": {"pack_rollout_payload": pack, "raw_write_fsync": raw, "straw_publish_tensors": straw},
        }

        timings = _interleaved(
            {
                "lazy": lambda rep: refs[rep + 1].load(),
                "full": lambda rep: materialize(refs[rep + 1].load()),
                "raw_read": lambda rep: _raw_read(raw_dir / f"{rep}.bin", nbytes),
                "tensor_read": lambda rep: [ref.load() for ref in tensor_refs[rep]],
            },
            cfg.reps,
        )
        lazy, full, raw_read, tensor_read = (timings[key] for key in ("lazy", "full", "raw_read", "tensor_read"))
        _progress(
            f"read {name}: DiskPayloadRef.load+materialize {_mbps(nbytes, _median(full)):.0f} MB/s, raw read "
            f"{_mbps(nbytes, _median(raw_read)):.0f} MB/s (page cache), TensorRef.load "
            f"{_mbps(nbytes, _median(tensor_read)):.0f} MB/s"
        )
        results["read"][name] = {
            "bytes": nbytes,
            "disk_payload_ref_load_lazy_s": _median(lazy),
            "disk_payload_ref_load_full_s": _median(full),
            "raw_read_s": _median(raw_read),
            "tensor_ref_load_s": _median(tensor_read),
            "disk_payload_ref_load_full_mbps": _mbps(nbytes, _median(full)),
            "raw_read_mbps": _mbps(nbytes, _median(raw_read)),
            "tensor_ref_load_mbps": _mbps(nbytes, _median(tensor_read)),
            "load_vs_raw": _median(raw_read) / _median(full),
            "load_vs_tensor_ref": _median(tensor_read) / _median(full),
            "timings_s": {
                "disk_payload_ref_load_lazy": lazy,
                "disk_payload_ref_load_full": full,
                "raw_read": raw_read,
                "tensor_ref_load": tensor_read,
            },
        }
        results["profile"][name] = profile_publication(payload, pool.args, nbytes, _median(raw))
    finally:
        pool.close()
        shutil.rmtree(raw_dir, ignore_errors=True)


#: cProfile functions (by name) whose own time is attributed to one part of a publication.
PROFILE_PARTS = {
    "publish": "straw native publish (pack write + fsync + straw's own checks, in Rust)",
    "openssl_sha256": "sha256 chunk digests of tensor records (straw.tensor.tensor_record, hashlib)",
}


def profile_publication(payload: Any, args: Any, nbytes: int, raw_s: float) -> dict:
    """One more `pack_rollout_payload` under cProfile, its own time split into the parts of `PROFILE_PARTS`.

    Everything not in those parts is our Python (tree walk, number arenas, JSON, reference building).
    `raw_write_fsync_s` is the raw limit for the same bytes, so `native - raw` is what straw adds inside Rust.
    """
    profiler = cProfile.Profile()
    profiler.enable()
    transport.pack_rollout_payload(payload, args, "profile")
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    parts = dict.fromkeys(PROFILE_PARTS, 0.0)
    total, top = 0.0, []
    for (filename, line, function), (_, _, own, _, _) in stats.items():
        total += own
        top.append((own, f"{Path(filename).name}:{line}({function})"))
        for key in PROFILE_PARTS:
            if (key == "publish" and function == "<method 'publish' of 'builtins.NativeStore' objects>") or (
                key != "publish" and key in function
            ):
                parts[key] += own
    split = {PROFILE_PARTS[key]: seconds for key, seconds in parts.items()}
    split["slime codec and Python glue (tree walk, number arenas, JSON, refs)"] = total - sum(parts.values())
    _progress("profile: " + ", ".join(f"{key.split(' (')[0]} {value * 1000:.0f} ms" for key, value in split.items()))
    return {
        "bytes": nbytes,
        "total_s": total,
        "raw_write_fsync_s": raw_s,
        "split_s": split,
        "top_own_time": [[name, seconds] for seconds, name in sorted(top, reverse=True)[:8]],
    }


def _ray_round_trip(ray: Any, name: str, payload: Any, cfg: Config, results: dict) -> None:
    nbytes = results["publish"][name]["bytes"]
    objects: list = []
    put = _median(_timed(lambda rep: objects.append(ray.put(payload)), cfg.reps))
    get = _median(_timed(lambda rep: materialize(ray.get(objects[rep])), cfg.reps))
    results["ray"][name] = {
        "bytes": nbytes,
        "ray_put_s": put,
        "ray_get_s": get,
        "ray_put_mbps": _mbps(nbytes, put),
        "ray_get_mbps": _mbps(nbytes, get),
        "pack_vs_ray_put": put / results["publish"][name]["pack_rollout_payload_s"],
        "load_vs_ray_get": get / results["read"][name]["disk_payload_ref_load_full_s"],
    }
    _progress(f"ray {name}: put {_mbps(nbytes, put):.0f} MB/s, get {_mbps(nbytes, get):.0f} MB/s")


def bench_ray(payloads: dict[str, Any], cfg: Config, results: dict) -> None:
    """Section 3: `ray.put` / `ray.get` of the same payloads (not durable), one local Ray with one CPU."""
    import ray

    largest = max(results["publish"][name]["bytes"] for name in payloads)
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        object_store_memory=max(256 * 1024**2, 4 * largest),
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        for name, payload in payloads.items():
            _ray_round_trip(ray, name, payload, cfg, results)
    finally:
        ray.shutdown()


def bench_ref_sizes(groups: list, base: Path, results: dict) -> None:
    """Section 4: pickled bytes of the references that travel through Ray, next to the payload's."""
    pool = Pool(base, "refs")
    try:
        payload_ref = transport.pack_rollout_payload(groups, pool.args, 0)
        group_ref = transport.pack_rollout_group(groups[0], pool.args, 0)
        batch_ref = TrainBatchRef(
            payload_ref.manifest,
            payload_ref.root,
            batch_id=uuid.uuid4().hex,
            rank=0,
            plan_digest="0" * 64,
            selection={"rows": list(range(len(groups) * len(groups[0])))},
        )
        sizes = {
            "DiskPayloadRef": len(pickle.dumps(payload_ref)),
            "RolloutGroupRef": len(pickle.dumps(group_ref)),
            "TrainBatchRef": len(pickle.dumps(batch_ref)),
            "payload_pickle": len(pickle.dumps(groups)),
        }
    finally:
        pool.close()
    results["ref_sizes"] = sizes
    _progress("ref sizes: " + ", ".join(f"{key} {value} B" for key, value in sizes.items()))


def _io_counters() -> dict[str, int]:
    """This process's `/proc/self/io`: `rchar` counts every byte read through read(2), page cache or not."""
    with open("/proc/self/io") as handle:
        return {key: int(value) for key, value in (line.split(": ") for line in handle.read().splitlines())}


def _assembly_group(index: int, nbytes: int) -> list[Sample]:
    """One single-sample group whose routed-experts tensor holds `nbytes` bytes ((rows, 64, 64) int32, zeros)."""
    rows = max(1, nbytes // (64 * 64 * 4))
    sample = Sample(index=index, group_index=index, tokens=list(range(rows + 1)), response_length=rows, reward=1.0)
    sample.rollout_routed_experts = torch.zeros(rows, 64, 64, dtype=torch.int32)
    sample.status = Sample.Status.COMPLETED
    return [sample]


def _assembly_cost(base: Path, label: str, nbytes: int, cfg: Config) -> dict:
    pool = Pool(base, f"assembly-{label}")
    try:
        refs = []
        for i in range(cfg.assembly_groups):  # one group in memory at a time
            refs.append(transport.pack_rollout_group(_assembly_group(i, nbytes), pool.args, 0))
        group_bytes = _tree_bytes(pool.root)
        pack_files = len(list(pool.root.rglob("*.pack")))
        refs.reverse()  # finalize sorts by group index
        finalize_rollout_groups(pool.args, "warmup", list(refs))
        read: list[int] = []
        written: list[int] = []

        def finalize(rep: int) -> None:
            before = _io_counters()
            finalize_rollout_groups(pool.args, rep, list(refs))
            after = _io_counters()
            read.append(after["rchar"] - before["rchar"])
            written.append(after["wchar"] - before["wchar"])

        seconds = _timed(finalize, 3 * cfg.reps)
    finally:
        pool.close()
    _progress(
        f"assembly {label}/group: finalize_rollout_groups {_median(seconds) * 1000:.1f} ms, "
        f"{_median(read)} B read of {group_bytes / MB:.0f} MB published in {pack_files} pack files"
    )
    return {
        "group_bytes": nbytes,
        "groups": cfg.assembly_groups,
        "published_bytes": group_bytes,
        "pack_files": pack_files,
        "finalize_s": _median(seconds),
        "per_group_ms": _median(seconds) / cfg.assembly_groups * 1000,
        "read_bytes": _median(read),
        "read_bytes_max": max(read),
        "written_bytes": _median(written),
        "timings_s": seconds,
    }


def bench_assembly(base: Path, cfg: Config, results: dict) -> None:
    """Section 5: `finalize_rollout_groups` over published group refs; neither time nor bytes read may grow."""
    section: dict[str, Any] = {
        label: _assembly_cost(base, label, ASSEMBLY_SIZES[label], cfg) for label in cfg.assembly_sizes
    }
    smallest, largest = section[cfg.assembly_sizes[0]], section[cfg.assembly_sizes[-1]]
    section["growth"] = {
        "payload": largest["group_bytes"] / smallest["group_bytes"],
        "time": largest["finalize_s"] / smallest["finalize_s"],
    }
    results["assembly"] = section


def _record_bytes(store: Any, ref: DiskPayloadRef) -> int:
    with store.read_session() as session:
        return sum(len(record.payload) for record in session.read(ref.manifest))


def _zstd_cost(base: Path, kind: str, compression: str, samples: list[Sample], cfg: Config) -> dict:
    pool = Pool(base, f"zstd-{kind}-{compression}", rollout_data_compression=compression)
    try:
        before = _tree_bytes(pool.root)
        refs = [transport.pack_rollout_payload(samples, pool.args, "warmup")]
        disk = _tree_bytes(pool.root) - before
        publish = _median(
            _timed(lambda rep: refs.append(transport.pack_rollout_payload(samples, pool.args, rep)), 3 * cfg.reps)
        )
        load = _median(_timed(lambda rep: refs[rep].load(), 3 * cfg.reps))
        record = _record_bytes(pool.store, refs[0])
    finally:
        pool.close()
    _progress(
        f"zstd {kind} {compression}: {record / 1000:.0f} kB record, "
        f"publish {publish * 1000:.1f} ms, load {load * 1000:.1f} ms"
    )
    return {"record_bytes": record, "disk_bytes": disk, "publish_s": publish, "load_s": load}


def bench_zstd(base: Path, cfg: Config, results: dict) -> None:
    """Section 6: the sample-tree record with and without zstd, for text-heavy and token-heavy samples."""
    section = {}
    for kind in ("text", "tokens"):
        samples = zstd_samples(kind, cfg)
        entry: dict[str, Any] = {
            compression: _zstd_cost(base, kind, compression, samples, cfg) for compression in ("none", "zstd")
        }
        entry["bytes_ratio"] = entry["zstd"]["record_bytes"] / entry["none"]["record_bytes"]
        entry["disk_ratio"] = entry["zstd"]["disk_bytes"] / entry["none"]["disk_bytes"]
        entry["publish_ratio"] = entry["zstd"]["publish_s"] / entry["none"]["publish_s"]
        entry["load_ratio"] = entry["zstd"]["load_s"] / entry["none"]["load_s"]
        section[kind] = entry
    results["zstd"] = section


def _proc_status() -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of this process, in bytes."""
    with open("/proc/self/status") as handle:
        fields = dict(line.split(":", 1) for line in handle.read().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux `clear_refs` 5); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


def memory_child(nbytes: int, directory: str) -> dict:
    """Run in a fresh process: publish rollout groups of about `nbytes` tensor bytes, report the peak RSS it adds.

    The payload is built first, a small warm-up publication loads everything publication needs, then the
    peak RSS is reset and the one publication measured: `peak_extra_bytes` is the memory the publication
    itself held above the process (payload included) before it started.
    """
    cfg = dataclasses.replace(FULL, groups=1, group_size=8)
    per_sample = (cfg.tokens - 1) * cfg.layers * cfg.topk * 4
    groups = rollout_groups(dataclasses.replace(cfg, groups=max(1, -(-nbytes // (per_sample * cfg.group_size)))))
    tensor_bytes = sum(s.rollout_routed_experts.numel() * 4 for s in iter_samples(groups))
    pool = Pool(Path(directory), "memory")
    try:
        transport.pack_rollout_payload(rollout_groups(dataclasses.replace(cfg, tokens=64)), pool.args, "warmup")
        gc.collect()
        status = _proc_status()
        maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        reset = _reset_peak_rss()
        started = time.perf_counter()
        transport.pack_rollout_payload(groups, pool.args, "measured")
        seconds = time.perf_counter() - started
        after = _proc_status()
        maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    finally:
        pool.close()
    peak = after["VmHWM"] if reset else max(after["VmHWM"], maxrss_after)
    extra = max(0, peak - status["VmRSS"])
    return {
        "payload_tensor_bytes": tensor_bytes,
        "samples": sum(1 for _ in iter_samples(groups)),
        "rss_before_bytes": status["VmRSS"],
        "hwm_before_bytes": status["VmHWM"],
        "ru_maxrss_before_bytes": maxrss_before,
        "hwm_after_bytes": after["VmHWM"],
        "ru_maxrss_after_bytes": maxrss_after,
        "hwm_reset": reset,
        "peak_extra_bytes": extra,
        "peak_extra_x_payload": extra / tensor_bytes,
        "publish_s": seconds,
    }


def bench_memory(base: Path, cfg: Config, results: dict) -> None:
    """Section 7: peak extra RSS of publishing about `cfg.memory_bytes` of rollout groups, in a fresh subprocess."""
    code = (
        "import json, sys\n"
        "from benchmarks.transport import memory_child\n"
        "print(json.dumps(memory_child(int(sys.argv[1]), sys.argv[2])))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code, str(cfg.memory_bytes), str(base)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"memory benchmark subprocess failed ({completed.returncode}): {completed.stderr[-4000:]}")
    entry = json.loads(completed.stdout.strip().splitlines()[-1])
    _progress(
        f"memory: publishing {entry['payload_tensor_bytes'] / MB:.0f} MB held {entry['peak_extra_bytes'] / MB:.0f} MB "
        f"extra at peak ({entry['peak_extra_x_payload']:.2f}x the payload; VmHWM reset: {entry['hwm_reset']})"
    )
    results["memory"] = entry


# --------------------------------------------------------------------------------------------- main


def run(cfg: Config, directory: Path, mode: str) -> dict:
    """Every section in one process, on one disk; returns the JSON report."""
    results: dict[str, Any] = {
        "mode": mode,
        "config": dataclasses.asdict(cfg),
        "machine": machine_info(directory),
        "publish": {},
        "read": {},
        "ray": {},
        "profile": {},
    }
    groups = rollout_groups(cfg)
    payloads = {"samples": groups, "tensor_dict": tensor_dict(cfg)}
    for name, payload in payloads.items():
        bench_publish_and_read(name, payload, directory, cfg, results)
    bench_ray(payloads, cfg, results)
    bench_ref_sizes(groups, directory, results)
    bench_assembly(directory, cfg, results)
    bench_zstd(directory, cfg, results)
    bench_memory(directory, cfg, results)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transport", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small payloads, 3 repetitions (about a minute)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON report (default {DEFAULT_OUT})")
    parser.add_argument("--dir", type=Path, default=None, help="where temporary pools go (default: a tempfile dir)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per measurement (median reported)")
    options = parser.parse_args(argv)
    cfg = QUICK if options.quick else FULL
    if options.reps is not None:
        if options.reps < 1:
            parser.error("--reps must be at least 1")
        cfg = dataclasses.replace(cfg, reps=options.reps)
    if options.dir is not None:
        options.dir.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="slime-bench-", dir=options.dir))
    started = time.perf_counter()
    try:
        results = run(cfg, directory, "quick" if options.quick else "full")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - started
    table = markdown_table(results)
    results["table"] = table
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(results, indent=2) + "\n")
    print(table)
    _progress(f"report written to {options.out} ({results['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
