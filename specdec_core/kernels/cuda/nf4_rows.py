"""bitsandbytes nf4 weights multiplied as stored, a few rows at a time (CUDA, Triton).

bitsandbytes' own nf4 forward either runs a 1-row kernel or dequantizes the whole weight
and multiplies, and `batch_invariant._DequantizedBnb` always dequantizes (one path for any
row count). Both read or write every weight several times per forward. `Nf4RowsLinear`
reads the stored 4-bit indices once: each program takes a slice of output features,
walks the input in bitsandbytes' 64-weight blocks, turns each index into bitsandbytes'
value (the nf4 code times the block's absmax in fp32, rounded to the activations' dtype,
as `dequantize_4bit` does) and multiplies up to 16 rows with tensor-core dots.

- The weights are the file's: the same values `dequantize_4bit` gives, bit for bit.
  Double-quantized absmax is expanded once to fp32 at swap time by bitsandbytes itself
  (1/16 byte per weight more than the stored form, for the same bits).
- Any row count below 16 runs the same program with masked rows, and each row's sums are
  its own: a plain step, a verify and the draft's one-row step agree bitwise.
- Only what it covers is swapped (`row_kernel_refusal`): nf4, blocks of 64, inputs in
  whole blocks, bf16 or fp16 activations. The rest keep the dequantizing path.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..batch_invariant import is_bnb_linear, mixed_class

BLOCK = 64  # bitsandbytes' blocksize this kernel reads
_CLASSES: dict[type, type] = {}


def row_kernel_refusal(module: nn.Module) -> str | None:
    """Why `module`'s weight cannot go through the row kernel, or None when it can."""
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    if state is None or not is_bnb_linear(module):  # the loader's batch-invariant form included
        return "not a bitsandbytes 4-bit linear"
    if isinstance(module, Nf4RowsLinear):
        return "already read by the row kernel"  # a second runner on the same model (self-drafting)
    if state.quant_type != "nf4" or state.blocksize != BLOCK:
        return f"{state.quant_type} in blocks of {state.blocksize}"
    if state.shape[1] % BLOCK:
        return f"{state.shape[1]} inputs, not whole blocks"
    if state.dtype not in (torch.bfloat16, torch.float16):
        return f"{state.dtype} activations"
    return None


class Nf4RowsLinear(nn.Linear):
    """Mixin target of a class swap: a bitsandbytes Linear4bit whose forward is the row kernel."""

    nf4_packed: torch.Tensor
    nf4_absmax: torch.Tensor
    nf4_code: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(self.nf4_dtype).contiguous()
        out = torch.empty((rows.shape[0], self.nf4_packed.shape[0]), dtype=rows.dtype, device=rows.device)
        from . import nf4_triton  # imports Triton: only where a kernel launches

        bias = None if self.bias is None else self.bias.to(rows.dtype)
        for first in range(0, rows.shape[0], nf4_triton.ROWS):
            part = rows[first : first + nf4_triton.ROWS]
            nf4_triton.launch(part, self.nf4_packed, self.nf4_absmax, self.nf4_code, bias, out[first:])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @property
    def nf4_dtype(self) -> torch.dtype:
        return self.weight.quant_state.dtype  # type: ignore[attr-defined]


def use_row_kernels(model: nn.Module) -> int:
    """Swap every covered nf4 linear of a model on CUDA (or under Triton's interpreter) to the
    row kernel, in place; returns how many. Weights stay bitsandbytes' tensors."""
    if not _kernels_run_on(next(model.parameters()).device):
        return 0
    swapped = 0
    for module in model.modules():
        if row_kernel_refusal(module) is None:
            _swap(module)
            swapped += 1
    return swapped


def _swap(module: nn.Module) -> None:
    weight: Any = module.weight
    state = weight.quant_state
    absmax = state.absmax
    if state.nested:  # expanded as dequantize_4bit expands it
        import bitsandbytes.functional as bnbf

        absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
    n_out, n_in = state.shape
    module.nf4_packed = weight.data.view(n_out, n_in // 2)
    module.nf4_absmax = absmax.float().contiguous()
    module.nf4_code = state.code.float().to(weight.device).contiguous()
    module.__class__ = mixed_class(type(module), Nf4RowsLinear, _CLASSES)


def _kernels_run_on(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
