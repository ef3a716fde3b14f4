"""The Triton kernel behind `attention_static` on CUDA (that module's doc states the rule).

Imported only where a kernel launches, so a CPU install never needs Triton. Tests run it
on the CPU through Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rows_attention(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    out_ptr,
    scale,
    window,
    softcap,
    stride_qh,
    stride_qr,
    stride_kh,
    stride_kn,
    stride_vh,
    stride_vn,
    stride_or,
    stride_oh,
    GROUPS: tl.constexpr,
    DIM: tl.constexpr,
    DIM_POW2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUPS
    p = tl.load(pos_ptr + row)
    lo = tl.where(window > 0, tl.maximum(p - window + 1, 0), 0)
    first = (lo // BLOCK) * BLOCK  # blocks on a fixed grid: the same for every row at p
    d = tl.arange(0, DIM_POW2)
    in_dim = d < DIM
    q = tl.load(q_ptr + head * stride_qh + row * stride_qr + d, mask=in_dim, other=0.0).to(tl.float32)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((DIM_POW2,), tl.float32)
    for start in range(first, p + 1, BLOCK):
        n = start + tl.arange(0, BLOCK)
        seen = (n >= lo) & (n <= p)
        both = seen[:, None] & in_dim[None, :]
        k = tl.load(k_ptr + kv_head * stride_kh + n[:, None] * stride_kn + d[None, :], mask=both, other=0.0)
        scores = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale
        if softcap > 0:
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))  # tanh
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        weights = tl.exp(scores - m_new)
        v = tl.load(v_ptr + kv_head * stride_vh + n[:, None] * stride_vn + d[None, :], mask=both, other=0.0)
        total = total * alpha + tl.sum(weights, axis=0)
        acc = acc * alpha + tl.sum(weights[:, None] * v.to(tl.float32), axis=0)
        m = m_new
    out = acc / total
    tl.store(out_ptr + row * stride_or + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=in_dim)


def launch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
    block: int,
) -> None:
    """query [1, H, R, D], key/value [1, H_kv, capacity, D] (unit stride in D), out [1, R, H, D]."""
    _, heads, rows, dim = query.shape
    grid = (rows, heads)
    _rows_attention[grid](
        query,
        key,
        value,
        positions,
        out,
        scale,
        window,
        softcap,
        query.stride(1),
        query.stride(2),
        key.stride(1),
        key.stride(2),
        value.stride(1),
        value.stride(2),
        out.stride(1),
        out.stride(2),
        GROUPS=heads // key.shape[1],
        DIM=dim,
        DIM_POW2=triton.next_power_of_2(dim),
        BLOCK=block,
    )
