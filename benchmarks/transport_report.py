"""The transport benchmark's report: the machine block and the markdown table (docs/benchmarks.md)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from pathlib import Path

import torch

MB = 1_000_000


def machine_info(directory: Path) -> dict:
    """Date, CPUs, platform and the versions that the numbers depend on; `directory` is the disk measured."""

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average_at_start": list(load) if load else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "straw": version("straw-queue"),
        "ray": version("ray"),
        "zstandard": version("zstandard"),
        "directory": str(directory),
    }


def _ratio(value: float) -> str:
    return f"{value:.2g}x"


def _publish_rows(results: dict) -> list[str]:
    rows = []
    for name, pub in results["publish"].items():
        label = f"publish {name} ({pub['bytes'] / MB:.1f} MB)"
        rows.append(f"| {label} | raw write + fsync + dir fsync | {pub['raw_write_fsync_mbps']:.0f} MB/s | 1.00x |")
        rows.append(
            f"| {label} | straw `publish_tensors` | {pub['straw_publish_tensors_mbps']:.0f} MB/s | "
            f"{_ratio(pub['raw_write_fsync_s'] / pub['straw_publish_tensors_s'])} of raw |"
        )
        rows.append(
            f"| {label} | `pack_rollout_payload` | {pub['pack_rollout_payload_mbps']:.0f} MB/s | "
            f"{_ratio(pub['pack_vs_raw'])} of raw, {_ratio(pub['pack_vs_straw'])} of straw |"
        )
        ray_row = results["ray"][name]
        rows.append(
            f"| {label} | `ray.put` (not durable) | {ray_row['ray_put_mbps']:.0f} MB/s | "
            f"pack = {_ratio(ray_row['pack_vs_ray_put'])} of ray.put |"
        )
    return rows


def _read_rows(results: dict) -> list[str]:
    rows = []
    for name, read in results["read"].items():
        label = f"read {name}"
        rows.append(f"| {label} | raw read (page cache) | {read['raw_read_mbps']:.0f} MB/s | 1.00x |")
        rows.append(
            f"| {label} | `TensorRef.load` | {read['tensor_ref_load_mbps']:.0f} MB/s | "
            f"{_ratio(read['raw_read_s'] / read['tensor_ref_load_s'])} of raw |"
        )
        rows.append(
            f"| {label} | `DiskPayloadRef.load` + materialize | {read['disk_payload_ref_load_full_mbps']:.0f} MB/s | "
            f"{_ratio(read['load_vs_raw'])} of raw, {_ratio(read['load_vs_tensor_ref'])} of TensorRef |"
        )
        rows.append(
            f"| {label} | `DiskPayloadRef.load` alone (replay fields stay lazy) | "
            f"{read['disk_payload_ref_load_lazy_s'] * 1000:.1f} ms | |"
        )
        ray_row = results["ray"][name]
        rows.append(
            f"| {label} | `ray.get` | {ray_row['ray_get_mbps']:.0f} MB/s | "
            f"load = {_ratio(ray_row['load_vs_ray_get'])} of ray.get |"
        )
    return rows


def _assembly_rows(results: dict) -> list[str]:
    rows = []
    labels = list(results["config"]["assembly_sizes"])
    assembly = results["assembly"]
    smallest = assembly[labels[0]]
    for label in labels:
        entry = assembly[label]
        rows.append(
            f"| batch assembly | `finalize_rollout_groups`, {entry['groups']} groups x {label} | "
            f"{entry['finalize_s'] * 1000:.1f} ms, {entry['read_bytes'] / 1000:.1f} kB read | "
            f"{_ratio(entry['finalize_s'] / smallest['finalize_s'])} of {labels[0]} time |"
        )
    return rows


def _other_rows(results: dict) -> list[str]:
    rows = [f"| reference size | {name} (pickled) | {size} B | |" for name, size in results["ref_sizes"].items()]
    for kind, entry in results["zstd"].items():
        none, zstd = entry["none"], entry["zstd"]
        rows.append(
            f"| zstd {kind}-heavy | record bytes off / on | {none['record_bytes'] / 1000:.0f} kB / "
            f"{zstd['record_bytes'] / 1000:.0f} kB | {_ratio(entry['bytes_ratio'])} |"
        )
        rows.append(
            f"| zstd {kind}-heavy | publish off / on | {none['publish_s'] * 1000:.1f} ms / "
            f"{zstd['publish_s'] * 1000:.1f} ms | {_ratio(entry['publish_ratio'])} |"
        )
        rows.append(
            f"| zstd {kind}-heavy | load off / on | {none['load_s'] * 1000:.1f} ms / {zstd['load_s'] * 1000:.1f} ms | "
            f"{_ratio(entry['load_ratio'])} |"
        )
    memory = results["memory"]
    rows.append(
        f"| peak memory | publish {memory['payload_tensor_bytes'] / MB:.0f} MB of Samples (fresh process) | "
        f"{memory['peak_extra_bytes'] / MB:.0f} MB above RSS before | "
        f"{memory['peak_extra_x_payload']:.2f}x the payload |"
    )
    for name, profile in results["profile"].items():
        for part, seconds in profile["split_s"].items():
            rows.append(
                f"| profile publish {name} | {part} | {seconds * 1000:.0f} ms | "
                f"{seconds / profile['total_s']:.0%} of {profile['total_s'] * 1000:.0f} ms |"
            )
    return rows


def markdown_table(results: dict) -> str:
    """The short table for the docs: one row per measurement, ratios against the reference path."""
    rows = ["| section | measurement | median | ratio |", "|---|---|---|---|"]
    rows += _publish_rows(results) + _read_rows(results) + _assembly_rows(results) + _other_rows(results)
    return "\n".join(rows)
