"""Attention over a static KV cache, each query row over exactly its own prefix.

The fixed-shape step (kernels/cuda/static_step.py) hands every layer the whole cache, `capacity`
slots, and the positions of its rows (in place of a mask: `attention_mask` carries them,
shape [1, 1, R, 1], long). A row at position p attends to keys [lo, p], lo = p - w + 1 on a
sliding layer of window w (transformers' rule, key > query - w), else 0. Nothing past p
is read, so a row's numbers depend on p and the keys it sees only: not on the capacity,
the row count, the row's place among them or the stale slots past p. That is what makes
a plain step, a verify and a prompt chunk agree bitwise, and cache growth harmless.

- On CUDA, one Triton program per (row, head) walks the keys in blocks of `BLOCK` from a
  block-aligned start with an online softmax (no split over the keys, whose count would
  decide the order of summation), so the work is the live context, not the capacity, and
  the kernel launches from a captured graph (no host sync: p is read on the device).
  Under Triton's interpreter (TRITON_INTERPRET=1) the kernel runs on the CPU too: tests.
- Elsewhere (the CPU, eager), the same rule through `batch_invariant.rowwise_attention`:
  the keys are cut at the last row's position, where its "rows are the last of the keys"
  holds, so the row-wise code (C for fp32) computes it.

Softcapping (Gemma 2) is applied as tanh(s / c) * c on the scores, as eager attention does.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface

from ..batch_invariant import rowwise_attention

NAME = "specdec_static"
BLOCK = 32


def static_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [1, H, R, D]; key/value [1, H_kv, capacity, D]; attention_mask: the rows' positions
    [1, 1, R, 1] -> ([1, R, H, D], None)."""
    if attention_mask is None or attention_mask.dtype != torch.long:
        # Not under a StaticRunner (a CachedModel, transformers' generate): the rows are the
        # last of the keys, which row-wise attention computes as the loader made it.
        return rowwise_attention(
            module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, **kwargs
        )
    positions = attention_mask.reshape(-1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter: tests on the CPU
        return rows_attention_triton(query, key, value, positions, scale, sliding_window, softcap), None
    end = int(positions[-1]) + 1  # the rows are the last `R` keys of the cache cut here
    return rowwise_attention(
        module,
        query,
        key[:, :, :end],
        value[:, :, :end],
        None,
        scaling=scale,
        sliding_window=sliding_window,
        softcap=softcap,
    )


AttentionInterface.register(NAME, static_attention)


def rows_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """The Triton kernel's launch: -> [1, R, H, D] in the query's dtype."""
    from . import attention_triton  # imports triton: only where a kernel is launched

    _, heads, rows, dim = query.shape
    out = torch.empty((1, rows, heads, dim), dtype=query.dtype, device=query.device)
    attention_triton.launch(
        query, key, value, positions, out, scale, sliding_window or 0, softcap or 0.0, BLOCK
    )
    return out
