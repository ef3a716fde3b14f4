"""fp32 rows to llama.cpp's blocks, byte for byte as llama.cpp's reference quantizers write them.

`quantize(rows, qtype)` runs `gguf_quantize.c`: Q8_0, Q5_0, Q4_K and Q6_K, the types of
llama.cpp's Q4_K_M and Q8_0 mixes (Q5_0 and Q8_0 are its fallbacks where a row is not whole
256-weight blocks). No importance matrix: what `llama-quantize` writes without `--imatrix`.
The C kernels must be built (`native.unavailable()` says why not in one line).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import native

QUANTIZED = (
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
)


@functools.cache
def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The library with gguf_quantize.c's signature declared (once per loaded library)."""
    lib.gguf_quantize_rows.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    lib.gguf_quantize_rows.restype = ctypes.c_int64
    return lib


def quantize(rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`rows` [n, cols] (fp32, or anything that widens to it exactly) as `qtype` blocks: uint8
    [n, bytes per row]. Raises ValueError for a type not in QUANTIZED or a row that is not
    whole blocks, native.KernelUnavailable where the kernels cannot be built."""
    if qtype not in QUANTIZED:
        raise ValueError(f"no quantizer for {qtype.name}: only {', '.join(t.name for t in QUANTIZED)}")
    values = np.ascontiguousarray(rows, dtype=np.float32)
    if values.ndim != 2:
        raise ValueError(f"quantize takes a matrix of rows, not shape {values.shape}")
    n, cols = values.shape
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"rows of {cols} values are not whole {qtype.name} blocks of {block}")
    out = np.empty((n, cols // block * block_bytes), dtype=np.uint8)
    written = _typed(native.library()).gguf_quantize_rows(
        int(qtype), values.ctypes.data, n, cols, out.ctypes.data
    )
    if written != out.shape[1]:
        raise ValueError(f"gguf_quantize.c refused {qtype.name} rows of {cols}")
    return out
