"""The weight senders on CUDA tensors (marker `gpu`; `.ci/device-check` runs them on a GPU machine).

On CPU the senders are tested end to end against the CPU engine (tests/test_weight_sync.py) and real SGLang
servers (tests/sglang_engine/); what only a GPU can show is checked here: the flattened bucket of CUDA tensors
is byte for byte the layout SGLang rebuilds, a bucket of CUDA tensors pickled for `/update_weights_from_tensor`
is rebuilt in another process from CUDA IPC handles, and the SGLang command line of a GPU machine.
"""

from __future__ import annotations

import base64
import multiprocessing
import pickle

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _bucket(device: str) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tensors = [
        ("model.embed_tokens.weight", torch.randn(64, 32, generator=generator).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(32, generator=generator)),
        ("lm_head.weight", torch.randn(64, 32, generator=generator).to(torch.float16)),
    ]
    return [(name, tensor.to(device)) for name, tensor in tensors]


@needs_cuda
def test_a_flattened_cuda_bucket_has_the_byte_layout_engines_rebuild():
    from slime.weight_sync import bucket_metadata, flatten_bucket, iter_buckets

    cpu, cuda = _bucket("cpu"), _bucket("cuda")
    flat = flatten_bucket(cuda)
    assert flat.device.type == "cuda" and flat.dtype == torch.uint8
    assert torch.equal(flat.cpu(), flatten_bucket(cpu))
    assert bucket_metadata(cuda) == bucket_metadata(cpu)
    # What SGLang does on receipt: slice each tensor's bytes back out and view them as its dtype.
    offset = 0
    for _, tensor in cuda:
        size = tensor.numel() * tensor.element_size()
        assert offset % tensor.element_size() == 0
        rebuilt = flat[offset : offset + size].view(tensor.dtype).view(tensor.shape)
        assert torch.equal(rebuilt, tensor)
        offset += size
    assert [len(b) for b in iter_buckets(iter(cuda), 64 * 32 * 2 + 32 * 4)] == [2, 1]


def _rebuild(payload: str, queue) -> None:
    bucket = pickle.loads(base64.b64decode(payload))
    queue.put([(name, tensor.device.type, tensor.cpu()) for name, tensor in bucket])


@needs_cuda
def test_a_cuda_bucket_for_update_weights_from_tensor_is_rebuilt_in_another_process():
    from slime.weight_sync import _serialize

    bucket = _bucket("cuda")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_rebuild, args=(_serialize(bucket), queue))
    child.start()
    received = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    for (name, tensor), (got_name, device, value) in zip(bucket, received, strict=True):
        assert (got_name, device) == (name, "cuda") and torch.equal(value, tensor.cpu())


def test_on_a_gpu_machine_sglang_keeps_its_own_device_settings():
    from types import SimpleNamespace

    from slime.plugins.sglang_engine.launcher import server_command
    from slime.plugins.sglang_engine.settings import SGLangEngineSettings

    settings = SGLangEngineSettings.from_args(SimpleNamespace(rollout_num_gpus_per_engine=1))
    command = server_command(settings, "/models/m", 30000, seed=1, on_cpu=not torch.cuda.is_available())
    if torch.cuda.is_available():
        assert "--device" not in command and "--cuda-graph-backend-decode" not in command
    assert command[command.index("--tp-size") + 1] == "1"
