"""The 32-weight GGUF block types in the int4 path's own layouts, with the file's values.

Q4_0, Q4_1, Q5_0 and Q5_1 keep, per 32 weights, one fp16 `d` (and for the _1 types one fp16
`m`) and 4- or 5-bit q values; llama.cpp decodes them as `d * (q - 8)`, `d * q + m`,
`d * (q - 16)` and `d * q + m`. int4_cpu.c's layouts 4 and 6 keep, per 32 weights of a
channel, an fp16 scale and minimum and 4- or 6-bit q values, decoded as `scale * q + minimum`.
So each block moves over unchanged: scale = d, minimum = m, or -8d / -16d, which fp16 holds
exactly (a power of two times an fp16) unless it overflows; and in fp32, `d * q` being exact,
`d * q + (-8d)` is `d * (q - 8)` bit for bit. A tensor whose minimum would not fit is left to
the blocks' own kernel (`repack` raises `ValueError`).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from .int4_cpu import GROUP, pack

Q4_0, Q4_1 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1
Q5_0, Q5_1 = GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1
# Each type's layout (the q bits) and, for the types without an `m`, the q value that is zero.
LAYOUT_BITS = {Q4_0: 4, Q4_1: 4, Q5_0: 6, Q5_1: 6}
_OFFSET = {Q4_0: 8, Q5_0: 16}


def repack(qtype: GGMLQuantizationType, blocks: np.ndarray, out_features: int, in_features: int) -> torch.Tensor:
    """The tensor's blocks [out_features rows of blocks, as the file holds them] in layout
    `LAYOUT_BITS[qtype]`: [channel blocks of 16, groups, block bytes] uint8."""
    rows = blocks.reshape(out_features, in_features // GROUP, -1)
    d = rows[..., 0:2].copy().view(np.float16)[..., 0]
    at = 2
    if qtype in (Q4_1, Q5_1):
        minimum = rows[..., 2:4].copy().view(np.float16)[..., 0]
        at = 4
    else:
        wanted = d.astype(np.float32) * -_OFFSET[qtype]
        if not np.all(np.abs(wanted) <= np.finfo(np.float16).max):
            raise ValueError(f"a {qtype.name} scale too large for an fp16 minimum")
        minimum = wanted.astype(np.float16)  # exact: a power of two times an fp16
    high = None
    if qtype in (Q5_0, Q5_1):
        high = rows[..., at : at + 4].copy().view("<u4")[..., 0]
        at += 4
    q = _nibbles(rows[..., at : at + 16])
    if high is not None:
        bits = (high[..., None] >> np.arange(GROUP, dtype=np.uint32)) & 1
        q |= (bits << 4).astype(np.uint8)
    return pack(
        torch.from_numpy(q.reshape(out_features, in_features)),
        torch.from_numpy(d.copy()),
        torch.from_numpy(minimum.copy()),
        LAYOUT_BITS[qtype],
    )


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] q values: the low nibbles are weights 0-15, the high 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.uint8)
