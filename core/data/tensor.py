"""Lazy tensor references into straw packs, and their materialization for self-contained dumps.

`TensorRef` is the very class `straw.tensor.TensorRef` (tests and users check `isinstance` against both
import paths); it is imported on first access, so runs that never touch durable tensors (an object-store
run) never import straw-queue. `is_tensor_ref` answers without importing it: no value can be a
`TensorRef` in a process that never imported straw.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["TensorRef", "is_tensor_ref", "materialize_tensor_refs"]  # noqa: F822 - TensorRef comes from __getattr__


def __getattr__(name: str) -> Any:
    if name == "TensorRef":
        try:
            from straw.tensor import TensorRef
        except ModuleNotFoundError as exc:
            if exc.name != "straw":
                raise
            raise ModuleNotFoundError(
                "Durable tensor references need straw: pip install straw-queue", name="straw"
            ) from exc
        return TensorRef
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_tensor_ref(value: Any) -> bool:
    """Whether `value` is a straw `TensorRef` (False, without importing straw, where straw was never imported)."""
    module = sys.modules.get("straw.tensor")
    return module is not None and isinstance(value, module.TensorRef)


def materialize_tensor_refs(value: Any) -> Any:
    """Replace every `TensorRef` in nested dicts/lists/tuples by its loaded tensor, keeping container types."""
    if is_tensor_ref(value):
        return value.load()
    if isinstance(value, dict):
        return type(value)((key, materialize_tensor_refs(item)) for key, item in value.items())
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(materialize_tensor_refs(item) for item in value)
    if isinstance(value, list):
        return [materialize_tensor_refs(item) for item in value]
    return value
