"""GGUF weights times activations quantized as llama.cpp quantizes them (gguf_cpu.c's
gguf_linear_q8, GGUFLinear's "q8" mode): llama.cpp's algorithm, written out here in numpy
(quantize_row_q8_K_ref / q8_0 / q8_1, integer block products, float scales), up to the order
of the float sums; bitwise the same for a row in any batch, at any thread count, in any build."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants
from rowwise import assert_rows_bitwise_the_same

from specdec_core.kernels.cpu import features, gguf_blocks, native
from specdec_core.kernels.cpu.gguf_blocks import F32, Q8, GGUFLinear
from tests.test_gguf_blocks import _stored_blocks

needs_kernel = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))

Q = GGMLQuantizationType
INTEGER_TYPES = tuple(gguf_blocks.ACTIVATION_BLOCKS)
K_QUANTS = {Q.Q4_K, Q.Q5_K, Q.Q6_K}
WITH_SUMS = {Q.Q4_1, Q.Q5_1}  # they meet Q8_1 activations: d and s = d x the sum of the quants


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


def _q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_row_q8_K_ref: (q [blocks, 256], d [blocks]) for one row of fp32."""
    blocks = x.astype(np.float32).reshape(-1, 256)
    q = np.zeros(blocks.shape, dtype=np.int64)
    d = np.zeros(len(blocks), dtype=np.float32)
    for i, block in enumerate(blocks):
        largest = block[np.argmax(np.abs(block))]  # the first of the largest magnitude
        if largest == 0:
            continue
        iscale = np.float32(-127.0) / largest
        q[i] = np.minimum(np.rint(iscale * block), 127)  # nearest_int: to nearest, ties to even
        d[i] = np.float32(1.0) / iscale
    return q, d.astype(np.float64)


def _q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q8_0_ref / q8_1_ref: (q [blocks, 32], fp16 d, fp16 s) for one row."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    d = np.abs(blocks).max(axis=1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    scaled = (blocks * inverse[:, None]).astype(np.float64)
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)).astype(np.int64)  # roundf: ties away from 0
    s = (q.sum(axis=1).astype(np.float32) * d).astype(np.float16)
    return q, d.astype(np.float16).astype(np.float64), s.astype(np.float64)


