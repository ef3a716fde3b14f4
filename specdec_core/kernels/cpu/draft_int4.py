"""Cheaper draft steps on CPU: 4-bit weights for the forwards of a few tokens.

A draft's numbers never reach the answer: the target verifies every token the draft
proposes, so the output is the target's whatever the draft computes, and the draft may
use coarser weights where that makes it faster. A draft step reads all the draft's
weights to produce one token; at 4 bits it reads about half of what int8 reads.

torch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`, group-wise scales and zero
points, bf16 arithmetic) is fast for one row and slows down quickly with more rows, so
only forwards of at most `MAX_ROWS` tokens take it (draft steps, the catch-up after a
verify); a prompt's prefill keeps the int8 path. The crossover against fbgemm's int8
lies between 4 and 8 rows (docs/performance.md#measurements-behind-the-design;
`specdec bench --cost-curve` reports the step).

Where bf16 arithmetic is slow (CPUs without AVX512-BF16/AMX), or the int8 kernel is
fast (quant_cpu's oneDNN path), the 4-bit path can lose, so `speed_up_draft` times a
whole 1-token forward both ways and keeps the 4-bit path only if it is faster (median
of 5 each, interleaved). `SPECDEC_DRAFT_INT4=0` turns it off (for A/B measurements).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from torch import nn

from .quant_cpu import FewRowPath, PerTokenInt8Linear

ENV_VAR = "SPECDEC_DRAFT_INT4"
MAX_ROWS = 4  # above this the int8 kernel is faster (docs/performance.md#measurements-behind-the-design)
MIN_GAIN = 0.95  # keep the 4-bit path only if a step takes at most 95% of the int8 one


def int4_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def group_size(in_features: int) -> int | None:
    """The kernel's group along the input: 64 where it divides (fewer scales to read), else 32."""
    for size in (64, 32):
        if in_features % size == 0:
            return size
    return None


class Int4Weights:
    """One linear's weights at 4 bits: asymmetric per group of `group` inputs, bf16 scales."""

    def __init__(self, weight: torch.Tensor, group: int) -> None:
        out_features, in_features = weight.shape
        grouped = weight.float().reshape(out_features, in_features // group, group)
        low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp_min(1e-8)
        values = (
            ((grouped - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
        )
        # The kernel computes (q - 8) * scale + zero, so zero carries the group's minimum.
        zero = low + 8 * scale
        self.group = group
        self.max_rows = MAX_ROWS
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
        # The kernel's layout: [in / group, out, (scale, zero)].
        pairs = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1)
        self.scales_and_zeros = pairs.transpose(0, 1).contiguous().to(torch.bfloat16)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * 2

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] (any float dtype) @ weight.T, in fp32."""
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, self.group, self.scales_and_zeros
        )
        return out.float()


def attach(model: nn.Module) -> int:
    """Give every int8 linear of `model` a 4-bit path for few rows; returns how many.

    Only for drafts: it changes the numbers the model computes.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, PerTokenInt8Linear) and module.few_rows is None:
            group = group_size(module.in_features)
            if group is not None:
                module.few_rows = Int4Weights(module.dense_weight(), group)
                count += 1
    return count


def detach(model: nn.Module) -> None:
    _swap_out(model)


def one_token_seconds(model: nn.Module, repeats: int) -> list[float]:
    """Times of a 1-token forward without a cache: what a draft step reads, all the weights."""
    ids = torch.zeros((1, 1), dtype=torch.long)
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            times.append(time.perf_counter() - start)
    return times


def speed_up_draft(model: nn.Module, repeats: int = 5) -> bool:
    """Attach the 4-bit path if it makes a draft step faster here; True if it was kept."""
    if os.environ.get(ENV_VAR, "1").strip() == "0" or not int4_available():
        return False
    detach(model)  # judged afresh from int8
    try:
        if attach(model) == 0:  # no int8 linears (a float draft), or none the kernel takes
            return False
    except RuntimeError:  # a kernel this torch build lacks on this CPU
        detach(model)
        return False
    with_int4: list[float] = []
    with_int8: list[float] = []
    for _ in range(repeats + 1):  # interleaved, so a burst of load hits both alike
        with_int4 += one_token_seconds(model, 1)
        saved = _swap_out(model)
        with_int8 += one_token_seconds(model, 1)
        _swap_in(model, saved)
    with_int4, with_int8 = with_int4[1:], with_int8[1:]  # the first calls allocate
    # Medians: one stalled forward on a shared machine must not decide it either way.
    if statistics.median(with_int4) <= MIN_GAIN * statistics.median(with_int8):
        return True
    detach(model)
    return False


def _swap_out(model: nn.Module) -> dict[PerTokenInt8Linear, FewRowPath | None]:
    saved = {}
    for module in model.modules():
        if isinstance(module, PerTokenInt8Linear):
            saved[module], module.few_rows = module.few_rows, None
    return saved


def _swap_in(model: nn.Module, saved: dict[PerTokenInt8Linear, FewRowPath | None]) -> None:
    for module, weights in saved.items():
        module.few_rows = weights
