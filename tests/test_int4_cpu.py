"""The 4-bit CPU kernel: right numbers, the same numbers for any batch or thread count."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from tiny import tiny_model
from transformers import DynamicCache

from specdec_core.errors import ModelLoadError
from specdec_core.kernels.batch_invariant import make_batch_invariant
from specdec_core.kernels.cpu import int4_cpu, native
from specdec_core.kernels.cpu.fused_int8 import FusedGateUpMLP, fuse_int8_projections, fuse_rows
from specdec_core.kernels.cpu.int4_cpu import GROUP, Int4Linear, quantize_linears_int4
from specdec_core.kernels.cpu.quant_cpu import PerTokenInt8Linear
from specdec_core.models.loading import resolve_precision

needs_kernel = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))


def _linear(out_features: int, in_features: int, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features)
    linear.weight.data *= 5  # wider than the default init: groups with real ranges
    return linear


@pytest.mark.parametrize("bits", [4, 6])
def test_packing_then_unpacking_gives_back_every_value(bits: int) -> None:
    out_features, in_features = 40, 96  # 40: a block of 16 channels is only half full
    generator = torch.Generator().manual_seed(1)
    q = torch.randint(0, 2**bits, (out_features, in_features), dtype=torch.uint8, generator=generator)
    scale = torch.rand(out_features, in_features // GROUP, generator=generator).half()
    minimum = (-torch.rand(out_features, in_features // GROUP, generator=generator)).half()
    packed = int4_cpu.pack(q, scale, minimum, bits)
    assert packed.shape[-1] == int4_cpu.block_bytes(bits)
    unpacked = int4_cpu.unpack(packed, out_features)
    for got, want in zip(unpacked, (q, scale, minimum), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("bits", [4, 6])
def test_quantized_weights_are_within_half_a_step_of_the_originals(bits: int) -> None:
    weight = _linear(48, 128).weight.detach()
    q, scale, minimum = int4_cpu.quantize(weight, bits)
    assert int(q.max()) == 2**bits - 1
    error = (int4_cpu.dequantize(q, scale, minimum) - weight).abs().reshape(48, -1, GROUP).amax(-1)
    # Half a step, plus what rounding the minimum to fp16 moves it by.
    assert bool((error <= 0.5 * scale.float() + minimum.float().abs() * 2**-10 + 1e-7).all())


def test_a_group_of_equal_weights_is_kept_exactly() -> None:
    weight = torch.full((16, 32), 0.25)
    assert torch.equal(int4_cpu.dequantize(*int4_cpu.quantize(weight)), weight)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6])
def test_the_kernel_multiplies_int8_activations_by_the_low_bit_weights(bits: int) -> None:
    linear = Int4Linear.from_linear(_linear(40, 96), bits)
    assert linear.bits == bits
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2))
    # The kernel's arithmetic in float64: per group of 32, x ~ a * xq with xq in -127..127.
    groups = x.reshape(5, -1, GROUP)
    a = groups.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(groups / a)
    q, scale, minimum = int4_cpu.unpack(linear.packed, 40)
    w = q.double().reshape(40, -1, GROUP)
    dots = torch.einsum("rgi,cgi->rcg", xq.double(), w)
    per_group = scale.double()[None] * dots + minimum.double()[None] * xq.double().sum(-1)[:, None, :]
    expected = (per_group * a.double().squeeze(-1)[:, None, :]).sum(-1) + linear.bias.double()
    assert torch.allclose(linear(x).double(), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_activations_are_quantized_to_x_over_a_rounded_half_to_even_with_a_the_max_over_127() -> None:
    rows, k = 6, 4 * GROUP
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5)) * 3
    x[1, :GROUP] = 0.0  # a group of zeros: scale 0, values 0
    x[2, :GROUP] = torch.arange(-16, 16) + 0.5  # with a = 1, halves: rounding to even decides
    x[2, GROUP - 1] = 127.0
    x[3, 7] = float("nan")  # left out of the group's maximum
    q = torch.empty(rows, k, dtype=torch.int8)
    scale, scaled_sum = torch.empty(rows, k // GROUP), torch.empty(rows, k // GROUP)
    native.library().int4_quantize_rows(
        x.data_ptr(), rows, k, q.data_ptr(), scale.data_ptr(), scaled_sum.data_ptr()
    )  # fmt: skip
    groups = x.reshape(rows, -1, GROUP)
    a = groups.abs().nan_to_num(0.0).amax(-1) / 127  # fp32, as the kernel divides
    steps = torch.where(a[..., None] > 0, torch.round(groups / a[..., None]), 0.0)
    expected = steps.nan_to_num(0.0).to(torch.int32).to(torch.int8).reshape(rows, k)
    known = ~torch.isnan(x)
    assert torch.equal(q[known], expected[known])
    assert torch.equal(scale, a)
    rows_ok = [r for r in range(rows) if r != 3]  # the NaN's group sum is undefined
    sums = steps.sum(-1)[rows_ok]
    assert torch.equal(scaled_sum[rows_ok], a[rows_ok] * sums)
    assert torch.equal(q[1, :GROUP], torch.zeros(GROUP, dtype=torch.int8)) and scale[1, 0] == 0


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6])
def test_a_row_gets_the_same_numbers_in_any_batch_and_at_any_thread_count(bits: int) -> None:
    linear = Int4Linear.from_linear(_linear(72, 160, seed=3), bits)
    x = torch.randn(19, 160, generator=torch.Generator().manual_seed(4))  # 19: two tiles of 8 and a rest
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        reference = linear(x)
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (1, 2, 3, 7, 8, 9, 16, 19):
                for start in (0, 19 - rows):
                    got = linear(x[start : start + rows])
                    assert torch.equal(got, reference[start : start + rows]), (count, rows, start)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_stacked_linears_compute_their_parts_side_by_side_exactly() -> None:
    parts = [Int4Linear.from_linear(_linear(n, 64, seed=n)) for n in (32, 16, 48)]
    parts[1].bias = None  # a part without a bias adds zeros
    stacked = fuse_rows(parts)
    x = torch.randn(6, 64)
    assert torch.equal(stacked(x), torch.cat([p(x) for p in parts], dim=-1))


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6])
@pytest.mark.parametrize("out_features", [40, 64])
def test_packing_in_c_gives_the_bytes_of_quantize_then_pack(bits: int, out_features: int) -> None:
    generator = torch.Generator().manual_seed(bits + out_features)
    weight = torch.randn(out_features, 128, generator=generator) * torch.logspace(-6, 3, 128)  # many scales
    weight[0, :32] = 0.37  # a constant group: step 0
    weight[1, 32:64] = torch.linspace(-1e-7, 1e-7, 32)  # steps in fp16's subnormals
    weight[2, 64:96] = (torch.rand(32, generator=generator) * 2 - 1) * 3.27e4  # near the limit packing allows
    weight[3] = -weight[3].abs()  # all negative
    expected = int4_cpu.pack(*int4_cpu.quantize(weight, bits), bits=bits)
    assert torch.equal(int4_cpu.pack_weight(weight, bits), expected)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6])
def test_unpacking_in_c_gives_the_values_of_unpack_then_dequantize(bits: int) -> None:
    linear = Int4Linear.from_linear(_linear(40, 96, seed=bits), bits)  # 40: the last block half full
    expected = int4_cpu.dequantize(*int4_cpu.unpack(linear.packed, 40))
    assert torch.equal(linear.dense_weight(), expected)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 6])
def test_weights_fp16_cannot_scale_are_refused_by_packing_and_stay_int8(bits: int) -> None:
    linear = _linear(40, 64)
    int4_cpu.pack_weight(linear.weight, bits)
    for row, bad in enumerate((float("nan"), float("inf"), -float("inf"), 40000.0, -40000.0)):
        broken = copy.deepcopy(linear)
        broken.weight.data[3 + 8 * row, 5 + 11 * row] = bad  # in different blocks and groups
        with pytest.raises(int4_cpu.WeightsDoNotFit):
            int4_cpu.pack_weight(broken.weight, bits)
        model = torch.nn.Sequential(broken, copy.deepcopy(linear))
        assert int4_cpu.quantize_linears_int4(model) == 1
        assert isinstance(model[0], PerTokenInt8Linear) and isinstance(model[1], Int4Linear)
    near_limit = copy.deepcopy(linear)
    near_limit.weight.data[0, 0] = 32751.0  # just inside: packs
    int4_cpu.pack_weight(near_limit.weight, bits)


@needs_kernel
def test_stacking_whole_blocks_gives_the_bytes_of_packing_the_rows_together() -> None:
    parts = [Int4Linear.from_linear(_linear(n, 64, seed=n)) for n in (32, 16, 40)]
    stacked = Int4Linear.stack(parts, None)
    weights = torch.cat([_linear(n, 64, seed=n).weight for n in (32, 16, 40)])
    assert torch.equal(stacked.packed, int4_cpu.pack_weight(weights))
    ragged = Int4Linear.stack([parts[2], parts[0]], None)  # 40 rows first: repacked
    assert torch.equal(ragged.packed, int4_cpu.pack_weight(torch.cat([weights[48:], weights[:32]])))


@needs_kernel
def test_the_head_takes_6_bits_and_linears_without_whole_groups_stay_int8(tokenizer) -> None:
    model = tiny_model(len(tokenizer), hidden=64)
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(40, 64)  # 40 inputs: not whole groups of 32
    four_bit = quantize_linears_int4(model)
    assert isinstance(model.lm_head, Int4Linear) and model.lm_head.bits == 6
    assert isinstance(model.model.layers[0].mlp.down_proj, PerTokenInt8Linear)
    assert isinstance(model.model.layers[0].mlp.gate_proj, Int4Linear)
    assert four_bit == 2 * 7 - 1  # q, k, v, o, gate, up, down in 2 layers, less the odd one


@torch.inference_mode()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """A 20-token prefill, a 5-token verify, then 3 one-token steps."""
    cache = DynamicCache(config=model.config)
    bounds = [0, 20, 25, 26, 27, 28]
    return torch.cat([model(ids[:, s:e], cache=cache).logits[0] for s, e in itertools.pairwise(bounds)])


@needs_kernel
def test_fused_4_bit_projections_give_bitwise_the_logits_of_separate_ones(tokenizer) -> None:
    separate = copy.deepcopy(tiny_model(len(tokenizer), seed=0, layers=2, hidden=128))
    quantize_linears_int4(separate)
    make_batch_invariant(separate)
    fused = copy.deepcopy(separate)
    assert fuse_int8_projections(fused) == 4
    assert isinstance(fused.model.layers[0].mlp, FusedGateUpMLP)
    ids = torch.randint(0, len(tokenizer), (1, 28), generator=torch.Generator().manual_seed(3))
    reference = _logits(separate, ids)
    assert torch.equal(reference, _logits(fused, ids))
    # One prefill of all 28 tokens gives each position the numbers of the split run.
    assert torch.equal(reference, _logits_one_piece(fused, ids))


@torch.inference_mode()
def _logits_one_piece(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, cache=DynamicCache(config=model.config)).logits[0]


def test_int4_on_a_gpu_is_refused_in_one_line() -> None:
    with pytest.raises(ModelLoadError, match="CPU precision"):
        resolve_precision("int4", "cuda", 10**9)


@pytest.mark.parametrize(("build", "auto"), [("avx512-vnni", "int4"), ("avx2", "int4"), ("scalar", "not int4")])
def test_auto_takes_int4_only_where_the_kernel_has_vectors(monkeypatch, build, auto) -> None:
    monkeypatch.setattr(native, "unavailable", lambda: None)
    monkeypatch.setattr(native, "isa", lambda: build)
    chosen = resolve_precision("auto", "cpu", 10**9)
    assert chosen == auto if auto == "int4" else chosen in ("int8", "bf16")  # int8 where torch has it
    assert resolve_precision("int4", "cpu", 10**9) == "int4"  # asked for, the plain-C build runs it


@needs_kernel
def test_a_drafts_head_takes_4_bits_and_still_ranks_tokens_like_the_6_bit_head(tokenizer) -> None:
    model = tiny_model(len(tokenizer), hidden=64)
    quantize_linears_int4(model)
    ids = torch.randint(0, len(tokenizer), (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        before = model(ids).logits
        assert int4_cpu.head_to_int4(model)
        after = model(ids).logits
    assert isinstance(model.lm_head, Int4Linear) and model.lm_head.bits == 4
    assert not int4_cpu.head_to_int4(model)  # already 4-bit: nothing to do
    # 4 bits move the logits a little; the ranking of clear winners stays.
    assert (before.argmax(-1) == after.argmax(-1)).float().mean() >= 0.9
