"""CPU stand-in for vllm (see ../README.md): only `vllm._custom_ops.rotary_embedding`, which SGLang's rotary
embedding imports on non-CUDA devices and never calls on CPU. Every other `vllm` import fails as if vllm were
absent (SGLang probes `vllm.logger` and must find nothing)."""
