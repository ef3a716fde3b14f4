"""What this CPU offers: its instruction-set extensions, as `SPECDEC_ISA` narrows them.

Every decision that depends on the CPU's instructions asks here: which build of the C
kernels runs (native.py) and whether oneDNN's int8 sums can be exact (quant_cpu,
draft_bulk). `SPECDEC_ISA=avx512|avx2|scalar` makes this machine answer as a CPU whose best
build is that one would: `avx2` hides AVX-512, AVX-VNNI and AMX (as on an AVX2-only CPU),
`scalar` hides AVX, FMA and F16C too. The kernels refuse, in one line, a setting this CPU
cannot run; `python -m specdec_core.kernels.cpu.features --runnable-isas` lists those it can, best first.

The extensions are read from the `flags` line of /proc/cpuinfo (Linux on x86). ARM Linux
lists `Features` instead and macOS has no /proc: there none is known, the scalar build
runs, and oneDNN's own check decides its int8 sums.
"""

from __future__ import annotations

import argparse
import os
import platform
from dataclasses import dataclass
from pathlib import Path

ISA_ENV = "SPECDEC_ISA"
# VNNI (AVX-512 or AVX) or AMX: oneDNN's u8 x s8 products are summed exactly in int32; without
# them they are added in pairs into int16 and saturate (quant_cpu.onednn_sums_exactly).
EXACT_INT8 = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


@dataclass(frozen=True)
class Isa:
    """A build of the kernels: the extensions it needs and those a CPU whose best it is lacks."""

    name: str
    needs: frozenset[str]  # as /proc/cpuinfo's flags name them
    hides: tuple[str, ...]  # prefixes of the extensions SPECDEC_ISA=name hides


# Best first; the last needs nothing and runs anywhere.
ISAS = (
    Isa("avx512-vnni", frozenset({"avx512f", "avx512bw", "avx512_vnni", "f16c", "fma"}), ("amx",)),
    Isa("avx2", frozenset({"avx2", "f16c", "fma"}), ("amx", "avx512", "avx_vnni", "avx10")),
    Isa("scalar", frozenset(), ("amx", "avx", "fma", "f16c")),
)
_ALIASES = {"avx512": "avx512-vnni"}


class UnknownIsa(ValueError):
    """SPECDEC_ISA names no build; the message says so in one line."""


def cpuinfo() -> str:
    """The kernel's description of the CPU (Linux); elsewhere empty."""
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def model_name(text: str) -> str | None:
    """The value of cpuinfo text's first `model name` line as written (its leading space
    kept), or None where there is none (ARM, macOS)."""
    line = next((ln for ln in text.splitlines() if ln.startswith("model name")), None)
    return line.split(":", 1)[1] if line is not None and ":" in line else None


def listed_flags(text: str) -> frozenset[str] | None:
    """The x86 `flags` line of cpuinfo text, or None where there is none (ARM, macOS)."""
    for line in text.splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return None


def requested() -> Isa | None:
    """The build SPECDEC_ISA asks for, or None when it is unset. Raises UnknownIsa."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return None
    name = _ALIASES.get(value, value)
    for isa in ISAS:
        if isa.name == name:
            return isa
    raise UnknownIsa(f"{ISA_ENV}={value} names no build of the kernels: use avx512, avx2 or scalar")


def features() -> frozenset[str] | None:
    """The CPU's extensions as SPECDEC_ISA narrows them; None where the OS lists none and
    SPECDEC_ISA is unset (or names no build)."""
    flags = listed_flags(cpuinfo())
    try:
        isa = requested()
    except UnknownIsa:
        return flags
    if isa is None:
        return flags
    return frozenset(flag for flag in flags or () if not flag.startswith(isa.hides))


def runnable(flags: frozenset[str] | None = None) -> tuple[Isa, ...]:
    """The builds this CPU can run (SPECDEC_ISA aside), best first; the scalar one always."""
    have = listed_flags(cpuinfo()) if flags is None else flags
    return tuple(isa for isa in ISAS if isa.needs <= (have or frozenset()))


def int8_sums_can_be_exact() -> bool:
    """False where the CPU (as SPECDEC_ISA narrows it) has neither VNNI nor AMX; where the
    OS does not say, True, and oneDNN's own check decides."""
    offered = features()
    return offered is None or bool(offered & EXACT_INT8)


def machine() -> str:
    """What the CPU is, in a word: aarch64, x86_64, arm64 (macOS)..."""
    return platform.machine() or "this CPU"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec_core.kernels.cpu.features", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runnable-isas", action="store_true", help="print the SPECDEC_ISA values this CPU can run"
    )
    if parser.parse_args().runnable_isas:
        print(" ".join(isa.name for isa in runnable()))
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
