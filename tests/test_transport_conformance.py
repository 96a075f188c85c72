"""The built-in transports through `slime.testing`'s conformance suite, and the refusal of incomplete transports.

`nox -s "transport(NAME)"` runs one transport's suite (`--slime-transport NAME`).
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from slime.interfaces import TransportInterfaceError, run_transport
from slime.plugin_manager import PluginSelection
from slime.testing import TransportConformance


class TestStraw(TransportConformance):
    transport_name = "straw"


class TestObjectStore(TransportConformance):
    transport_name = "object-store"


class TestNixl(TransportConformance):
    """NIXL moves shard tensors over GPU/RDMA; without it the checks that move shards are skipped."""

    transport_name = "nixl"

    def hardware_missing(self) -> str | None:
        if importlib.util.find_spec("nixl") is None:
            return "NIXL is not installed (pip install nixl; needs GPUs/RDMA)"
        if not torch.cuda.is_available():
            return "NIXL tensor transport needs a CUDA device"
        return None


INCOMPLETE_PLUGIN = """
from slime import hookimpl
from slime.interfaces import Transport
from slime.specs import TransportSpec


def methods_but(missing):
    return {name: lambda self, *args, **kwargs: None for name in Transport.__abstractmethods__ if name != missing}


WithoutSeal = type("WithoutSeal", (Transport,), methods_but("seal"))
WithoutShardBatch = type("WithoutShardBatch", (), methods_but("shard_batch"))


@hookimpl
def slime_transports():
    return [
        TransportSpec("without-seal", WithoutSeal),
        TransportSpec("without-shard-batch", lambda args: WithoutShardBatch()),
    ]
"""


@pytest.mark.parametrize(
    ("transport", "built", "missing"),
    [("without-seal", "WithoutSeal", "seal"), ("without-shard-batch", "WithoutShardBatch", "shard_batch")],
)
def test_transport_missing_an_interface_method_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transport: str, built: str, missing: str
) -> None:
    plugin = f"incomplete_transport_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{plugin}.py").write_text(textwrap.dedent(INCOMPLETE_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, plugin, raising=False)
    args = SimpleNamespace(
        rollout_data_transport=transport, plugin_selection=PluginSelection(plugins=(plugin,), autoload=False)
    )
    with pytest.raises(TransportInterfaceError) as refused:
        run_transport(args)
    message = str(refused.value)
    assert f"Transport {transport!r} (plugin {plugin!r})" in message and built in message
    assert f"does not implement {missing} of slime.interfaces.Transport" in message
