"""The project's C kernels for the CPU: compiled here once per machine, loaded with ctypes.

One library holds them: `int4_cpu.c` (4-bit weights x int8 activations, the int4
precision), `attention_cpu.c` (causal attention a row at a time, in one call per
layer), `layers_cpu.c` (a decoder layer's norm and rotary embedding, a whole 4-bit
layer, a model's layers in one call), `gguf_cpu.c` (a GGUF's blocks as stored) and
`gguf_quantize.c` (llama.cpp's reference quantizers, to write such blocks). All give every
row the same numbers whatever the batch and thread count, which is what keeps
speculative decoding exact.

The sources ship with the package. The first use compiles them with the system's C
compiler (a second or two) into `<cache>/kernels/native-<key>.so`, the key a hash of
the sources, compiler and flags; the file is renamed into place when complete, and a
damaged one is deleted and compiled again. It is loaded only from a private folder,
owned by the user, with the sha256 recorded when it was compiled (kernel_files.py).
The library links the OpenMP runtime torch already loaded, so the two share one
thread pool.

The kernels are written for 16-lane vectors (simd16.h), in one of three builds (`ISA_FLAGS`,
best first; features.py says which this CPU can run). A CPU with AVX-512 VNNI gets them as
AVX-512 instructions; one with AVX2, FMA and F16C (most desktop CPUs since 2013-2015,
Intel's recent consumer chips included) gets each vector as two 256-bit halves; any other
(older x86, ARM, macOS) gets plain C a lane at a time, compiled with no flag for the
architecture. All three compute the same numbers. `SPECDEC_ISA=avx512|avx2|scalar` picks
one (features.py). No compiler, a failed compile (Apple's clang has no OpenMP) or a build this
CPU cannot run: `unavailable()` says why in one line, `int4` is refused at load, and
attention takes transformers' own path row by row.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
from pathlib import Path

from ...disk_cache import kernels_dir
from . import features, kernel_files

SOURCES = tuple(Path(__file__).with_name(name) for name in ("int4_cpu.c", "helper_cpu.c", "attention_cpu.c", "layers_cpu.c", "gguf_cpu.c", "gguf_quantize.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("helper_cpu.h", "simd16.h", "simd_math.h"))
# -ffp-contract=off: a multiply then an add round twice, as torch's separate ops do. Nothing
# here names an architecture: the scalar build compiles with a plain `cc` anywhere.
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-pthread", "-shared", "-fPIC")
# The compiler flags of each build in features.ISAS; being in the flags, the build is in the cache
# key. SPECDEC_SCALAR keeps the scalar build plain C where the compiler targets AVX2 by default.
ISA_FLAGS = {
    "avx512-vnni": ("-mavx512f", "-mavx512bw", "-mavx512vnni", "-mf16c", "-mfma"),
    "avx2": ("-mavx2", "-mf16c", "-mfma"),
    "scalar": ("-DSPECDEC_SCALAR",),
}
_INT4_ADVICE = "use --precision int8"


class KernelUnavailable(RuntimeError):
    """The C kernels cannot run here; the message says why in one line."""


_share_spare_core = False  # what the library is told when it loads (share_spare_core)
# Helper threads that share a one-thread op while sharing is on. Two, because beside a busy
# process the scheduler gives each runnable thread its share, so two helpers take more of
# the spare core than one, while a third adds nothing; quiet, a forward costs the same with
# one, two or three (docs/performance.md#beside-a-busy-process). At most two
# (HELPER_THREADS in helper_cpu.h, whose staging is reserved for that many).
HELPERS = 2


def share_spare_core(on: bool) -> None:
    """Let ops on one thread share their work with `HELPERS` helper threads (helper_cpu.c): the thread
    governor turns it on when it runs one thread beside another process's load, to use the
    time the scheduler leaves on the other core. Cheap; the library is not built for it."""
    global _share_spare_core
    _share_spare_core = on
    loaded = _loaded()
    if loaded is not None:
        loaded.helper_enable(HELPERS if on else 0)


def sharing_spare_core() -> bool:
    """What `share_spare_core` was last told."""
    return _share_spare_core


def settle_helper() -> None:
    """Wait until no helper holds a chunk of an op: after this, what earlier ops read (a
    linear's weights) may be freed. Nothing to do before the library is loaded."""
    loaded = _loaded()
    if loaded is not None:
        loaded.helper_settle()


def _loaded() -> ctypes.CDLL | None:
    """The library if it is loaded already, without building or loading it."""
    if not _load.cache_info().currsize:
        return None
    loaded = _load()
    return None if isinstance(loaded, KernelUnavailable) else loaded


def helper_counts() -> tuple[int, int]:
    """The helper's chunks so far: (merged from its staging, computed again by the caller)."""
    counts = (ctypes.c_uint64 * 2)()
    library().helper_counts(ctypes.byref(counts))
    return counts[0], counts[1]


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
        chosen = choose_isa(features.cpuinfo(), features.machine())
        if isinstance(chosen, str):
            raise KernelUnavailable(f"{chosen}; {_INT4_ADVICE}")
        lib = _open(ISA_FLAGS[chosen.name])
    except KernelUnavailable as exc:
        return exc
    pointer, size, c_int, c_float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.int4_linear.argtypes = [pointer, size, size, pointer, size, pointer, pointer, c_int, c_int]
    lib.int4_linear.restype = c_int
    lib.helper_enable.argtypes = [c_int]
    lib.helper_enable.restype = None
    lib.helper_enable(HELPERS if _share_spare_core else 0)
    lib.helper_settle.argtypes = []
    lib.helper_settle.restype = None
    lib.helper_counts.argtypes = [ctypes.POINTER(ctypes.c_uint64 * 2)]
    lib.helper_counts.restype = None
    lib.helper_lag.argtypes = [c_int]
    lib.helper_lag.restype = None
    lib.int4_pack.argtypes = [pointer, size, size, c_int, pointer, c_int]
    lib.int4_pack.restype = c_int
    lib.int4_unpack.argtypes = [pointer, size, size, c_int, pointer, c_int]
    lib.int4_unpack.restype = c_int
    lib.int4_quantize_rows.argtypes = [pointer, size, size, pointer, pointer, pointer]
    lib.int4_quantize_rows.restype = None
    lib.causal_attention.argtypes = [pointer] * 4 + [size] * 6 + [c_float, size, c_int]
    lib.causal_attention.restype = c_int
    lib.rms_norm.argtypes = [pointer, pointer, pointer, size, size, c_float]
    lib.rms_norm.restype = None
    lib.rotary.argtypes = [pointer, size, pointer, pointer, pointer, size, size, size, size]
    lib.rotary.restype = None
    lib.silu_mul.argtypes = [pointer, pointer, size, size, c_int]
    lib.silu_mul.restype = None
    lib.int8_quantize_rows.argtypes = [pointer, size, size, pointer, pointer, c_int]
    lib.int8_quantize_rows.restype = None
    lib.int8_scale_rows.argtypes = [pointer, size, size, pointer, pointer, pointer, c_int]
    lib.int8_scale_rows.restype = None
    lib.decoder_layer.argtypes = [pointer, pointer, size, pointer, pointer, pointer, pointer, size, size, c_int]
    lib.decoder_layer.restype = c_int
    lib.decoder_stack.argtypes = [pointer, size, pointer, size, pointer, pointer, pointer, pointer, pointer, size, c_int]
    lib.decoder_stack.restype = c_int
    return lib


def _open(isa_flags: tuple[str, ...]) -> ctypes.CDLL:
    """Build (or find) and load the library; a damaged one is deleted and compiled again, once."""
    built = _build(isa_flags)
    try:
        return ctypes.CDLL(str(built))
    except OSError:
        kernel_files.discard(built)
    try:
        return ctypes.CDLL(str(_build(isa_flags)))
    except OSError as exc:
        raise KernelUnavailable(f"the compiled CPU kernels do not load ({exc}); {_INT4_ADVICE}") from exc


def vector_build() -> bool:
    """Whether the kernels run here in a vector build (AVX2 or AVX-512), not the scalar one.
    The scalar build computes the same numbers a value at a time: there the 4-bit paths are
    slower than torch's int8, so `auto` picks them only where this holds (README, precision)."""
    return unavailable() is None and isa() not in (None, "scalar")


def isa() -> str | None:
    """The build of the kernels this process takes ("avx512-vnni", "avx2", "scalar"), or None
    when SPECDEC_ISA asks for one this CPU cannot run."""
    chosen = choose_isa(features.cpuinfo(), features.machine())
    return None if isinstance(chosen, str) else chosen.name


def choose_isa(cpuinfo: str, machine: str) -> features.Isa | str:
    """The build for a CPU described by `cpuinfo` (/proc/cpuinfo's text, empty where there is
    none) on `machine` (platform.machine()): SPECDEC_ISA's if the CPU can run it, else the
    best it can run; or, in one line, why SPECDEC_ISA's cannot run."""
    try:
        wanted = features.requested()
    except features.UnknownIsa as exc:
        return str(exc)
    flags = features.listed_flags(cpuinfo)
    runnable = features.runnable(flags or frozenset())
    if wanted is None or wanted in runnable:
        return wanted or runnable[0]
    if flags is None:
        return (f"{features.ISA_ENV}={wanted.name} asks for an x86 build, and this CPU ({machine}) lists no x86 "
                f"extensions: only the scalar build runs here")
    missing = ", ".join(sorted(wanted.needs - flags))
    return f"{features.ISA_ENV}={wanted.name} asks for a build this CPU ({machine}) cannot run: it lacks {missing}"


def _vendor_flags() -> tuple[str, ...]:
    """Tuning for the CPU's maker: Intel cores stream weights faster when prefetched into L2
    (int4_cpu.c, STREAM_HINT)."""
    return ("-DSPECDEC_INTEL_PREFETCH",) if "GenuineIntel" in features.cpuinfo() else ()


def _compile_failure(stderr: str) -> str:
    """A failed compile in one line: the compiler's first line, and what it means where known."""
    first = (stderr.strip().splitlines() or ["no message"])[0]
    if "openmp" in stderr.lower():
        return f"int4's kernel did not compile: the C compiler has no OpenMP, as Apple's clang ({first})"
    return f"int4's kernel did not compile ({first})"


def _build(isa_flags: tuple[str, ...]) -> Path:
    """The compiled library in the cache folder, checked (kernel_files.py), compiling it first if needed."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelUnavailable(
            f"int4 compiles a small kernel and found no C compiler (cc, gcc); {_INT4_ADVICE}"
        )
    try:
        text = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
        flags = (*COMMON_FLAGS, *isa_flags, *_vendor_flags())
        key = hashlib.sha256(text + " ".join((compiler, *flags)).encode()).hexdigest()[:16]
        built = kernel_files.private_folder(kernels_dir()) / f"native-{key}.so"
        with kernel_files.compile_lock(built.parent):  # a second process finds the first one's library
            if not kernel_files.usable(built):
                _compile(compiler, flags, built)
    except kernel_files.KernelFileError as exc:  # a file or folder others could write, a hung compiler
        raise KernelUnavailable(f"{exc}; {_INT4_ADVICE}") from exc
    except OSError as exc:  # a source unreadable, the cache folder not writable, no compiler to run
        raise KernelUnavailable(f"int4's kernel could not be built ({exc}); {_INT4_ADVICE}") from exc
    return built


def _compile(compiler: str, flags: tuple[str, ...], built: Path) -> None:
    partial = built.with_name(f"{built.name}.{os.getpid()}.tmp")  # renamed into place when complete
    try:
        done = kernel_files.run_compiler([compiler, *flags, *map(str, SOURCES), "-o", str(partial)])
        if done.returncode != 0:
            raise KernelUnavailable(f"{_compile_failure(done.stderr)}; {_INT4_ADVICE}")
        kernel_files.install(partial, built)
    finally:
        partial.unlink(missing_ok=True)
