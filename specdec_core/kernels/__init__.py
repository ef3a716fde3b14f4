"""Compute, a folder per device, as llama.cpp's ggml-cpu/ and ggml-cuda/.

`runner.Runner` is the one interface the engine sees: a model plus the KV cache of one
token sequence. `dispatch.runner_for` picks a device's runner. `cpu/` holds the C kernels
beside their Python wrappers and the CPU's runner (`cpu.runner.CachedModel`); `cuda/` the
Triton kernels and the fixed-shape step (`cuda.static_step.StaticRunner`).
`batch_invariant` is shared: forwards whose rows do not depend on the batch, on either device.
"""
