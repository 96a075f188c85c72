"""Stand-in for vllm._custom_ops (see ../README.md)."""

from _slime_cpu_standin import Unavailable

rotary_embedding = Unavailable("vllm._custom_ops.rotary_embedding")
