"""The Triton kernel behind `nf4_rows` on CUDA (that module's doc states the rule).

Imported only where a kernel launches, so a CPU install never needs Triton. Tests run it
on the CPU through Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ROWS = 16  # the rows one program multiplies: tl.dot's smallest tile
# Triton's interpreter misreads bf16 operands of tl.dot; there only, the dot takes fp32 copies.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _rounded(value, dtype: tl.constexpr):
    """fp32 -> `dtype`, to nearest even as torch rounds. bf16 by integer arithmetic on the
    bits (then the cast is exact), which every Triton backend, the interpreter too, agrees on."""
    if dtype == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        value = bits.to(tl.float32, bitcast=True)
    return value.to(dtype)


@triton.jit
def _nf4_rows(
    x_ptr,
    packed_ptr,
    absmax_ptr,
    code_ptr,
    bias_ptr,
    out_ptr,
    rows,
    n_out,
    n_in,
    stride_x,
    stride_out,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    j = tl.arange(0, 32)  # the 32 bytes of one 64-weight block
    live_n = n < n_out
    live_r = r < rows
    blocks = n_in // 64
    acc = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)
    for b in range(blocks):
        packed = tl.load(
            packed_ptr + n[:, None] * (n_in // 2) + b * 32 + j[None, :], mask=live_n[:, None], other=0
        )
        scale = tl.load(absmax_ptr + n * blocks + b, mask=live_n, other=0.0)
        # bitsandbytes' value: code[index] * absmax in fp32, rounded to the activations' dtype.
        high = _rounded(
            tl.load(code_ptr + (packed >> 4).to(tl.int32)) * scale[:, None], x_ptr.dtype.element_ty
        )
        low = _rounded(
            tl.load(code_ptr + (packed & 15).to(tl.int32)) * scale[:, None], x_ptr.dtype.element_ty
        )
        columns = r[:, None] * stride_x + b * 64 + 2 * j[None, :]
        even = tl.load(x_ptr + columns, mask=live_r[:, None], other=0.0)
        odd = tl.load(x_ptr + columns + 1, mask=live_r[:, None], other=0.0)
        if DOT_FP32:  # the same bf16 values, multiplied as fp32 (exact products)
            even, odd, high, low = (
                even.to(tl.float32),
                odd.to(tl.float32),
                high.to(tl.float32),
                low.to(tl.float32),
            )
        acc += tl.dot(even, tl.trans(high))
        acc += tl.dot(odd, tl.trans(low))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=live_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + r[:, None] * stride_out + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live_r[:, None] & live_n[None, :])


def launch(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """x [rows <= ROWS, in] (bf16/fp16, unit stride), packed [out, in / 2] uint8, absmax [out * in / 64]
    fp32, code [16] fp32, out [rows, out] in x's dtype."""
    rows, n_in = x.shape
    n_out = packed.shape[0]
    block_n = 64 if n_out >= 4096 else 32
    _nf4_rows[(triton.cdiv(n_out, block_n),)](
        x,
        packed,
        absmax,
        code,
        bias if bias is not None else absmax,
        out,
        rows,
        n_out,
        n_in,
        x.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        DOT_FP32=_INTERPRETED and x.dtype == torch.bfloat16,
        BLOCK_R=ROWS,
        BLOCK_N=block_n,
    )
