"""GGUF weights as the file stores them: a linear that multiplies by the file's own blocks.

A GGUF keeps each weight tensor as rows of llama.cpp's quantized blocks (Q4_K, Q6_K, Q8_0, ...).
`GGUFLinear` holds those bytes as they are (a slice of the memory-mapped file: no copy, no
dequantized or re-quantized version) and computes

    y = x @ W.T (+ bias),   W = gguf.quants.dequantize(blocks, qtype), bit for bit,

with x in fp32, unquantized ("f32"), or, for the types repacked for our int4 kernel, int8 per
32 inputs ("i8", below).
`gguf_cpu.c` sums in an order fixed per (row, column) either way, so a row's result is bitwise
the same whatever the number of rows in the call and the thread count: what speculative
decoding's exactness needs.

Where the C kernels cannot run (no compiler: `native.unavailable()` says why), the linear
de-quantizes its weights with `gguf.quants` and multiplies fp32 rows in torch: slower, the same
weights bit for bit, no rounding of the activations, and still batch-invariant: the rows go
through the matmul in chunks of a fixed count (batch_invariant.in_fixed_rows), because torch's
1-row product (a gemv) sums in an order that can change with the thread count. The de-quantized
weights are kept for the next call while they leave a quarter of the machine's memory free
(`_room_for`); past that each call de-quantizes again (slow, the same numbers). `GGUFLinear.path`
says which of the two runs, for the fidelity label (`FALLBACK_NOTE`).

Activations (`GGUFLinear.activations`): with `"f32"`, the default, x is not quantized at all:
the answer carries the file's rounding and no other. (llama.cpp rounds x to Q8 blocks, one
scale per 32 or 256 inputs; that adds a rounding the file does not hold, so it is not offered.)
With `"i8"` (Q4_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1: `REPACKED_BITS`) the blocks are repacked once,
as the linear is made, into a layout of our int4 kernel (int4_cpu.c): the K-quants via
gguf_cpu.c's gguf_repack, every q value, scale and fp16 d moved unchanged, the kernel forming
each scale as the dequantization does (d * sc, exact in fp32); the 32-weight types into the
int4 path's own layouts (gguf_plain.py), d and m as its fp16 scale and minimum. Either way the
weights are still the file's, bit for bit. The rows are quantized as int4_cpu.c quantizes
them: int8 with one scale per 32 inputs (max |x| / 127), finer than llama.cpp's Q8_K (one per
256). That runs at the int4 kernel's pace, at the cost of the repacked copy in memory (about
the tensor's own size, 1-3% more; the file's pages then go unread and the system may drop them).
`GGUFLinear.fidelity` says which in words, for the fidelity label.

`block_type` is the one place that says which block types run here; any other (IQ2_XS, Q3_K,
...) is refused in one line naming it.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from typing import Any

import numpy as np
import psutil
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants
from torch import nn

from ..batch_invariant import in_fixed_rows
from . import gguf_plain, native
from .int4_cpu import GROUP, K4, K6, K_SCALES, LANES, Int4Linear, block_bytes

SUPPORTED = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)
NATIVE = "native"  # gguf_cpu.c, the blocks decoded in registers
FALLBACK = "fallback"  # gguf.quants de-quantizes the blocks, torch multiplies fixed-rows chunks
# What the fallback computes, for the fidelity label: the file's weights, unrounded rows, exact.
FALLBACK_NOTE = "de-quantized into torch, fp32 activations"
# The share of the machine's memory the fallback's kept de-quantized weights leave free.
_KEEP_FREE = 0.25
F32 = "f32"  # rows as they are, fp32
I8 = "i8"  # rows quantized to int8 per 32 inputs, the blocks repacked for int4_cpu.c's kernel
# The block types "i8" runs, and the int4_cpu.c layout each is repacked into: the K-quants
# into K4 and K6 (gguf_cpu.c's gguf_repack), the 32-weight types into the int4 path's own
# layouts 4 and 6 (gguf_plain.py). Either way the weights are the file's values exactly.
REPACKED_BITS = {GGMLQuantizationType.Q4_K: K4, GGMLQuantizationType.Q6_K: K6, **gguf_plain.LAYOUT_BITS}


class UnsupportedBlockType(ValueError):
    """A tensor's block type is not one this module runs; the message names it in one line."""


def supported_names() -> tuple[str, ...]:
    """The block types GGUFLinear runs, by their GGUF names."""
    return tuple(qtype.name for qtype in SUPPORTED)


def block_type(qtype: int | str | GGMLQuantizationType) -> GGMLQuantizationType:
    """The block type named (`"Q4_K"`) or numbered (ggml's id), if GGUFLinear runs it;
    `UnsupportedBlockType` in one line naming it otherwise."""
    try:
        known = GGMLQuantizationType[qtype] if isinstance(qtype, str) else GGMLQuantizationType(qtype)
    except (KeyError, ValueError):
        known = None
    if known is None or known not in SUPPORTED:
        name = known.name if known is not None else str(qtype)
        raise UnsupportedBlockType(
            f"GGUF block type {name} is not supported; weights run as stored in {', '.join(supported_names())}"
        )
    return known