def _llama_cpp(
    qtype: GGMLQuantizationType, stored: np.ndarray, x: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's y = W x for rows x, in float64 from exact integer block products, and the
    sum of the magnitudes of every term (the scale of any float summation order's error)."""
    w = _integer_weights(qtype, stored)
    ys, scales = [], []
    for row in x:
        if qtype in K_QUANTS:
            q8, dy = _q8_k(row)
            products = w["q"] * q8  # [out, blocks, 256]
            per = 16 if qtype == Q.Q6_K else 32
            sums = products.reshape(*products.shape[:2], -1, per).sum(-1)  # [out, blocks, sub-blocks]
            magnitudes = np.abs(products).reshape(*sums.shape, per).sum(-1)
            d = w["d"] * dy
            y = (d * (w["sc"] * sums).sum(-1)).sum(-1)
            scale = (np.abs(d) * (np.abs(w["sc"]) * magnitudes).sum(-1)).sum(-1)
            if qtype != Q.Q6_K:
                bsums = q8.reshape(len(q8), 8, 32).sum(-1)
                mins = w["dmin"] * dy * (w["mins"] * bsums).sum(-1)
                y = y - mins.sum(-1)
                scale = scale + (np.abs(w["dmin"] * dy) * (w["mins"] * np.abs(bsums)).sum(-1)).sum(-1)
        else:
            q8, dy, sy = _q8_0(row)
            products = w["q"] * q8  # [out, blocks, 32]
            d = w["d"] * dy
            y = (d * products.sum(-1)).sum(-1)
            scale = (np.abs(d) * np.abs(products).sum(-1)).sum(-1)
            if qtype in WITH_SUMS:
                y, scale = y + (w["m"] * sy).sum(-1), scale + np.abs(w["m"] * sy).sum(-1)
        ys.append(y)
        scales.append(scale)
    return np.stack(ys), np.stack(scales)


def _assert_is_llama_cpps_function(linear: GGUFLinear, x: torch.Tensor, y: torch.Tensor) -> None:
    want, scale = _llama_cpp(linear.qtype, linear.blocks.reshape(linear.out_features, -1), x.numpy())
    bias = np.zeros(linear.out_features) if linear.bias is None else linear.bias.double().numpy()
    # roundings of a lane's chain of products and sums, of the reduction and of the bias, with room
    roundings = 4 * (linear.in_features // 64 + 8)
    error = np.abs(y.double().numpy() - (want + bias))
    assert np.all(error <= roundings * 2.0**-24 * (scale + np.abs(bias)))


def _rows_with_ties(in_features: int, rows: int, seed: int) -> torch.Tensor:
    """Random rows, and one whose quantization meets exact halves: llama.cpp's rounding rules
    (ties to even for Q8_K, away from zero for Q8_0/Q8_1) decide those quants."""
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    ties = torch.tensor([127.0, -127.0, 2.5, -2.5, 0.5, -0.5, 1.5, 3.5] * (in_features // 8))
    x[0] = ties  # max -127 or +127 per block: scales of exactly 1
    x[0, ::256] = -127.0  # Q8_K: the block's largest is negative, so its scale is exactly 1
    return x


def _linear(qtype: GGMLQuantizationType, activations: str | None = None, seed: int = 0) -> GGUFLinear:
    in_features, out_features = _inputs_for(qtype), 37
    generator = torch.Generator().manual_seed(seed)
    return GGUFLinear(
        qtype, _stored_blocks(qtype, out_features, in_features, seed), in_features, out_features,
        torch.randn(out_features, generator=generator), activations=activations,
    )  # fmt: skip


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


def test_the_numpy_reference_quantizes_q8_0_as_the_gguf_package() -> None:
    x = _rows_with_ties(256, 3, seed=7).numpy()
    for row in x:
        q, d, _ = _q8_0(row)
        packed = np.asarray(gguf_quants.quantize(row.reshape(1, -1), Q.Q8_0)).reshape(-1, 34)
        assert np.array_equal(packed[:, 2:].view(np.int8), q)
        assert np.array_equal(packed[:, :2].copy().view(np.float16)[:, 0].astype(np.float64), d)


@needs_kernel
@pytest.mark.parametrize("qtype", INTEGER_TYPES, ids=lambda qtype: qtype.name)
def test_q8_activations_compute_llama_cpps_function(qtype: GGMLQuantizationType) -> None:
    linear = _linear(qtype)
    assert linear.activations == Q8
    x = _rows_with_ties(linear.in_features, 5, seed=1)
    _assert_is_llama_cpps_function(linear, x, linear(x))


@needs_kernel
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0, Q.Q4_1], ids=lambda qtype: qtype.name)
def test_a_q8_rows_result_is_bitwise_the_same_in_any_batch_and_at_any_thread_count(
    qtype: GGMLQuantizationType,
) -> None:
    linear = _linear(qtype)
    x = torch.randn(40, linear.in_features, generator=torch.Generator().manual_seed(2))  # past 32 rows too
    assert_rows_bitwise_the_same(linear, x)


@needs_kernel
def test_every_build_this_cpu_runs_computes_the_same_q8_bits(monkeypatch, tmp_path) -> None:
    builds = [isa.name for isa in features.runnable()]
    if len(builds) < 2:
        pytest.skip(f"this CPU runs only the {builds[0]} build")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    linears = [_linear(qtype) for qtype in INTEGER_TYPES]
    x = _rows_with_ties(512, 5, seed=3)
    outputs = []
    for name in builds:
        monkeypatch.setenv(features.ISA_ENV, name)
        native._load.cache_clear()
        outputs.append([linear(x[:, : linear.in_features]) for linear in linears])
    native._load.cache_clear()
    for name, other in zip(builds[1:], outputs[1:], strict=True):
        for linear, first, this in zip(linears, outputs[0], other, strict=True):
            assert torch.equal(first, this), (builds[0], name, linear.qtype.name)


@needs_kernel
def test_zero_rows_and_zero_blocks_give_the_bias() -> None:
    linear = _linear(Q.Q4_K)
    x = torch.zeros(2, linear.in_features)
    x[1, :256] = torch.randn(256, generator=torch.Generator().manual_seed(6))  # second block zero
    y = linear(x)
    assert torch.equal(y[0], linear.bias)
    _assert_is_llama_cpps_function(linear, x, y)
    assert linear(x[:0]).shape == (0, linear.out_features)


@needs_kernel
def test_the_mode_is_q8_where_it_runs_and_says_so() -> None:
    assert _linear(Q.Q6_K).fidelity == "as stored, activations Q8_K like llama.cpp"
    assert _linear(Q.Q5_0).fidelity == "as stored, activations Q8_0 like llama.cpp"
    assert _linear(Q.Q5_1).fidelity == "as stored, activations Q8_1 like llama.cpp"
    floats = GGUFLinear(Q.F16, np.zeros(2 * 64, dtype=np.uint8), 64, 1)
    assert (floats.activations, floats.fidelity) == (F32, "as stored, fp32 activations")
    f32 = _linear(Q.Q4_K, activations=F32)
    assert (f32.activations, f32.fidelity) == (F32, "as stored, fp32 activations")
    assert "activations=f32" in repr(f32)
    x = torch.randn(3, f32.in_features, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(f32(x), _linear(Q.Q4_K)(x))  # a different function: unquantized rows


def test_q8_that_cannot_run_is_refused_in_one_line(monkeypatch) -> None:
    with pytest.raises(ValueError, match="F16 weights are floats"):
        GGUFLinear(Q.F16, np.zeros(2 * 64, dtype=np.uint8), 64, 1, activations=Q8)
    with pytest.raises(ValueError, match="must be 'q8', 'f32' or 'i8', not 'int8'"):
        _linear(Q.Q4_K, activations="int8")
    monkeypatch.setattr(native, "unavailable", lambda: "no C compiler (cc, gcc)")
    assert _linear(Q.Q4_K).activations == F32  # the fallback: fp32 rows, labelled so
    with pytest.raises(ValueError, match="Q8 activations cannot run here: no C compiler"):
        _linear(Q.Q4_K, activations=Q8)
