"""GGUF weights as stored (gguf_blocks, gguf_cpu.c) times fp32 rows ("f32" activations; the
repacked "i8" mode is tests/test_gguf_repacked.py's): the gguf package's values exactly, its matrix times x
up to summation order, the same bits for a row whatever the batch, thread count
or build, a labelled fallback without the kernels, and a one-line refusal of other types."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf import quants as gguf_quants
from rowwise import assert_rows_bitwise_the_same

from specdec_core.kernels.cpu import features, gguf_blocks, native
from specdec_core.kernels.cpu.gguf_blocks import F32, FALLBACK, NATIVE, GGUFLinear, UnsupportedBlockType

needs_kernel = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))

Q = GGMLQuantizationType
# Where each type keeps its fp16 scales in a block (byte offsets): set to sane values in random blocks.
_SCALE_OFFSETS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}  # fmt: skip
# The gguf package quantizes these itself; the K-quants are random bytes with sane scales.
_QUANTIZED_BY_GGUF = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}


def _inputs_for(qtype: GGMLQuantizationType) -> int:
    """More than one span of 256 inputs, and for the float types a tail of fewer than 16."""
    weights = GGML_QUANT_SIZES[qtype][0]
    return 300 if weights == 1 else 288 if weights == 32 else 512


def _stored_blocks(
    qtype: GGMLQuantizationType, out_features: int, in_features: int, seed: int = 0
) -> np.ndarray:
    """[out_features, row bytes] uint8 as a GGUF stores the tensor."""
    rng = np.random.default_rng(seed)
    if qtype in _QUANTIZED_BY_GGUF:
        weight = rng.standard_normal((out_features, in_features)).astype(np.float32)
        return (
            np.ascontiguousarray(gguf_quants.quantize(weight, qtype)).view(np.uint8).reshape(out_features, -1)
        )
    weights, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (out_features * in_features // weights, size), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[qtype]:
        scales = (rng.standard_normal(len(raw)) * 0.05).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(out_features, -1)


def _linear(
    qtype: GGMLQuantizationType, out_features: int = 37, bias: bool = True, seed: int = 0
) -> GGUFLinear:
    """37 outputs: not a whole number of the kernel's column tiles; fp32 rows."""
    in_features = _inputs_for(qtype)
    generator = torch.Generator().manual_seed(seed)
    return GGUFLinear(
        qtype, _stored_blocks(qtype, out_features, in_features, seed), in_features, out_features,
        torch.randn(out_features, generator=generator) if bias else None, activations=F32,
    )  # fmt: skip


def _reference_weight(linear: GGUFLinear) -> np.ndarray:
    return np.asarray(gguf_quants.dequantize(linear.blocks.reshape(linear.out_features, -1), linear.qtype))


def _assert_matches_reference(linear: GGUFLinear, x: torch.Tensor, y: torch.Tensor) -> None:
    """y within fp32 summation-order error of the gguf package's matrix times x, in float64."""
    weight = torch.from_numpy(_reference_weight(linear).astype(np.float64))
    bias = (
        linear.bias.double()
        if linear.bias is not None
        else torch.zeros(linear.out_features, dtype=torch.float64)
    )
    want = x.double() @ weight.T + bias
    scale = x.double().abs() @ weight.abs().T + bias.abs()
    additions = linear.in_features // 16 + 6  # one lane's chain, the reduction tree, the bias
    assert torch.all((y.double() - want).abs() <= 2 * additions * 2.0**-24 * scale)


@needs_kernel
@pytest.mark.parametrize("qtype", gguf_blocks.SUPPORTED, ids=lambda qtype: qtype.name)
def test_each_block_type_decodes_to_the_gguf_packages_values_bit_for_bit(qtype: GGMLQuantizationType) -> None:
    linear = _linear(qtype)
    assert linear.path == NATIVE
    got = linear.dense_weight().numpy()
    assert np.array_equal(got.view(np.uint32), _reference_weight(linear).astype(np.float32).view(np.uint32))


@needs_kernel
@pytest.mark.parametrize("qtype", gguf_blocks.SUPPORTED, ids=lambda qtype: qtype.name)
def test_each_block_type_multiplies_as_the_dequantized_matrix(qtype: GGMLQuantizationType) -> None:
    linear = _linear(qtype)
    x = torch.randn(5, linear.in_features, generator=torch.Generator().manual_seed(1))
    _assert_matches_reference(linear, x, linear(x))


@needs_kernel
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0, Q.F32], ids=lambda qtype: qtype.name)
def test_a_rows_result_is_bitwise_the_same_in_any_batch_and_at_any_thread_count(
    qtype: GGMLQuantizationType,
) -> None:
    linear = _linear(qtype)
    x = torch.randn(40, linear.in_features, generator=torch.Generator().manual_seed(2))  # past 32 rows too
    assert_rows_bitwise_the_same(linear, x)


@needs_kernel
def test_every_build_this_cpu_runs_computes_the_same_bits(monkeypatch, tmp_path) -> None:
    builds = [isa.name for isa in features.runnable()]
    if len(builds) < 2:
        pytest.skip(f"this CPU runs only the {builds[0]} build")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    linears = [_linear(qtype) for qtype in gguf_blocks.SUPPORTED]
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
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
def test_any_leading_shape_is_multiplied_row_by_row() -> None:
    linear = _linear(Q.Q4_K, bias=False)
    x = torch.randn(2, 3, linear.in_features, generator=torch.Generator().manual_seed(4))
    y = linear(x)
    assert y.shape == (2, 3, linear.out_features)
    assert torch.equal(y.reshape(6, -1), linear(x.reshape(6, -1)))