def kernels_run() -> bool:
    """Whether the C kernels run here (else every quantized linear takes the slow fallback)."""
    return native.unavailable() is None


def repacks(qtype: int) -> bool:
    """Whether `activations="i8"` runs a tensor of this type here (`REPACKED_BITS`; the kernels built)."""
    return qtype in REPACKED_BITS and kernels_run()


def row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    """Bytes of one output row of `in_features` weights (a whole number of blocks)."""
    weights, size = GGML_QUANT_SIZES[qtype]
    if in_features % weights:
        raise ValueError(f"{in_features} inputs are not whole {qtype.name} blocks of {weights}")
    return in_features // weights * size


@functools.cache
def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The library with gguf_cpu.c's signatures declared (once per loaded library)."""
    pointer, size, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gguf_linear.argtypes = [c_int, pointer, size, size, pointer, size, pointer, pointer, c_int]
    lib.gguf_linear.restype = c_int
    lib.gguf_dequantize.argtypes = [c_int, pointer, size, size, pointer, c_int]
    lib.gguf_dequantize.restype = c_int
    lib.gguf_block_bytes.argtypes = [c_int, ctypes.POINTER(ctypes.c_int64)]
    lib.gguf_block_bytes.restype = size
    lib.gguf_repack.argtypes = [c_int, pointer, size, size, pointer, c_int]
    lib.gguf_repack.restype = c_int
    lib.gguf_repacked_bytes.argtypes = [c_int, size, size]
    lib.gguf_repacked_bytes.restype = size
    return lib


def kernel() -> ctypes.CDLL:
    """The compiled kernels (native.KernelUnavailable where they cannot run)."""
    return _typed(native.library())


def _raw_bytes(blocks: np.ndarray | torch.Tensor) -> np.ndarray:
    """The blocks as a flat uint8 array over the same memory (a memmap slice stays one)."""
    if isinstance(blocks, torch.Tensor):
        if blocks.device.type != "cpu":
            raise ValueError(f"GGUF blocks must be in CPU memory, not on {blocks.device}")
        blocks = blocks.numpy()
    if blocks.dtype != np.uint8:
        raise ValueError(f"GGUF blocks must be uint8 bytes, not {blocks.dtype}")
    if not blocks.flags.c_contiguous:
        raise ValueError("GGUF blocks must be one contiguous run of bytes, as the file holds them")
    return blocks.reshape(-1)


