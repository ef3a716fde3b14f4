"""The C kernels: built once and loaded, one-line refusals when they cannot be, and
row-wise attention that gives a row the same numbers in any batch."""

from __future__ import annotations

import ctypes

import pytest
import torch

from specdec_core import attention_cpu, int4_cpu, native
from specdec_core.batch_invariant import rowwise_attention
from specdec_core.native import KernelUnavailable

needs_kernel = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))
AVX2 = ("-mavx2",)
AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vnni")


def _attention_inputs(heads: int, kv_heads: int, dim: int, keys: int, rows: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, heads, rows, dim, generator=generator)
    key, value = (torch.randn(1, kv_heads, keys, dim, generator=generator) for _ in range(2))
    return query, key, value


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "keys", "rows", "scaling", "window"),
    [
        (12, 2, 128, 300, 9, None, None),  # grouped heads, a verify after a long cache
        (4, 4, 64, 40, 40, 0.3, None),  # a whole prefill, its own scaling
        (8, 2, 96, 50, 7, None, 16),  # a sliding window shorter than the cache
        (2, 1, 256, 5, 5, None, None),
    ],
)
def test_native_attention_computes_what_sdpa_computes_row_by_row(
    monkeypatch, heads, kv_heads, dim, keys, rows, scaling, window
):
    query, key, value = _attention_inputs(heads, kv_heads, dim, keys, rows)
    out = attention_cpu.attend(query, key, value, scaling, window)
    monkeypatch.setattr(attention_cpu, "attend", lambda *args: None)  # row-wise attention's SDPA path
    expected, _ = rowwise_attention(None, query, key, value, None, scaling=scaling, sliding_window=window)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("window", [32, None])  # without a window, rows share blocks of keys
def test_a_rows_attention_is_bitwise_the_same_alone_in_a_batch_and_at_any_thread_count(window):
    query, key, value = _attention_inputs(6, 2, 64, 120, 17)
    threads = torch.get_num_threads()
    try:
        by_threads = []
        for count in (1, 2, 3, 8):  # 8: a head group split over threads
            torch.set_num_threads(count)
            by_threads.append(attention_cpu.attend(query, key, value, None, window))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(by_threads[0], other) for other in by_threads[1:])
    for rows in (1, 4, 9, 16):  # the last `rows` tokens as a verify over the same keys
        part = attention_cpu.attend(query[:, :, -rows:], key, value, None, window)
        assert torch.equal(part, by_threads[0][:, -rows:])


def test_attention_the_kernel_does_not_cover_is_left_to_sdpa(monkeypatch):
    query, key, value = _attention_inputs(4, 2, 72, 10, 2)
    assert attention_cpu.attend(query, key, value, None, None) is None  # head size not a multiple of 16
    query, key, value = _attention_inputs(4, 2, 64, 10, 2)
    assert attention_cpu.attend(query.bfloat16(), key.bfloat16(), value.bfloat16(), None, None) is None
    monkeypatch.setattr(native, "unavailable", lambda: "no compiler")
    assert attention_cpu.attend(query, key, value, None, None) is None


def test_no_compiler_is_a_one_line_refusal(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(KernelUnavailable, match="could not be built") as caught:
        native._build(AVX2)
    assert "\n" not in str(caught.value)
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))


def test_a_cache_folder_that_cannot_be_written_is_a_one_line_refusal(monkeypatch, tmp_path) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(blocker))
    with pytest.raises(KernelUnavailable, match="could not be built") as caught:
        native._build(AVX2)
    assert "\n" not in str(caught.value)


def test_a_failed_compile_is_a_one_line_refusal_and_leaves_nothing(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # runs, fails, says nothing
    with pytest.raises(KernelUnavailable, match="did not compile"):
        native._build(AVX2)
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))


