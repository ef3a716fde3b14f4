"""A fast int8 path for CPU that keeps speculative decoding exact.

Speculative greedy decoding is exact only if a k-token verify computes, for every
row, the same numbers as a 1-token step (selfcheck.py). So each linear quantizes
every token's activations with that token's own scale (its max |x| mapped to 127)
and multiplies int8 by int8 with integer accumulation: a row's integer dot products
do not depend on the other rows, nor on how the kernel blocks or threads the work.
Weights are int8 per output channel.

Two kernels compute that product (`SPECDEC_INT8_KERNEL` picks one by name):

- `onednn` (default where it sums exactly, i.e. with VNNI or AMX): uint8 activations
  (q + 128) x int8 weights -> the exact integer sums as floats, scaled by us
  afterwards, so no kernel rounding can differ between row counts. Its cost grows
  more slowly with rows than fbgemm's, so verifies and prefill are cheaper
  (docs/performance.md#measurements-behind-the-design), and its activations keep
  8 bits.
- `fbgemm`: torch's dynamic int8 linear. It picks one activation scale per tensor,
  so each token is first scaled to [-1, 1] and two constant columns +1 and -1 (with
  zero weights) make every row's, and so the tensor's, range the same for any batch.
  Its activations are 7-bit (fbgemm's reduce_range), and its cost grows with rows.
"""

from __future__ import annotations

import copy
import functools
import os
import warnings
from typing import Protocol

import torch
from torch import nn

from . import features

KERNEL_ENV = "SPECDEC_INT8_KERNEL"  # "onednn" | "fbgemm"
ONEDNN_ISA_ENV = "ONEDNN_MAX_CPU_ISA"  # oneDNN's own cap on the instructions it uses
_ZERO_POINT = 128  # activations travel as q + 128 in uint8 (q in [-127, 127])
_RECOVER_ROWS = 512  # identity rows per forward when reading weights back from onednn


class FewRowPath(Protocol):
    """Another kernel for forwards of at most `max_rows` tokens (a draft's, see draft_int4)."""

    max_rows: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...


class Int8Kernel(Protocol):
    """x [T, in] (fp32) @ (scales * values).T with per-token int8 activations, [T, out] fp32."""

    name: str

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]: ...


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines or kernel_name() == "onednn"


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


@functools.cache
def kernel_name() -> str:
    """The kernel new int8 linears use in this process: oneDNN where it sums exactly."""
    if os.environ.get(KERNEL_ENV, "").strip().lower() == "fbgemm":
        return "fbgemm"
    if onednn_available() and features.int8_sums_can_be_exact():
        # oneDNN reads its ISA cap once, at first use. It is capped below AMX: AMX makes
        # verifies and prefill cheaper but its plain steps jitter and decoding is slower
        # end to end, while the AVX-512 VNNI kernels keep steady steps
        # (docs/performance.md#what-does-not-help-measured-not-kept). Set the variable
        # yourself to allow AMX.
        os.environ.setdefault(ONEDNN_ISA_ENV, "AVX512_CORE_FP16")
        if onednn_sums_exactly():
            return "onednn"
    return "fbgemm"


def onednn_sums_exactly(row_counts: tuple[int, ...] = (1, 16)) -> bool:
    """Without VNNI, oneDNN multiplies u8 x s8 pairs into int16 and saturates: not exact.

    Checked on the extreme values (255 x 127 in every pair) at each of `row_counts` rows,
    where the CPU (as SPECDEC_ISA narrows it, features.py) has VNNI or AMX at all.
    """
    if not features.int8_sums_can_be_exact():
        return False
    weight = torch.full((64, 256), 127, dtype=torch.int8)
    weight[1::2] = -127
    for rows in row_counts:
        q = torch.full((rows, 256), 127, dtype=torch.int8)
        q[1::2] = -127
        sums = OnednnInt8(weight, torch.ones(64)).sums((q.short() + _ZERO_POINT).to(torch.uint8))
        if not torch.equal(sums, (q.long() @ weight.long().t()).float()):
            return False
    return True


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (values [out, in] int8, scales [out] fp32)."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    values = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return values, scales


