"""Row-wise causal attention on the CPU in one C call per layer (`attention_cpu.c`).

Row-wise attention (batch_invariant.py) gives each query row exactly the computation a
one-token step gives it. Done with one SDPA call per row, a 9-token verify makes 9
calls per layer and a 200-token prefill 200, and each call's fixed cost adds up. The C
kernel computes every (row, head) pair in one call, each pair whole on one thread in a
fixed order, so a row's numbers still do not depend on the rows beside it or on the
thread count. The figures:
docs/engine.md#fewer-bigger-calls-on-the-cpu-nativepy-attention_cpuc-layers_cpuc-kv_inplacepy

It serves fp32 on the CPU (the int8 and int4 precisions) with a head size that is a
multiple of 16; elsewhere (bf16, CUDA, logit softcapping) `attend` returns None and
attention stays one SDPA call per row. Which path a model takes depends only on its
dtype, device and shapes, so it is the same for every forward of a model.
"""

from __future__ import annotations

import torch

from . import native

_MAX_HEAD_DIM = 512  # attention_cpu.c's MAX_CHUNKS x 16


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, window: int | None
) -> torch.Tensor | None:
    """query [1, H, q, D], key/value [1, H_kv, kv, D] -> [1, q, H, D]; None where the kernel
    does not apply."""
    if not _applies(query, key, value):
        return None
    _, heads, rows, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    out = torch.empty(1, rows, heads, dim)
    status = native.library().causal_attention(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), rows, keys, keys * dim, heads,
        kv_heads, dim, scaling if scaling is not None else dim**-0.5, window or 0, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"out of memory in attention over {keys} keys")
    return out


def _applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    tensors = (query, key, value)
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 4 for t in tensors)
        and query.shape[0] == key.shape[0] == 1
        and key.shape == value.shape
        and query.shape[3] == key.shape[3]
        and query.shape[3] % 16 == 0
        and query.shape[3] <= _MAX_HEAD_DIM
        and query.shape[1] % key.shape[1] == 0
        and query.shape[2] <= key.shape[2]
        and native.unavailable() is None
    )
