"""Multi-client visibility on a real JuiceFS volume: publish through one mount, read through another.

The volume uses sqlite metadata and a local directory as object storage; two FUSE mounts of it are two
independent JuiceFS clients, which is what rollout and training nodes are on a cluster.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from slime.data.transport import pack_rollout_payload, rollout_store
from slime.testing import juicefs
from slime.utils.types import Sample

pytestmark = [pytest.mark.juicefs, pytest.mark.slow]

READER = """
import pickle, sys
import torch
from slime.data.tensor import TensorRef
reference = pickle.load(open(sys.argv[1], "rb"))
value = reference.load(root=sys.argv[2])
sample = value["sample"]
assert isinstance(sample.rollout_routed_experts, TensorRef), type(sample.rollout_routed_experts)
assert sample.rollout_routed_experts.root == sys.argv[2], sample.rollout_routed_experts.root
assert sample.rollout_routed_experts[2:4].tolist() == [[[2]], [[3]]]
assert torch.equal(value["tensor"], torch.arange(int(sys.argv[3]), dtype=torch.int64))
assert value["text"] == "j" * 100_000
"""


@pytest.fixture
def volume(tmp_path):
    """Two mounts (`/a`, `/b`) of one freshly formatted volume; unmounted afterwards."""
    reason = juicefs.unavailable()
    if reason is not None:
        pytest.skip(reason)
    with juicefs.juicefs_volume(tmp_path, [tmp_path / "a", tmp_path / "b"]) as mounts:
        yield SimpleNamespace(mounts=mounts, version=juicefs.juicefs_version())


def test_publication_on_one_client_is_readable_from_another(volume, tmp_path):
    writer_mount, reader_mount = volume.mounts
    declaration = tmp_path / "declaration.json"
    declaration.write_text(
        json.dumps(
            {
                "direct_mount": True,
                "writeback": False,
                "open_cache": 0,
                "readdir_cache": False,
                "client_version": volume.version,
                "durability_description": "test volume: sqlite metadata, local directory object storage",
            }
        )
    )
    args = SimpleNamespace(
        rollout_data_transport="straw",
        rollout_data_dir=str(writer_mount / "pool"),
        rollout_storage_profile="juicefs",
        rollout_storage_declaration=str(declaration),
    )
    store, _, _ = rollout_store(args)
    assert store.backend.profile == "juicefs"
    # Two publications into the same open pack: the reader must not wait for the pack to fill or seal.
    for length in (16, 32):
        sample = Sample(index=length, rollout_routed_experts=torch.arange(8, dtype=torch.int32).reshape(8, 1, 1))
        reference = pack_rollout_payload(
            {"sample": sample, "tensor": torch.arange(length), "text": "j" * 100_000}, args, 0
        )
        handle = tmp_path / f"reference-{length}.pkl"
        handle.write_bytes(pickle.dumps(reference))
        subprocess.run(
            [sys.executable, "-c", READER, str(handle), str(reader_mount / "pool"), str(length)],
            check=True,
            timeout=120,
            env=dict(os.environ),
        )
    assert len(list((reader_mount / "pool").rglob("*.pack"))) == 1
    store.seal()