class OnednnInt8:
    """int8 activations (per token, symmetric) x int8 weights on oneDNN, exact integer sums."""

    name = "onednn"

    def __init__(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        out_features, self.in_features = values.shape
        self.packed = torch.ops.onednn.qlinear_prepack(values.contiguous(), None)
        self.scales = scales.float().contiguous()
        # Unit scales make the kernel return the integer sums as floats: no rounding of
        # its own that could differ between row counts (we scale afterwards, per element).
        self._unit = torch.ones(out_features)
        self._zero = torch.zeros(out_features, dtype=torch.long)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        s = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
        # Unsigned activations with zero point 128: oneDNN's int8 kernels without AMX take
        # only u8 x s8 at speed (s8 x s8 falls back to a reference loop hundreds of times slower).
        q = torch.round(x / s).add_(_ZERO_POINT).to(torch.uint8)
        return self.sums(q).mul_(s).mul_(self.scales)

    def __deepcopy__(self, memo: dict[int, object]) -> OnednnInt8:
        # oneDNN's packed tensor has no storage to copy; it is never written, so share it.
        copied = copy.copy(self)
        copied.scales = self.scales.clone()
        return copied

    def sums(self, q: torch.Tensor) -> torch.Tensor:
        return torch.ops.onednn.qlinear_pointwise(
            q, 1.0, _ZERO_POINT, self.packed, self._unit, self._zero, None, 1.0, 0, torch.float32, "none", [], ""
        )

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        # The packed layout is oneDNN's own; an identity input reads the values back exactly.
        in_features = self.in_features
        chunks = []
        for start in range(0, in_features, _RECOVER_ROWS):
            rows = min(_RECOVER_ROWS, in_features - start)
            eye = torch.full((rows, in_features), _ZERO_POINT, dtype=torch.uint8)
            eye[:, start : start + rows].fill_diagonal_(_ZERO_POINT + 1)
            chunks.append(self.sums(eye))
        return torch.cat(chunks).t().to(torch.int8).contiguous(), self.scales.clone()


class FbgemmInt8:
    """torch's dynamic int8 linear, made per-token by two constant columns (module docstring)."""

    name = "fbgemm"

    def __init__(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        out_features, in_features = values.shape
        padded = torch.cat([values, values.new_zeros(out_features, 2)], dim=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized-tensor deprecation notices
            qweight = torch._make_per_channel_quantized_tensor(
                padded, scales.double(), torch.zeros(out_features, dtype=torch.long), 0
            )
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self._bounds = torch.tensor([1.0, -1.0])
        self.in_features = in_features

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        s = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        normed = torch.cat([x / s, self._bounds.expand(x.shape[0], 2)], dim=1)
        return torch.ops.quantized.linear_dynamic(normed, self.packed, True) * s

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        qweight, _ = torch.ops.quantized.linear_unpack(self.packed)
        values = qweight.int_repr()[:, : self.in_features].contiguous()
        return values, qweight.q_per_channel_scales().float()


def make_kernel(values: torch.Tensor, scales: torch.Tensor, name: str | None = None) -> Int8Kernel:
    name = name or kernel_name()
    if name == "onednn":
        return OnednnInt8(values, scales)
    return FbgemmInt8(values, scales)


class PerTokenInt8Linear(nn.Module):
    bias: nn.Parameter | None
    few_rows: FewRowPath | None = None  # never set on a target: it changes the numbers

    def __init__(self, linear: nn.Linear, kernel: str | None = None) -> None:
        values, scales = quantize_weight(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self._setup(values, scales, bias, kernel)

    @classmethod
    def from_int8(
        cls, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, kernel: str | None = None
    ) -> PerTokenInt8Linear:
        """A linear from int8 values [out, in] and per-channel scales [out] (no re-quantizing)."""
        linear = cls.__new__(cls)
        linear._setup(values, scales, bias, kernel)
        return linear

    def _setup(
        self, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, kernel: str | None
    ) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = values.shape
        self.kernel = make_kernel(values, scales, kernel)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        if self.few_rows is not None and x2.shape[0] <= self.few_rows.max_rows:
            y = self.few_rows.matmul(x2)
        else:
            y = self.kernel.matmul(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [out, in] int8, per-channel scales [out] fp32), exactly as the kernel holds them."""
        return self.kernel.int8_weight()

    def dense_weight(self) -> torch.Tensor:
        """The weights as floats [out, in]."""
        values, scales = self.int8_weight()
        return values.float() * scales[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel.name}"


def quantize_linears_int8(model: nn.Module) -> int:
    """Replace every nn.Linear (lm_head included: it is the biggest single matmul) in place."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PerTokenInt8Linear(linear))
    return len(targets)
