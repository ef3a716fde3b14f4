"""The project's C kernels for the CPU: compiled here once per machine, loaded with ctypes.

One library holds them: `int4_cpu.c` (4-bit weights x int8 activations, the int4
precision), `attention_cpu.c` (causal attention a row at a time, in one call per
layer) and `layers_cpu.c` (a decoder layer's norm and rotary embedding, a whole 4-bit
layer, a model's layers in one call). All give every
row the same numbers whatever the batch and thread count, which is what keeps
speculative decoding exact.

The sources ship with the package. The first use compiles them with the system's C
compiler (a second or two) into `<cache>/kernels/native-<key>.so`, the key a hash of
the sources, compiler and flags; the file is renamed into place when complete, and a
damaged one is deleted and compiled again. The library links the OpenMP runtime torch
already loaded, so the two share one thread pool. No compiler, a failed compile or a
CPU without AVX-512 VNNI: `unavailable()` says why in one line, `int4` is refused at
load, and attention takes transformers' own path row by row.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from .cache import kernels_dir

SOURCES = tuple(Path(__file__).with_name(name) for name in ("int4_cpu.c", "attention_cpu.c", "layers_cpu.c"))
HEADERS = (Path(__file__).with_name("simd_math.h"),)
# -ffp-contract=off: a multiply then an add round twice, as torch's separate ops do.
FLAGS = (
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vnni",
    "-mf16c",
    "-mfma",
    "-ffp-contract=off",
    "-fopenmp",
    "-shared",
    "-fPIC",
)
_INT4_ADVICE = "use --precision int8"


class KernelUnavailable(RuntimeError):
    """The C kernels cannot run here; the message says why in one line."""


def unavailable() -> str | None:
    """Why the C kernels cannot run on this machine, or None when they can."""
    try:
        library()
    except KernelUnavailable as exc:
        return str(exc)
    return None


def library() -> ctypes.CDLL:
    loaded = _load()
    if isinstance(loaded, KernelUnavailable):
        raise KernelUnavailable(str(loaded))
    return loaded


@functools.cache
def _load() -> ctypes.CDLL | KernelUnavailable:
    """The library, or why not: tried once per process (a failed compile is not retried per load)."""
    try:
        if not _cpu_has_vnni():
            raise KernelUnavailable(f"int4 needs a CPU with AVX-512 VNNI; {_INT4_ADVICE}")
        lib = _open(_build())
    except KernelUnavailable as exc:
        return exc
    pointer, size, c_int, c_float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.int4_linear.argtypes = [pointer, size, size, pointer, size, pointer, pointer, c_int, c_int]
    lib.int4_linear.restype = c_int
    lib.causal_attention.argtypes = [pointer] * 4 + [size] * 6 + [c_float, size, c_int]
    lib.causal_attention.restype = c_int
    lib.rms_norm.argtypes = [pointer, pointer, pointer, size, size, c_float]
    lib.rms_norm.restype = None
    lib.rotary.argtypes = [pointer, size, pointer, pointer, pointer, size, size, size, size]
    lib.rotary.restype = None
    lib.silu_mul.argtypes = [pointer, pointer, size, size]
    lib.silu_mul.restype = None
    lib.decoder_layer.argtypes = [pointer, pointer, size, pointer, pointer, pointer, pointer, size, size, c_int]
    lib.decoder_layer.restype = c_int
    lib.decoder_stack.argtypes = [pointer, size, pointer, size, pointer, pointer, pointer, pointer, pointer, size, c_int]
    lib.decoder_stack.restype = c_int
    return lib


def _open(built: Path) -> ctypes.CDLL:
    """Load the compiled library; a damaged one is deleted and compiled again, once."""
    try:
        return ctypes.CDLL(str(built))
    except OSError:
        built.unlink(missing_ok=True)
    try:
        return ctypes.CDLL(str(_build()))
    except OSError as exc:
        raise KernelUnavailable(f"the compiled CPU kernels do not load ({exc}); {_INT4_ADVICE}") from exc


def _cpu_has_vnni() -> bool:
    """From the kernel's flags for the CPU (Linux); elsewhere the kernels are not offered."""
    try:
        info = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    flags = next(
        (line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []
    )
    return {"avx512f", "avx512bw", "avx512_vnni", "f16c", "fma"} <= set(flags)


def _build() -> Path:
    """The compiled library in the cache folder, compiling it first if needed."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelUnavailable(
            f"int4 compiles a small kernel and found no C compiler (cc, gcc); {_INT4_ADVICE}"
        )
    try:
        text = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
        key = hashlib.sha256(text + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
        built = kernels_dir() / f"native-{key}.so"
        if built.exists():
            return built
        built.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a source unreadable, the cache folder not writable
        raise KernelUnavailable(f"int4's kernel could not be built ({exc}); {_INT4_ADVICE}") from exc
    partial = built.with_name(f"{built.name}.{os.getpid()}.tmp")  # renamed into place when complete
    try:
        done = subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), "-o", str(partial)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no message"])[0]
            raise KernelUnavailable(f"int4's kernel did not compile ({first}); {_INT4_ADVICE}")
        os.replace(partial, built)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"int4's kernel could not be built ({exc}); {_INT4_ADVICE}") from exc
    finally:
        partial.unlink(missing_ok=True)
    return built
