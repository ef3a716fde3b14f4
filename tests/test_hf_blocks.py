"""An HF folder on the CPU as llama.cpp blocks: quantized once with llama.cpp's own reference
quantizers (byte for byte), cached as a GGUF, measured against the source at conversion."""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from specdec_core.kernels import native
from specdec_core.kernels.gguf_quantize import QUANTIZED, quantize

needs_kernel = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))
LLAMA_BUILDS = "~/.cache/specdec/llama.cpp/*/src/vendor/llama.cpp/build/bin"


def rows_to_quantize(seed: int = 0, shape: tuple[int, int] = (37, 1024)) -> np.ndarray:
    """Weights of a few scales, with the cases the quantizers branch on: a zero row, a row of
    denormal-small values, an all-positive row, outliers."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    x[1] = 0.0
    x[2, :300] = 1e-30
    x[3] = np.abs(x[3])
    x[4, ::7] *= 60.0
    x[5] *= 300.0
    return x


def llama_cpp_file(name: str) -> Path | None:
    """A file of the llama.cpp that scripts/build-llama-cpp builds, if it was built here."""
    found = sorted(glob.glob(os.path.join(os.path.expanduser(LLAMA_BUILDS), name)))
    return Path(found[-1]) if found else None


def llama_quantize() -> Path | None:
    named = os.environ.get("SPECDEC_LLAMA_QUANTIZE")
    return Path(named) if named else (llama_cpp_file("llama-quantize") or _on_path("llama-quantize"))


def _on_path(name: str) -> Path | None:
    found = shutil.which(name)
    return Path(found) if found else None


@needs_kernel
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0])
def test_32_weight_blocks_are_the_gguf_packages_bytes(qtype):
    x = rows_to_quantize()
    assert np.array_equal(quantize(x, qtype), gguf.quants.quantize(x, qtype))


@needs_kernel
@pytest.mark.parametrize(("qtype", "bound"), [(T.Q4_K, 1.5 / 15), (T.Q6_K, 1.25 / 63)])
def test_k_quant_blocks_round_trip_within_the_types_step(qtype, bound):
    """Each weight comes back within about a quantization step of its 256-weight block
    (4 bits over the block's range; 6 bits over its largest magnitude), a zero row as
    zeros, and values too small for fp16 scales as zeros."""
    x = rows_to_quantize()
    back = gguf.quants.dequantize(quantize(x, qtype), qtype).reshape(x.shape)
    largest = np.repeat(np.abs(x).reshape(x.shape[0], -1, 256).max(axis=-1), 256, axis=-1)
    normal = np.arange(len(x)) != 2
    assert np.all(np.abs(back - x)[normal] <= bound * largest[normal])
    assert not back[1].any() and not back[2, :256].any()


def _ggml_base() -> ctypes.CDLL | None:
    path = llama_cpp_file("libggml-base.so")
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 2, *[ctypes.c_int64] * 3, ctypes.c_void_p]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    return lib


@needs_kernel
@pytest.mark.skipif(_ggml_base() is None, reason="llama.cpp's libggml-base is not built here (scripts/build-llama-cpp)")
@pytest.mark.parametrize("qtype", QUANTIZED)
@pytest.mark.parametrize("isa", ["", "scalar"])
def test_every_type_is_llama_cpps_own_bytes(qtype, isa, monkeypatch):
    if isa:
        monkeypatch.setenv("SPECDEC_ISA", isa)
        native._load.cache_clear()
    lib = _ggml_base()
    assert lib is not None
    try:
        for seed, scale in [(0, 1.0), (1, 1e-5), (2, 40.0)]:
            x = rows_to_quantize(seed) * scale
            ours = quantize(x, qtype)
            theirs = np.empty_like(ours)
            lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, theirs.ctypes.data, 0, x.shape[0], x.shape[1], None)
            assert np.array_equal(ours, theirs), f"{qtype.name}: {(ours != theirs).sum()} bytes differ"
    finally:
        native._load.cache_clear()


def test_a_row_that_is_not_whole_blocks_is_refused_in_one_line():
    with pytest.raises(ValueError, match="not whole Q4_K blocks of 256"):
        quantize(np.zeros((2, 96), np.float32), T.Q4_K)
    with pytest.raises(ValueError, match="no quantizer for Q3_K"):
        quantize(np.zeros((2, 256), np.float32), T.Q3_K)


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
