"""Every built-in transport through the shared conformance suite (`tests/transport_conformance.py`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transport_conformance import TransportConformance


class TestStraw(TransportConformance):
    transport_name = "straw"


@pytest.mark.slow
class TestObjectStore(TransportConformance):
    transport_name = "object-store"


class TestNixl(TransportConformance):
    """NIXL moves tensors over GPU/RDMA; without it only the checks that move no data run."""

    transport_name = "nixl"

    def hardware_missing(self) -> str | None:
        if importlib.util.find_spec("nixl") is None:
            return "NIXL is not installed (pip install nixl; needs GPUs/RDMA)"
        if not torch.cuda.is_available():
            return "NIXL tensor transport needs a CUDA device"
        return None
