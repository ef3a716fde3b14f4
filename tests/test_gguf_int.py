"""A GGUF block's integer parts (q values, scales, mins, d) read in numpy as llama.cpp's
dequantize_row_* reads them: the reference tests/test_gguf_repacked.py checks the repacked
layouts against, itself checked here against the gguf package's de-quantized values."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from tests.test_gguf_blocks import _stored_blocks

Q = GGMLQuantizationType
INTEGER_TYPES = (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
K_QUANTS = {Q.Q4_K, Q.Q5_K, Q.Q6_K}


def _inputs_for(qtype: GGMLQuantizationType) -> int:
    """Two K-quant blocks; nine 32-weight blocks (a group and a half-filled chunk past it)."""
    return 512 if qtype in K_QUANTS else 288


def _half(raw: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 at byte `offset` of each block, as float64."""
    return raw[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float64)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> weights 0..15 from the low nibbles, 16..31 from the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)


def _fifth_bits(raw: np.ndarray, offset: int) -> np.ndarray:
    qh = raw[..., offset : offset + 4].copy().view(np.uint32)[..., 0].astype(np.int64)
    return (qh[..., None] >> np.arange(32)) & 1


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for the 8 sub-blocks of each 12-byte field."""
    q = scales.astype(np.int64)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, m


def _integer_weights(qtype: GGMLQuantizationType, stored: np.ndarray) -> dict[str, np.ndarray]:
    """Each block's integer weights and scales as llama.cpp's vec_dot reads them:
    q [out, blocks, weights]; d, dmin, m [out, blocks]; sc, mins [out, blocks, sub-blocks]."""
    size = GGML_QUANT_SIZES[qtype][1]
    raw = stored.reshape(stored.shape[0], -1, size)
    if qtype == Q.Q4_0:
        return {"q": _nibbles(raw[..., 2:18]) - 8, "d": _half(raw, 0)}
    if qtype == Q.Q4_1:
        return {"q": _nibbles(raw[..., 4:20]), "d": _half(raw, 0), "m": _half(raw, 2)}
    if qtype == Q.Q5_0:
        return {"q": _nibbles(raw[..., 6:22]) + 16 * _fifth_bits(raw, 2) - 16, "d": _half(raw, 0)}
    if qtype == Q.Q5_1:
        q = _nibbles(raw[..., 8:24]) + 16 * _fifth_bits(raw, 4)
        return {"q": q, "d": _half(raw, 0), "m": _half(raw, 2)}
    if qtype == Q.Q8_0:
        return {"q": raw[..., 2:34].view(np.int8).astype(np.int64), "d": _half(raw, 0)}
    if qtype in (Q.Q4_K, Q.Q5_K):
        sc, mins = _scale_min_k4(raw[..., 4:16])
        qs = raw[..., 16:144] if qtype == Q.Q4_K else raw[..., 48:176]
        # bytes 32c..32c+31: sub-block 2c in the low nibbles, 2c + 1 in the high ones
        low = np.stack([qs[..., 32 * c : 32 * c + 32] for c in range(4)], axis=-2)
        q = np.stack([low & 0x0F, low >> 4], axis=-2).reshape(*raw.shape[:-1], 256).astype(np.int64)
        if qtype == Q.Q5_K:
            qh = raw[..., 16:48].astype(np.int64)  # bit s of byte l: sub-block s, weight l
            q += 16 * ((qh[..., None, :] >> np.arange(8)[:, None]) & 1).reshape(*raw.shape[:-1], 256)
        return {"q": q, "d": _half(raw, 0), "dmin": _half(raw, 2), "sc": sc, "mins": mins}
    # Q6_K: weight 128h + 32p + l: nibble p // 2 of ql[64h + 32(p & 1) + l], bits 2p of qh[32h + l]
    ql, qh = raw[..., 0:128].astype(np.int64), raw[..., 128:192].astype(np.int64)
    q = np.empty((*raw.shape[:-1], 256), dtype=np.int64)
    for h in range(2):
        for p in range(4):
            low = (ql[..., 64 * h + 32 * (p & 1) : 64 * h + 32 * (p & 1) + 32] >> 4 * (p // 2)) & 0x0F
            high = (qh[..., 32 * h : 32 * h + 32] >> 2 * p) & 3
            q[..., 128 * h + 32 * p : 128 * h + 32 * p + 32] = (low | high << 4) - 32
    return {"q": q, "d": _half(raw, 208), "sc": raw[..., 192:208].view(np.int8).astype(np.int64)}


@pytest.mark.parametrize("qtype", INTEGER_TYPES, ids=lambda qtype: qtype.name)
def test_the_numpy_reference_reads_the_same_weights_as_the_gguf_package(qtype: GGMLQuantizationType) -> None:
    stored = _stored_blocks(qtype, 6, _inputs_for(qtype))
    w = _integer_weights(qtype, stored)
    if qtype in K_QUANTS:
        per = 256 // w["sc"].shape[-1]
        weight = w["d"][..., None] * np.repeat(w["sc"], per, -1) * w["q"]
        if "mins" in w:
            weight -= w["dmin"][..., None] * np.repeat(w["mins"], 32, -1)
    else:
        weight = w["d"][..., None] * w["q"] + (w["m"][..., None] if "m" in w else 0)
    dequantized = gguf_quants.dequantize(stored, qtype).astype(np.float64)
    assert np.allclose(weight.reshape(dequantized.shape), dequantized, rtol=2**-20, atol=0)