def test_without_the_kernels_the_fallback_runs_the_same_weights_and_says_so(monkeypatch) -> None:
    monkeypatch.setattr(native, "unavailable", lambda: "no C compiler (cc, gcc)")
    linear = _linear(Q.Q6_K)
    assert (linear.path, linear.fallback_reason) == (FALLBACK, "no C compiler (cc, gcc)")
    assert "path=fallback" in repr(linear)
    assert np.array_equal(linear.dense_weight().numpy(), _reference_weight(linear))
    x = torch.randn(7, linear.in_features, generator=torch.Generator().manual_seed(5))
    y = linear(x)
    _assert_matches_reference(linear, x, y)
    assert torch.equal(linear(x[:1]), y[:1])  # a row at a time: the same bits alone


@pytest.mark.parametrize("named", ["IQ2_XS", Q.IQ2_XS, int(Q.IQ2_XS), Q.Q3_K, "NOT_A_TYPE", 999])
def test_a_block_type_not_run_here_is_refused_in_one_line_naming_it(named) -> None:
    with pytest.raises(UnsupportedBlockType) as refused:
        gguf_blocks.block_type(named)
    message = str(refused.value)
    name = (
        named.name
        if isinstance(named, Q)
        else Q(named).name
        if isinstance(named, int) and named in set(Q)
        else str(named)
    )
    assert name in message and "Q4_K" in message and "\n" not in message
    with pytest.raises(UnsupportedBlockType):
        GGUFLinear(named, np.zeros(64, dtype=np.uint8), 256, 1)


def test_the_supported_types_are_named_and_taken_by_name_or_number() -> None:
    assert set(gguf_blocks.supported_names()) == {
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"
    }  # fmt: skip
    assert gguf_blocks.block_type("Q6_K") is Q.Q6_K
    assert gguf_blocks.block_type(12) is Q.Q4_K


@needs_kernel
def test_the_kernels_block_sizes_are_the_gguf_packages() -> None:
    import ctypes

    for qtype in Q:
        weights = ctypes.c_int64(0)
        size = gguf_blocks.kernel().gguf_block_bytes(int(qtype), ctypes.byref(weights))
        if qtype in gguf_blocks.SUPPORTED:
            assert (weights.value, size) == GGML_QUANT_SIZES[qtype], qtype.name
        else:
            assert size == 0, qtype.name


def test_blocks_of_the_wrong_size_or_kind_are_refused_in_one_line() -> None:
    blocks = _stored_blocks(Q.Q4_K, 4, 512)
    with pytest.raises(ValueError, match="is 1152 bytes, not 1008"):
        GGUFLinear(Q.Q4_K, blocks.reshape(-1)[:-144], 512, 4)
    with pytest.raises(ValueError, match="not whole Q4_K blocks of 256"):
        GGUFLinear(Q.Q4_K, blocks, 500, 4)
    with pytest.raises(ValueError, match="uint8 bytes, not int8"):
        GGUFLinear(Q.Q4_K, blocks.view(np.int8), 512, 4)
    with pytest.raises(ValueError, match="one contiguous run"):
        GGUFLinear(Q.Q4_K, blocks[:, ::2], 256, 4)


def test_a_tensor_read_from_a_gguf_file_runs_from_the_mapped_file_uncopied(tmp_path) -> None:
    blocks = _stored_blocks(Q.Q4_K, 8, 512)
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_up.weight", blocks, raw_dtype=Q.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = GGUFReader(path).tensors[0]
    linear = GGUFLinear(tensor.tensor_type, tensor.data, 512, 8)
    assert isinstance(linear.blocks.base, np.memmap) or isinstance(linear.blocks, np.memmap)
    assert np.shares_memory(linear.blocks, tensor.data)
    assert np.array_equal(linear.blocks.reshape(8, -1), blocks)


@pytest.mark.parametrize("out_features", [37, 300])
def test_without_the_kernels_a_rows_result_is_the_same_in_any_batch_and_at_any_thread_count(
    monkeypatch, out_features
) -> None:
    """The fallback keeps exactness: torch's 1-row product (a gemv) sums differently at 1 and
    2 threads for some shapes (300 x 32 here), so rows go through one fixed-rows matmul."""
    monkeypatch.setattr(native, "unavailable", lambda: "no C compiler (cc, gcc)")
    linear = GGUFLinear(Q.Q8_0, _stored_blocks(Q.Q8_0, out_features, 32), 32, out_features)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(6))
    assert_rows_bitwise_the_same(linear, x)


def test_the_fallback_keeps_its_weights_only_where_memory_allows(monkeypatch) -> None:
    monkeypatch.setattr(native, "unavailable", lambda: "no C compiler (cc, gcc)")
    x = torch.randn(5, 288, generator=torch.Generator().manual_seed(7))
    monkeypatch.setattr(gguf_blocks, "_room_for", lambda nbytes: False)
    tight = _linear(Q.Q8_0)
    y = tight(x)
    assert tight._dense is None  # de-quantized again at every call
    monkeypatch.setattr(gguf_blocks, "_room_for", lambda nbytes: True)
    roomy = _linear(Q.Q8_0)
    assert torch.equal(roomy(x), y) and roomy._dense is not None
    assert torch.equal(roomy(x), y)  # from the kept weights: the same numbers


def test_rows_stay_fp32_unless_repacked_and_llama_cpps_q8_rounding_is_not_offered() -> None:
    """The file's weights and no other rounding: llama.cpp's Q8 activations are not a mode here."""
    blocks = _stored_blocks(Q.Q8_0, 37, 288)
    assert GGUFLinear(Q.Q8_0, blocks, 288, 37).activations == F32
    with pytest.raises(ValueError, match="activations must be 'f32' or 'i8', not 'q8'"):
        GGUFLinear(Q.Q8_0, blocks, 288, 37, activations="q8")
