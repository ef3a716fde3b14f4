"""Q4_K, Q6_K and the 32-weight types repacked for our int4 kernel (GGUFLinear's "i8" mode: gguf_cpu.c's
gguf_repack into K4/K6, gguf_plain.py into the int4 path's layouts 4 and 6): the file's weights exactly (the gguf package's dequantized
matrix) times rows quantized to int8 per 32 inputs, up to the order of the float sums; bitwise
the same for a row in any batch, at any thread count, in any build."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from rowwise import assert_rows_bitwise_the_same

from specdec_core.kernels.cpu import features, huge_pages, native
from specdec_core.kernels.cpu.gguf_blocks import I8, REPACKED_BITS, GGUFLinear
from specdec_core.kernels.cpu.huge_pages import HUGE_PAGE, place_in_huge_pages
from specdec_core.kernels.cpu.int4_cpu import K_SCALES, unpack
from tests.test_gguf_blocks import _stored_blocks
from tests.test_gguf_int import _integer_weights

needs_kernel = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))

Q = GGMLQuantizationType
REPACKED = tuple(REPACKED_BITS)


def _linear(qtype: GGMLQuantizationType, out_features: int = 37, seed: int = 0, bias: bool = True) -> GGUFLinear:
    """37 outputs: a block of 16 channels only partly filled; 512 inputs: two K-quant blocks."""
    generator = torch.Generator().manual_seed(seed)
    return GGUFLinear(
        qtype, _stored_blocks(qtype, out_features, 512, seed), 512, out_features,
        torch.randn(out_features, generator=generator) if bias else None, activations=I8,
    )  # fmt: skip


def _int8_rows(x: np.ndarray) -> np.ndarray:
    """int4_cpu.c's activation rounding, written out: per 32 inputs a = max |x| / 127 in fp32,
    q = x / a rounded half to even; the rows as a * q, in float64."""
    groups = x.astype(np.float32).reshape(len(x), -1, 32)
    a = (np.abs(groups).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(a > 0, np.rint((groups / a).astype(np.float32)), 0)
    return (q.astype(np.float64) * a.astype(np.float64)).reshape(x.shape)


def _term_magnitudes(linear: GGUFLinear) -> np.ndarray:
    """|each term the kernel sums| per weight: |scale * q| + |minimum| for Q4_K and the 32-weight
    types (the two are summed apart), |w| for Q6_K (its q - 32 is formed exactly before any rounding)."""
    stored = linear.blocks.reshape(linear.out_features, -1)
    int4 = linear.as_int4()
    if int4 is not None and not int4.bits & K_SCALES:
        q, scale, minimum = (t.double().numpy() for t in unpack(int4.packed, linear.out_features))
        return np.abs(np.repeat(scale, 32, -1) * q) + np.repeat(np.abs(minimum), 32, -1)
    if linear.qtype == Q.Q6_K:
        return np.abs(gguf_quants.dequantize(stored, linear.qtype).astype(np.float64))
    w = _integer_weights(linear.qtype, stored)
    scale = np.repeat(np.abs(w["d"][..., None] * w["sc"]), 32, -1)
    minimum = np.repeat(np.abs(w["dmin"][..., None] * w["mins"]), 32, -1)
    return (scale * w["q"] + minimum).reshape(linear.out_features, -1)


def _assert_is_the_files_matrix_times_int8_rows(linear: GGUFLinear, x: torch.Tensor, y: torch.Tensor) -> None:
    weight = gguf_quants.dequantize(linear.blocks.reshape(linear.out_features, -1), linear.qtype)
    rows = _int8_rows(x.numpy())
    bias = np.zeros(linear.out_features) if linear.bias is None else linear.bias.double().numpy()
    want = rows @ weight.astype(np.float64).T + bias
    scale = np.abs(rows) @ _term_magnitudes(linear).T + np.abs(bias)
    roundings = 4 * (linear.in_features // 32 + 4)  # a few per group's terms, then the bias, with room
    assert np.all(np.abs(y.double().numpy() - want) <= roundings * 2.0**-24 * scale)


@needs_kernel
@pytest.mark.parametrize("qtype", REPACKED, ids=lambda qtype: qtype.name)
def test_the_repacked_kernel_multiplies_the_files_weights_by_int8_rows(qtype: GGMLQuantizationType) -> None:
    linear = _linear(qtype)
    x = torch.randn(9, linear.in_features, generator=torch.Generator().manual_seed(1))
    x[0, :32] = torch.tensor([127.0, -2.5, 0.5, 1.5] * 8)  # exact halves: rounded to even
    x[1, 32:64] = 0.0  # a group of zeros
    _assert_is_the_files_matrix_times_int8_rows(linear, x, linear(x))


@needs_kernel
@pytest.mark.parametrize("qtype", REPACKED, ids=lambda qtype: qtype.name)
def test_every_row_count_of_a_tile_and_no_bias_compute_the_same_function(qtype: GGMLQuantizationType) -> None:
    linear = _linear(qtype, out_features=70, seed=3, bias=False)
    x = torch.randn(17, linear.in_features, generator=torch.Generator().manual_seed(4))
    for rows in range(1, 10):  # each of the kernel's tile sizes, and a full tile and one more
        _assert_is_the_files_matrix_times_int8_rows(linear, x[:rows], linear(x[:rows]))


@needs_kernel
@pytest.mark.parametrize("qtype", REPACKED, ids=lambda qtype: qtype.name)
def test_a_repacked_rows_result_is_bitwise_the_same_in_any_batch_and_at_any_thread_count(
    qtype: GGMLQuantizationType,
) -> None:
    linear = _linear(qtype)
    x = torch.randn(40, linear.in_features, generator=torch.Generator().manual_seed(2))  # past a 64-row piece
    assert_rows_bitwise_the_same(linear, x)


@needs_kernel
def test_every_build_this_cpu_runs_computes_the_same_repacked_bits(monkeypatch, tmp_path) -> None:
    builds = [isa.name for isa in features.runnable()]
    if len(builds) < 2:
        pytest.skip(f"this CPU runs only the {builds[0]} build")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(3))
    outputs = []
    for name in builds:
        monkeypatch.setenv(features.ISA_ENV, name)
        native._load.cache_clear()
        linears = [_linear(qtype) for qtype in REPACKED]  # repacked by this build too
        outputs.append([linear(x[:rows]) for linear in linears for rows in (1, 11)])
    native._load.cache_clear()
    for name, other in zip(builds[1:], outputs[1:], strict=True):
        for i, (first, this) in enumerate(zip(outputs[0], other, strict=True)):
            assert torch.equal(first, this), (builds[0], name, i)


@needs_kernel
def test_the_repacked_mode_says_what_it_does_and_keeps_the_files_blocks() -> None:
    linear = _linear(Q.Q4_K)
    assert linear.fidelity == "as stored, activations int8 per 32 inputs (finer than llama.cpp's Q8_K)"
    assert "activations=i8" in repr(linear)
    stored = _stored_blocks(Q.Q4_K, 37, 512, 0).reshape(-1)
    assert np.array_equal(linear.blocks, stored)  # the file's bytes, read and left as they were
    assert np.array_equal(
        linear.dense_weight().numpy(), gguf_quants.dequantize(stored.reshape(37, -1), Q.Q4_K)
    )


def test_the_repacked_mode_elsewhere_is_refused_in_one_line(monkeypatch) -> None:
    with pytest.raises(ValueError, match="cannot run on Q5_K here: only Q4_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 repack"):
        GGUFLinear(Q.Q5_K, _stored_blocks(Q.Q5_K, 2, 256), 256, 2, activations=I8)
    monkeypatch.setattr(native, "unavailable", lambda: "no C compiler (cc, gcc)")
    with pytest.raises(ValueError, match="cannot run on Q4_K here: no C compiler"):
        _linear(Q.Q4_K)


@needs_kernel
def test_a_copy_of_a_repacked_linear_computes_the_same_bits() -> None:
    import copy

    linear = _linear(Q.Q6_K)
    x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(5))
    twin = copy.deepcopy(linear)
    assert twin.packed is not None and twin.packed.ctypes.data != linear.packed.ctypes.data
    del linear
    assert torch.equal(twin(x), _linear(Q.Q6_K)(x))


@needs_kernel
@pytest.mark.parametrize("qtype", REPACKED, ids=lambda qtype: qtype.name)
def test_a_repacked_linear_shared_with_the_helpers_gives_bitwise_its_one_thread_numbers(
    qtype: GGMLQuantizationType,
) -> None:
    linear = _linear(qtype, out_features=1100, seed=6)  # more blocks of 16 than an op has chunks (64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for rows in (1, 5, 9):
            x = torch.randn(rows, linear.in_features, generator=torch.Generator().manual_seed(rows))
            native.share_spare_core(False)
            alone = linear(x)
            native.share_spare_core(True)
            for _ in range(5):
                assert torch.equal(linear(x), alone), rows
    finally:
        native.share_spare_core(False)
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.skipif(not huge_pages.available(), reason="this OS has no madvise(MADV_HUGEPAGE)")
@pytest.mark.parametrize("qtype", REPACKED)
def test_repacked_weights_moved_into_huge_pages_give_bitwise_the_same_rows(qtype: GGMLQuantizationType) -> None:
    linears = [_linear(qtype, seed=seed) for seed in (0, 1)]
    x = torch.randn(5, linears[0].in_features, generator=torch.Generator().manual_seed(2))
    before = [linear(x) for linear in linears]
    moved = place_in_huge_pages(linears)
    starts = [linear.packed.ctypes.data for linear in linears]
    assert moved > 0 and starts[0] % HUGE_PAGE == 0 and all(isinstance(m.packed, np.ndarray) for m in linears)
    assert all(torch.equal(linear(x), y) for linear, y in zip(linears, before, strict=True))


@needs_kernel
@pytest.mark.parametrize("qtype", REPACKED)
def test_as_int4_is_the_same_linear_with_the_files_weights(qtype: GGMLQuantizationType) -> None:
    linear = _linear(qtype, out_features=48)
    int4 = linear.as_int4()
    assert int4 is not None and int4.bits == REPACKED_BITS[qtype]
    x = torch.randn(7, linear.in_features, generator=torch.Generator().manual_seed(5))
    assert torch.equal(int4(x), linear(x))
    stored = _stored_blocks(qtype, 48, 512, 0).reshape(48, -1)
    assert np.array_equal(int4.dense_weight().numpy(), gguf_quants.dequantize(stored, qtype))


@needs_kernel
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_0], ids=lambda qtype: qtype.name)
def test_a_scale_whose_minimum_fp16_cannot_hold_keeps_the_blocks_own_kernel(qtype: GGMLQuantizationType) -> None:
    blocks = _stored_blocks(qtype, 16, 512, 0).reshape(16, -1).copy()
    blocks[3, 0:2] = np.array([60000.0], dtype=np.float16).view(np.uint8)  # d * -8 overflows fp16
    linear = GGUFLinear(qtype, blocks.reshape(-1), 512, 16, activations=I8)
    assert linear.activations == "f32" and linear.packed is None and linear.as_int4() is None
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(1))
    weight = gguf_quants.dequantize(blocks, qtype)
    assert torch.allclose(linear(x).double(), x.double() @ torch.from_numpy(weight).double().T, rtol=1e-4, atol=1e-2)
