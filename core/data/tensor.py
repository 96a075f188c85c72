"""Lazy tensor references into straw packs, and their materialization for self-contained dumps.

`TensorRef` is the very class `straw.tensor.TensorRef` (tests and users check `isinstance` against both
import paths). Without straw installed, code paths that never touch durable tensors still import; building
a `TensorRef` then fails with the install hint.
"""

from __future__ import annotations

from typing import Any

try:
    from straw.tensor import TensorRef
except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without straw-queue installed
    if exc.name != "straw":
        raise

    class TensorRef:  # type: ignore[no-redef]
        """Placeholder: durable tensor references need straw-queue."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ModuleNotFoundError("Install straw with: pip install straw-queue", name="straw")


__all__ = ["TensorRef", "materialize_tensor_refs"]


def materialize_tensor_refs(value: Any) -> Any:
    """Replace every `TensorRef` in nested dicts/lists/tuples by its loaded tensor, keeping container types."""
    if isinstance(value, TensorRef):
        return value.load()
    if isinstance(value, dict):
        return type(value)((key, materialize_tensor_refs(item)) for key, item in value.items())
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(materialize_tensor_refs(item) for item in value)
    if isinstance(value, list):
        return [materialize_tensor_refs(item) for item in value]
    return value