@needs_kernel
def test_a_damaged_compiled_kernel_is_compiled_again(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    flags = native._isa_flags(native._cpu_flags()) or ()
    built = native._build(flags)
    built.write_bytes(b"not a shared library")
    lib = native._open(flags)
    assert (
        hasattr(lib, "int4_linear")
        and hasattr(lib, "causal_attention")
        and built.read_bytes().startswith(b"\x7fELF")
    )


def test_the_best_instruction_set_the_cpu_has_is_chosen() -> None:
    avx2 = frozenset({"avx", "avx2", "fma", "f16c"})
    assert native._isa_flags(avx2) == AVX2
    assert native._isa_flags(avx2 | {"avx512f", "avx512bw", "avx512_vnni"}) == AVX512
    assert native._isa_flags(avx2 | {"avx512f", "avx512bw"}) == AVX2  # AVX-512 without VNNI
    assert native._isa_flags(frozenset({"avx2", "fma"})) is None  # no F16C for the fp16 scales
    assert native._isa_flags(frozenset({"sse4_2", "avx"})) is None


def test_a_cpu_without_avx2_is_a_one_line_refusal(monkeypatch) -> None:
    monkeypatch.setattr(native, "_cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    native._load.cache_clear()
    try:
        reason = native.unavailable()
    finally:
        native._load.cache_clear()
    assert reason is not None and "AVX2" in reason and "--precision int8" in reason and "\n" not in reason


def _run_kernels(lib) -> list[torch.Tensor]:
    """Outputs of each kernel on fixed inputs: a 4-bit and a 6-bit linear, attention, the small ops."""
    generator = torch.Generator().manual_seed(7)
    outputs = []
    for bits, rows in ((4, 1), (4, 9), (6, 3)):
        weight, x = torch.randn(72, 256, generator=generator), torch.randn(rows, 256, generator=generator)
        packed = int4_cpu.pack(*int4_cpu.quantize(weight, bits), bits=bits)
        bias, y = torch.randn(72, generator=generator), torch.empty(rows, 72)
        assert lib.int4_linear(packed.data_ptr(), 72, 256, x.data_ptr(), rows, bias.data_ptr(), y.data_ptr(), 2, bits) == 0
        outputs.append(y)
    query, key, value = _attention_inputs(6, 2, 64, 37, 5)
    query, key, value = query[0].contiguous(), key[0].contiguous(), value[0].contiguous()
    out = torch.empty(5, 6, 64)
    assert lib.causal_attention(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), 5, 37, 37 * 64, 6, 2, 64,
        ctypes.c_float(0.125), 0, 2,
    ) == 0
    outputs.append(out)
    x, weight = torch.randn(3, 100, generator=generator), torch.randn(100, generator=generator)
    normed = torch.empty(3, 100)
    lib.rms_norm(x.data_ptr(), weight.data_ptr(), normed.data_ptr(), 3, 100, ctypes.c_float(1e-6))
    gate_up, act = torch.randn(20, 2 * 40, generator=generator) * 30, torch.empty(20, 40)
    lib.silu_mul(gate_up.data_ptr(), act.data_ptr(), 20, 40, 2)  # 20 rows: split between threads
    x = torch.randn(20, 100, generator=generator) * 5
    q, scale = torch.empty(20, 100, dtype=torch.uint8), torch.empty(20)
    lib.int8_quantize_rows(x.data_ptr(), 20, 100, q.data_ptr(), scale.data_ptr(), 2)
    return [*outputs, normed, act, q, scale]


def test_the_avx2_and_avx512_builds_compute_the_same_numbers(monkeypatch, tmp_path) -> None:
    if native._isa_flags(native._cpu_flags()) != AVX512:
        pytest.skip("needs a CPU with AVX-512 VNNI to run both builds")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    builds = []
    for flags in (AVX512, AVX2):
        native._load.cache_clear()
        monkeypatch.setattr(native, "_cpu_flags", lambda flags=flags: frozenset(
            {"avx2", "fma", "f16c", *(("avx512f", "avx512bw", "avx512_vnni") if flags == AVX512 else ())}
        ))
        builds.append(_run_kernels(native.library()))
    native._load.cache_clear()
    for wide, narrow in zip(*builds, strict=True):
        assert torch.equal(wide, narrow)
