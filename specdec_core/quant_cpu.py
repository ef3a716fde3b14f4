"""A fast int8 path for CPU that keeps speculative decoding exact.

torch's dynamic int8 linear (fbgemm) is ~4x faster than fp32 here, but it picks
one activation scale for the whole input tensor: a row's output then depends on
the other rows in the batch, so a k-token verify and a 1-token decoding step
compute different numbers and greedy outputs can diverge.

Fix (measured: bitwise-equal rows, batched or alone): scale each token's
activations to [-1, 1] and append two constant columns +1 and -1 (with zero
weights). Every row, and so the whole tensor, then has min -1 and max +1, so
fbgemm's per-tensor scale is the same for any batch: effectively per-token
scaling, and integer accumulation makes each row independent of the others.
Weights are int8 per output channel.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch
from torch import nn


class FewRowPath(Protocol):
    """Another kernel for forwards of at most `max_rows` tokens (a draft's, see draft_int4)."""

    max_rows: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


class PerTokenInt8Linear(nn.Module):
    _bounds: torch.Tensor
    bias: nn.Parameter | None
    few_rows: FewRowPath | None = None  # never set on a target: it changes the numbers

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        out_features, in_features = weight.shape
        self.in_features, self.out_features = in_features, out_features
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        padded = torch.cat([weight, weight.new_zeros(out_features, 2)], dim=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized-tensor deprecation notices
            qweight = torch.quantize_per_channel(
                padded, scales.double(), torch.zeros(out_features, dtype=torch.long), 0, torch.qint8
            )
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = (
            None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        )
        self.register_buffer("_bounds", torch.tensor([1.0, -1.0]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        if self.few_rows is not None and x2.shape[0] <= self.few_rows.max_rows:
            return self._finish(self.few_rows.matmul(x2), shape, x.dtype)
        # x2: [T, in]; per-token scale s: [T, 1]
        s = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        normed = torch.cat([x2 / s, self._bounds.expand(x2.shape[0], 2)], dim=1)
        y = torch.ops.quantized.linear_dynamic(normed, self._packed, True) * s
        return self._finish(y, shape, x.dtype)

    def quantized_weight(self) -> torch.Tensor:
        """The per-channel int8 weight [out, in + 2] (the last two columns are the zero-weight bounds)."""
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qweight

    def dense_weight(self) -> torch.Tensor:
        """The weights as floats [out, in], the two constant columns dropped."""
        return self.quantized_weight().dequantize()[:, : self.in_features]

    def _finish(self, y: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(dtype)


def quantize_linears_int8(model: nn.Module) -> int:
    """Replace every nn.Linear (lm_head included: it is the biggest single matmul) in place."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PerTokenInt8Linear(linear))
    return len(targets)