class GGUFLinear(nn.Module):
    """A linear whose weight [out_features, in_features] is a GGUF tensor's blocks as stored."""

    bias: nn.Parameter | None

    def __init__(
        self,
        qtype: int | str | GGMLQuantizationType,
        blocks: np.ndarray | torch.Tensor,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
        activations: str | None = None,
    ) -> None:
        """`activations`: "f32" or "i8" (see the module's docstring); None is "f32"."""
        super().__init__()
        self.qtype = block_type(qtype)
        self.in_features, self.out_features = in_features, out_features
        self.row_bytes = row_bytes(self.qtype, in_features)
        self.blocks = _raw_bytes(blocks)  # not a buffer: the file's memory, never copied or moved
        if self.blocks.size != out_features * self.row_bytes:
            raise ValueError(
                f"a {out_features}x{in_features} {self.qtype.name} tensor is "
                f"{out_features * self.row_bytes} bytes, not {self.blocks.size}"
            )
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        )
        self.fallback_reason = native.unavailable()  # None: the C kernel runs
        self.path = NATIVE if self.fallback_reason is None else FALLBACK
        self.activations = self._activations(activations)
        self.packed: np.ndarray | None = None
        if self.activations == I8:
            try:
                self.packed = self._repack()
            except ValueError:  # a value the layout cannot hold: the blocks' own kernel runs them
                self.activations = F32
        self._dense: torch.Tensor | None = None  # the fallback's de-quantized weights, where kept

    def _repack(self) -> np.ndarray:
        """The blocks in int4_cpu.c's layout for this type (a copy in memory; the same values)."""
        weakref.finalize(self, native.settle_helper)
        if self.qtype in gguf_plain.LAYOUT_BITS:
            return gguf_plain.repack(self.qtype, self.blocks, self.out_features, self.in_features).numpy().reshape(-1)
        lib = kernel()
        size = lib.gguf_repacked_bytes(int(self.qtype), self.out_features, self.in_features)
        packed = np.empty(size, dtype=np.uint8)
        status = lib.gguf_repack(
            int(self.qtype), self.blocks.ctypes.data, self.out_features, self.in_features, packed.ctypes.data,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"gguf_cpu.c cannot repack a {self.qtype.name} tensor of {self.in_features} inputs")
        return packed

    def __setstate__(self, state: dict[str, Any]) -> None:  # a copy (deepcopy, pickle) is freed the same way
        super().__setstate__(state)
        if self.packed is not None:
            weakref.finalize(self, native.settle_helper)

    def _apply(self, fn: Any, recurse: bool = True) -> GGUFLinear:
        if self.packed is not None:
            native.settle_helper()  # `.to()` and the like may swap (and free) the bias the helper reads
        return super()._apply(fn, recurse)

    def _activations(self, asked: str | None) -> str:
        """The activation mode this linear runs: `asked`, or fp32 rows where None."""
        if asked is None:
            return F32
        if asked not in (F32, I8):
            raise ValueError(f"activations must be {F32!r} or {I8!r}, not {asked!r}")
        if asked == I8 and (self.path != NATIVE or self.qtype not in REPACKED_BITS):
            why = (
                f"only {', '.join(t.name for t in REPACKED_BITS)} repack"
                if self.qtype not in REPACKED_BITS
                else self.fallback_reason
            )
            raise ValueError(f"int8 activations per 32 inputs cannot run on {self.qtype.name} here: {why}")
        return asked

    @property
    def fidelity(self) -> str:
        """What this linear computes, in words: the weights as stored, and the activations."""
        if self.activations == I8:
            return "as stored, activations int8 per 32 inputs (finer than llama.cpp's Q8_K)"
        return "as stored, fp32 activations"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        if self.path == FALLBACK:
            y = self._fallback(rows)
        elif self.packed is not None:
            y = self._repacked(rows)
        else:
            y = self._native(rows)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def _native(self, rows: torch.Tensor) -> torch.Tensor:
        y = torch.empty(rows.shape[0], self.out_features)
        status = kernel().gguf_linear(
            int(self.qtype), self.blocks.ctypes.data, self.out_features, self.in_features, rows.data_ptr(),
            rows.shape[0], None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(
                f"gguf_cpu.c refused a {self.out_features}x{self.in_features} {self.qtype.name} linear"
            )
        return y

    def _repacked(self, rows: torch.Tensor) -> torch.Tensor:
        int4 = self.as_int4()
        assert int4 is not None
        return int4.matmul(rows, self.out_features)

    def _fallback(self, rows: torch.Tensor) -> torch.Tensor:
        """Chunks of a fixed row count, so torch's matmul sees one shape whatever the batch
        and sums a row in the same order at any thread count."""
        weight = self._dense if self._dense is not None else self._fallback_weight()
        return in_fixed_rows(lambda chunk: F.linear(chunk, weight, self.bias), rows, self.out_features)

    def _fallback_weight(self) -> torch.Tensor:
        """The de-quantized weights, kept for the next call where memory allows."""
        weight = self.dense_weight()
        if _room_for(weight.nbytes):
            self._dense = weight
        return weight

    def dense_weight(self) -> torch.Tensor:
        """The weights as floats [out, in]: exactly the values either path multiplies by."""
        if self.path == NATIVE:
            weight = torch.empty(self.out_features, self.in_features)
            status = kernel().gguf_dequantize(
                int(self.qtype), self.blocks.ctypes.data, self.out_features, self.in_features, weight.data_ptr(),
                torch.get_num_threads(),
            )  # fmt: skip
            if status != 0:
                raise ValueError(
                    f"gguf_cpu.c cannot decode a {self.qtype.name} tensor of {self.in_features} inputs"
                )
            return weight
        values = gguf_quants.dequantize(self.blocks.reshape(self.out_features, self.row_bytes), self.qtype)
        # F32 comes back as a view of the file's read-only memory: torch gets a copy of that one.
        return torch.from_numpy(values if values.flags.writeable else values.copy())

    def as_int4(self) -> Int4Linear | None:
        """This linear as int4_cpu's module over the same repacked bytes (layout K4, K6, 4 or 6):
        the int4 path's fusion and one-call layers take it. None where it is not repacked."""
        if self.packed is None:
            return None
        blocks, bits = -(-self.out_features // LANES), REPACKED_BITS[self.qtype]
        shape = (blocks, -1) if bits & K_SCALES else (blocks, self.in_features // GROUP, block_bytes(bits))
        packed = torch.from_numpy(self.packed).view(*shape)
        return Int4Linear(packed, self.out_features, self.bias, bits=bits, in_features=self.in_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype.name}, "
            f"path={self.path}, activations={self.activations}"
        )


def _room_for(nbytes: int) -> bool:
    """Whether `nbytes` more in memory still leave _KEEP_FREE of the machine's memory available."""
    memory = psutil.virtual_memory()
    return memory.available - nbytes >= _KEEP_FREE * memory.total
