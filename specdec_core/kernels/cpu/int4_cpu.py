"""4-bit target weights on CPU that keep speculative decoding exact (`--precision int4`).

A decoding step reads every weight once, so on a CPU its time is the weights' bytes
over the memory bandwidth: at int8 the 1.5B target reads ~1.55 GB a step, at 4 bits
~1 GB. torch's own 4-bit CPU kernel is batch-invariant but its cost climbs with every
row (a 9-token verify would cost several plain steps), so the target needs a kernel
whose rows share one read of the weights and whose results do not depend on the rows.

`int4_cpu.c` is that kernel (AVX-512 VNNI, AVX2 or plain C, the same numbers): weights asymmetric per group of 32 inputs
with fp16 scale and minimum (5 bits a weight with the scales), activations int8 per
group of 32 inputs of each row (like llama.cpp's q8_0). Each group's dot product is an
exact integer sum, then the same few float operations in the same order for every row,
so a row's result is bitwise the same in a 1-row step, a 9-row verify or a prefill,
at any thread count (tests/test_int4_cpu.py; the load-time self-check measures it on
the loaded model).

The kernel is compiled here once per machine and loaded with ctypes (native.py). No
compiler, or a failed compile: `native.unavailable()` says why, and `int4` is refused
in one line at load.

The target's LM head takes 6 bits in the same kernel and layout (two more vectors carry
each weight's top 2 bits): it decides the argmax directly, and GGUF files keep it at 6
bits or more. It reads fewer bytes a step than an int8 head and predicts no worse
(docs/engine.md#the-cpu-4-bit-path-int4_cpupy-int4_cpuc has the bytes and the quality).
A draft's head takes 4 bits (`head_to_int4`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from . import native
from .native import library
from .quant_cpu import PerTokenInt8Linear

GROUP = 32  # inputs per weight scale and per activation scale
LANES = 16  # output channels per block of the packed layout
SCALE_BYTES = 2 * LANES * 2  # 16 fp16 scales, then 16 fp16 minimums
HEAD_BITS = 6  # the target's LM head (GGUF files keep it at 6 bits or more)
# The layouts of GGUF Q4_K and Q6_K tensors repacked for the same kernel (gguf_cpu.c's
# gguf_repack): the file's values, with fp32 scales formed from each 256 inputs' d.
K_SCALES = 0x10
K4, K6 = 4 | K_SCALES, 6 | K_SCALES


def block_bytes(bits: int) -> int:
    """Bytes per 16 channels x 32 inputs: the low nibbles, at 6 bits the top 2 bits, the scales."""
    return 4 * 64 + (2 * 64 if bits == 6 else 0) + SCALE_BYTES


_FP16_MAX = 65504.0


def quantize(weight: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [out, in] uint8 in 0..2^bits-1, scale [out, in/32] fp16, minimum [out, in/32] fp16)."""
    out_features, in_features = weight.shape
    top = 2**bits - 1
    groups = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)
    minimum = groups.amin(-1).half()
    scale = ((groups.amax(-1) - minimum.float()) / top).half()
    steps = scale.float()[..., None]
    q = torch.where(steps > 0, (groups - minimum.float()[..., None]) / steps.clamp_min(1e-30), 0.0)
    q = q.round().clamp(0, top).to(torch.uint8).reshape(out_features, in_features)
    return q, scale, minimum


