"""The C kernels: built once and loaded, one-line refusals when they cannot be, and
row-wise attention that gives a row the same numbers in any batch."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from specdec_core.kernels.batch_invariant import rowwise_attention
from specdec_core.kernels.cpu import attention_cpu, features, int4_cpu, native
from specdec_core.kernels.cpu.native import KernelUnavailable

needs_kernel = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))
SCALAR = native.ISA_FLAGS["scalar"]
ZEN3 = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma f16c bmi2\n"
XEON = "vendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512_vnni amx_int8\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32 asimddp\nCPU implementer\t: 0x41\n"


def _failing_compiler(folder: Path) -> str:
    """A compiler that runs, fails and says nothing."""
    compiler = folder / "failing-cc"
    compiler.write_text("#!/bin/sh\nexit 1\n")
    compiler.chmod(0o755)
    return str(compiler)


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
        native._build(SCALAR)
    assert "\n" not in str(caught.value)
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))


def test_a_cache_folder_that_cannot_be_written_is_a_one_line_refusal(monkeypatch, tmp_path) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(blocker))
    monkeypatch.setenv("CC", _failing_compiler(tmp_path))  # a compiler, wherever the suite runs
    with pytest.raises(KernelUnavailable, match="could not be built") as caught:
        native._build(SCALAR)
    assert "\n" not in str(caught.value)


def test_a_failed_compile_is_a_one_line_refusal_and_leaves_nothing(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", _failing_compiler(tmp_path))
    with pytest.raises(KernelUnavailable, match="did not compile"):
        native._build(SCALAR)
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))


@needs_kernel
def test_a_damaged_compiled_kernel_is_compiled_again(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    flags = native.ISA_FLAGS[native.isa() or "scalar"]
    built = native._build(flags)
    built.write_bytes(b"not a shared library")
    lib = native._open(flags)
    assert (
        hasattr(lib, "int4_linear")
        and hasattr(lib, "causal_attention")
        and built.read_bytes().startswith(b"\x7fELF")
    )


def _chosen(cpuinfo: str, machine: str = "x86_64") -> str:
    chosen = native.choose_isa(cpuinfo, machine)
    return chosen if isinstance(chosen, str) else chosen.name


def test_the_best_build_the_cpu_can_run_is_chosen(monkeypatch) -> None:
    monkeypatch.delenv(features.ISA_ENV, raising=False)
    assert _chosen(ZEN3) == "avx2"
    assert _chosen(XEON) == "avx512-vnni"
    assert _chosen(ZEN3.replace("bmi2", "avx512f avx512bw")) == "avx2"  # AVX-512 without VNNI
    assert _chosen(ZEN3.replace("f16c", "")) == "scalar"  # no F16C for the fp16 scales
    assert _chosen("flags\t\t: fpu sse2 sse4_2 avx\n") == "scalar"
    assert _chosen(ARM, "aarch64") == "scalar"  # ARM Linux lists Features, not flags
    assert _chosen("", "arm64") == "scalar"  # macOS: no /proc/cpuinfo


def test_specdec_isa_picks_any_build_the_cpu_can_run(monkeypatch) -> None:
    for value, name in (("avx512", "avx512-vnni"), ("avx512-vnni", "avx512-vnni"), ("AVX2", "avx2"), ("scalar", "scalar")):
        monkeypatch.setenv(features.ISA_ENV, value)
        assert _chosen(XEON) == name
    monkeypatch.setenv(features.ISA_ENV, "scalar")
    assert _chosen(ARM, "aarch64") == "scalar"


@pytest.mark.parametrize(
    ("value", "cpuinfo", "machine", "says"),
    [
        ("avx512", ZEN3, "x86_64", "lacks avx512_vnni, avx512bw, avx512f"),
        ("avx2", ARM, "aarch64", "this CPU (aarch64) lists no x86 extensions: only the scalar build runs here"),
        ("avx2", "", "arm64", "this CPU (arm64) lists no x86 extensions"),
        ("sse", XEON, "x86_64", "SPECDEC_ISA=sse names no build of the kernels: use avx512, avx2 or scalar"),
    ],
)
def test_a_build_the_cpu_cannot_run_is_a_one_line_refusal(monkeypatch, value, cpuinfo, machine, says) -> None:
    monkeypatch.setenv(features.ISA_ENV, value)
    monkeypatch.setattr(features, "cpuinfo", lambda: cpuinfo)
    monkeypatch.setattr(features, "machine", lambda: machine)
    native._load.cache_clear()
    try:
        reason, name = native.unavailable(), native.isa()
    finally:
        native._load.cache_clear()
    assert reason is not None and says in reason and "--precision int8" in reason and "\n" not in reason
    assert name is None


def test_specdec_isa_hides_what_a_cpu_with_only_that_build_lacks(monkeypatch) -> None:
    monkeypatch.setattr(features, "cpuinfo", lambda: XEON)
    monkeypatch.delenv(features.ISA_ENV, raising=False)
    assert features.int8_sums_can_be_exact()
    assert [isa.name for isa in features.runnable()] == ["avx512-vnni", "avx2", "scalar"]
    monkeypatch.setenv(features.ISA_ENV, "avx512")
    assert features.features() == features.listed_flags(XEON) - {"amx_int8"}
    for value in ("avx2", "scalar"):  # as on a Zen 3, or an older CPU: no VNNI, no AMX
        monkeypatch.setenv(features.ISA_ENV, value)
        assert not features.int8_sums_can_be_exact()
        assert [isa.name for isa in features.runnable()] == ["avx512-vnni", "avx2", "scalar"]  # what can run stays
    assert features.features() == {"fpu", "sse2"}
    monkeypatch.setattr(features, "cpuinfo", lambda: ARM)
    monkeypatch.delenv(features.ISA_ENV)
    assert features.features() is None and features.int8_sums_can_be_exact()  # unknown: oneDNN's own check decides
    assert [isa.name for isa in features.runnable()] == ["scalar"]


def test_apple_clang_without_openmp_is_named_in_one_line() -> None:
    message = native._compile_failure("clang: error: unsupported option '-fopenmp'\nmore\n")
    assert "no OpenMP" in message and "-fopenmp" in message and "\n" not in message
    assert native._compile_failure("") == "int4's kernel did not compile (no message)"


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
    return [*outputs, normed, act, q, scale, *_run_packing(lib)]


def _run_packing(lib) -> list[torch.Tensor]:
    """Packing in C groups whose minimum is each fp16 value below packing's limit, each midpoint
    between two (ties round to even), their negatives, and fp16's subnormal steps (a constant
    group's step); unpacking every fp16 scale there is."""
    halves = torch.arange(0, 0x7800, dtype=torch.int16).view(torch.float16).float()  # 0 .. 32768
    halves = halves[halves < 32752]
    mids = (halves[:-1] + halves[1:]) / 2  # exact in fp32
    values = torch.cat([halves, mids, -halves, -mids])
    weight = values[:, None].repeat(1, int4_cpu.GROUP)
    weight[::3, -1] += 0.37  # some groups with a real range
    packed = torch.empty(-(-len(weight) // 16), 1, int4_cpu.block_bytes(4), dtype=torch.uint8)
    assert lib.int4_pack(weight.data_ptr(), len(weight), int4_cpu.GROUP, 4, packed.data_ptr(), 2) == 0
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)[:, None]
    scales = int4_cpu.pack(torch.ones(len(every), int4_cpu.GROUP, dtype=torch.uint8), every, torch.zeros_like(every), 4)
    unpacked = torch.empty(len(every), int4_cpu.GROUP)
    assert lib.int4_unpack(scales.data_ptr(), len(every), int4_cpu.GROUP, 4, unpacked.data_ptr(), 2) == 0
    return [packed, unpacked]


@needs_kernel
def test_every_build_this_cpu_runs_computes_the_same_bits(monkeypatch, tmp_path) -> None:
    builds = [isa.name for isa in features.runnable()]
    if len(builds) < 2:
        pytest.skip(f"this CPU runs only the {builds[0]} build")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    outputs = []
    for name in builds:
        monkeypatch.setenv(features.ISA_ENV, name)
        native._load.cache_clear()
        outputs.append([out.contiguous().view(torch.uint8) for out in _run_kernels(native.library())])
    native._load.cache_clear()
    assert len(list(tmp_path.rglob("native-*.so"))) == len(builds)  # each build its own file
    for name, other in zip(builds[1:], outputs[1:], strict=True):
        for index, (first, this) in enumerate(zip(outputs[0], other, strict=True)):
            assert torch.equal(first, this), (builds[0], name, index)


def test_the_cpu_model_name_is_read_as_written_and_absent_where_not_listed():
    assert features.model_name("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t: avx2\n") == " AMD EPYC 7B13"
    assert features.model_name("processor\t: 0\nFeatures\t: fp asimd\n") is None