def dequantize(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    out_features, in_features = q.shape
    groups = q.float().reshape(out_features, in_features // GROUP, GROUP)
    return (groups * scale.float()[..., None] + minimum.float()[..., None]).reshape(out_features, in_features)


def pack(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """The kernel's layout (see int4_cpu.c): [blocks of 16 channels, groups, block_bytes(bits)] uint8."""
    out_features, in_features = q.shape
    padded = -(-out_features // LANES) * LANES
    extra = padded - out_features
    if extra:  # zero channels: computed, never stored
        q = torch.cat([q, q.new_zeros(extra, in_features)])
        scale = torch.cat([scale, scale.new_zeros(extra, scale.shape[1])])
        minimum = torch.cat([minimum, minimum.new_zeros(extra, minimum.shape[1])])
    blocks, groups = padded // LANES, in_features // GROUP
    # channel, group, vector t, nibble half, input i -> block, group, t, half, channel, i
    values = q.reshape(blocks, LANES, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
    low = values & 0x0F
    parts = [(low[:, :, :, 0] | (low[:, :, :, 1] << 4)).reshape(blocks, groups, 256)]
    if (
        bits == 6
    ):  # vector m = 2t + half of the unpacked 8 keeps its top 2 bits in vector m // 4, bits 2(m % 4)
        high = (values >> 4).reshape(blocks, groups, 2, 4, LANES, 4)
        shifted = [high[:, :, :, j] << (2 * j) for j in range(4)]
        parts.append((shifted[0] | shifted[1] | shifted[2] | shifted[3]).reshape(blocks, groups, 128))

    def per_block(values: torch.Tensor) -> torch.Tensor:
        by_group = values.reshape(blocks, LANES, groups).permute(0, 2, 1).contiguous()
        return by_group.view(torch.uint8).reshape(blocks, groups, 2 * LANES)

    return torch.cat([*parts, per_block(scale), per_block(minimum)], dim=-1).contiguous()


def unpack(packed: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack`'s inverse (the bit width read from the block size): (q, scale, minimum) for the
    first `out_features` channels."""
    blocks, groups, size = packed.shape
    vectors = packed[..., :256].reshape(blocks, groups, 4, LANES, 4)
    halves = torch.stack([vectors & 0x0F, vectors >> 4], dim=3)  # block, group, t, half, channel, i
    if size == block_bytes(6):
        high = packed[..., 256:384].reshape(blocks, groups, 2, 1, LANES, 4)
        fields = torch.cat([(high >> (2 * j)) & 3 for j in range(4)], dim=3)  # block, group, h, j, channel, i
        halves = halves | (fields.reshape(blocks, groups, 4, 2, LANES, 4) << 4)
    q = halves.permute(0, 4, 1, 2, 3, 5).reshape(blocks * LANES, groups * GROUP)
    scales = packed[..., size - SCALE_BYTES :]

    def per_channel(raw: torch.Tensor) -> torch.Tensor:
        values = raw.contiguous().view(torch.float16).reshape(blocks, groups, LANES)
        return values.permute(0, 2, 1).reshape(blocks * LANES, groups)

    scale = per_channel(scales[..., : 2 * LANES])
    minimum = per_channel(scales[..., 2 * LANES :])
    return (
        q[:out_features].contiguous(),
        scale[:out_features].contiguous(),
        minimum[:out_features].contiguous(),
    )


class WeightsDoNotFit(ValueError):
    """A weight is NaN, infinite, or too large for a group's fp16 scale and minimum."""


def pack_weight(weight: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """`pack(*quantize(weight, bits), bits=bits)` in one pass of C: the same bytes without torch's
    full-size temporaries. The same pass checks that fp16 scales can hold the weights
    (`WeightsDoNotFit` where not), so no separate pass over the weights is needed
    (docs/engine.md#quantizing-at-load-in-c-int4_pack has the load times)."""
    weight = weight.detach().float().contiguous()
    out_features, in_features = weight.shape
    blocks = -(-out_features // LANES)
    packed = torch.empty(blocks, in_features // GROUP, block_bytes(bits), dtype=torch.uint8)
    status = library().int4_pack(
        weight.data_ptr(), out_features, in_features, bits, packed.data_ptr(), torch.get_num_threads()
    )
    if status == -2:
        raise WeightsDoNotFit(
            f"a {out_features}x{in_features} weight holds a NaN, an infinity or a value beyond "
            f"+-{_FP16_MAX / 2:.0f}"
        )
    if status != 0:
        raise ValueError(f"cannot pack a {out_features}x{in_features} weight at {bits} bits")
    return packed


class ManyRowPath(Protocol):
    """Another kernel for forwards of `min_rows` tokens or more (a draft's reads, see draft_bulk)."""

    min_rows: int

    def matmul(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


def _settle_when_freed(linear: nn.Module) -> None:
    """The kernel's helper thread may still be reading an op's weights when the op has
    returned (helper_cpu.c): a linear waits for it before its tensors can be freed."""
    weakref.finalize(linear, native.settle_helper)


class Int4Linear(nn.Module):
    """A linear with 4-bit (or 6-bit) weights, run by `int4_cpu.c`; fp32 in, fp32 out."""

    bias: nn.Parameter | None
    packed: torch.Tensor
    many_rows: ManyRowPath | None = None  # never set on a target: it changes the numbers

    def __init__(
        self, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, *,
        bits: int | None = None, in_features: int | None = None,
    ) -> None:  # fmt: skip
        """`packed`: [blocks, groups, block bytes] of layout 4 or 6 (told by its size), or, with
        `bits` K4 or K6 and `in_features`, [blocks, bytes per block] of a repacked GGUF tensor."""
        super().__init__()
        self.out_features = out_features
        self.in_features = in_features if in_features is not None else packed.shape[1] * GROUP
        self.bits = bits if bits is not None else 6 if packed.shape[2] == block_bytes(6) else 4
        self.register_buffer("packed", packed.contiguous())
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        )
        library()  # refuse here, in one line, if the kernel cannot run
        _settle_when_freed(self)

    def __setstate__(self, state: dict[str, Any]) -> None:  # a copy (deepcopy, pickle) is freed the same way
        super().__setstate__(state)
        _settle_when_freed(self)

    def _apply(self, fn: Any, recurse: bool = True) -> Int4Linear:
        native.settle_helper()  # `.to()` and the like may swap (and free) the tensors the helper reads
        return super()._apply(fn, recurse)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 4) -> Int4Linear:
        return cls(pack_weight(linear.weight, bits), linear.out_features, linear.bias)

    @classmethod
    def stack(cls, parts: Sequence[Int4Linear], bias: torch.Tensor | None) -> Int4Linear:
        """One linear whose output is the parts' outputs side by side, the same values exactly
        (`fused_int8.fuse_rows` checks the input sizes and stacks the biases)."""
        out_features, bits = sum(p.out_features for p in parts), parts[0].bits
        if all(p.out_features % LANES == 0 for p in parts[:-1]):  # whole blocks: side by side as they are
            packed = torch.cat([p.packed for p in parts])
            return cls(packed, out_features, bias, bits=bits, in_features=parts[0].in_features)
        if bits & K_SCALES:
            raise ValueError("repacked GGUF linears stack only in whole blocks of 16 outputs")
        pieces = [unpack(p.packed, p.out_features) for p in parts]
        q, scale, minimum = (torch.cat([piece[i] for piece in pieces]) for i in range(3))
        return cls(pack(q, scale, minimum, parts[0].bits), out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Called ~100 times a step: no work here that fp32, contiguous input does not need.
        rows = x.reshape(-1, self.in_features)
        if self.many_rows is not None and rows.shape[0] >= self.many_rows.min_rows:
            y = self.many_rows.matmul(rows, self.bias)
        else:
            y = self.matmul(rows, self.out_features)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def matmul(self, rows: torch.Tensor, n_out: int) -> torch.Tensor:
        """The first `n_out` outputs of rows [T, in]: [T, n_out]. The kernel reads only their
        blocks of weights (a prefix of `packed`)."""
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        y = torch.empty(rows.shape[0], n_out)
        status = library().int4_linear(
            self.packed.data_ptr(), n_out, self.in_features, rows.data_ptr(), rows.shape[0],
            None if self.bias is None else self.bias.data_ptr(), y.data_ptr(), torch.get_num_threads(),
            self.bits,
        )  # fmt: skip
        if status != 0:
            raise MemoryError(f"out of memory in a {self.bits}-bit linear of {rows.shape[0]} rows")
        return y

    def dense_weight(self) -> torch.Tensor:
        """The weights as floats [out, in], exactly the values the kernel multiplies by:
        `dequantize(*unpack(...))` in one pass of C."""
        weight = torch.empty(self.out_features, self.in_features)
        status = library().int4_unpack(
            self.packed.data_ptr(), self.out_features, self.in_features, self.bits, weight.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"cannot unpack a {self.out_features}x{self.in_features} weight")
        return weight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


def quantize_linears_int4(model: nn.Module) -> int:
    """Every nn.Linear to 4 bits in place, but the LM head (6 bits) and any that does not fit
    (int8); returns how many took 4 bits."""
    head = output_head(model)
    four_bit = 0
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        bits = HEAD_BITS if linear is head else 4
        packed = _int4_or_none(linear, bits)
        _replace(model, name, PerTokenInt8Linear(linear) if packed is None else packed)
        if packed is not None and bits == 4:
            four_bit += 1
    return four_bit


def _int4_or_none(linear: nn.Linear, bits: int) -> Int4Linear | None:
    """The linear at `bits`, or None where it cannot be: inputs not in whole groups of 32, or
    weights fp16 scales cannot hold (a NaN, an infinity, a value past half of fp16's range)."""
    if linear.in_features % GROUP:
        return None
    try:
        return Int4Linear.from_linear(linear, bits)
    except WeightsDoNotFit:
        return None


def head_to_int4(model: nn.Module) -> bool:
    """A draft's LM head to 4 bits too (from its 6-bit or int8 values); True if it changed.

    Only for drafts: the target verifies every token, so a draft's head may round more,
    and at 4 bits the 0.5B draft's 151,936-row head is ~85 MB a step instead of ~119 (6 bits).
    """
    head = output_head(model)
    if isinstance(head, Int4Linear) and head.bits == 4:
        return False
    if not isinstance(head, (PerTokenInt8Linear, Int4Linear)) or head.in_features % GROUP:
        return False
    dense = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None)
    dense.weight.data = head.dense_weight()
    if head.bias is not None:
        dense.bias.data = head.bias.detach().clone()
    name = next(n for n, module in model.named_modules() if module is head)
    _replace(model, name, Int4Linear.from_linear(dense))
    return True


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's LM head module, or None where it has none."""
    output_embeddings = getattr(model, "get_output_embeddings", None)
    return output_embeddings() if callable(output_embeddings) else None


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
