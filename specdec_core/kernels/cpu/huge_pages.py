"""The 4-bit weights in 2 MB pages, so a decoding step streams them at the memory's speed.

A CPU decoding step reads every weight once, in order. In 4 KB pages the hardware
prefetchers stop at every page boundary and every page costs a TLB walk, so the same
read streams faster in 2 MB pages (docs/engine.md#the-weights-in-2-mb-pages-huge_pagespy
has the bandwidths). Linux backs memory with such pages where the process asks for
them (transparent huge pages in `madvise` mode, the common default) or everywhere
(`always`); where they are off (`never`), or on another OS, the weights stay where
they are and nothing else changes; so they do where the mapping cannot be made.

`place_in_huge_pages` copies the packed weights of a model's 4/6-bit linears, one
module at a time, into one anonymous private mapping that asked for huge pages, and
points each module at its copy: the same bytes, so the same numbers. It must run before
anything records the weights' addresses (the one-call layers, `layers_cpu`).
"""

from __future__ import annotations

import ctypes
import mmap
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from . import native
from .int4_cpu import Int4Linear

HUGE_PAGE = 2 << 20
_ALIGN = 4096  # each module's weights start on a page of their own
_TRIM_EVERY = 64 << 20  # bytes moved between handing freed buffers back: the peak stays near one copy


def available() -> bool:
    """Whether this OS lets a mapping ask for huge pages (the kernel may still grant none)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")


def place_in_huge_pages(modules: Iterable[nn.Module]) -> int:
    """Move the packed weights of the 4/6-bit linears among `modules` into huge pages; bytes moved.

    Those are int4_cpu's linears and GGUF linears repacked for its kernel (gguf_blocks), whose
    `packed` is a numpy array: it is placed the same way and stays a numpy array."""
    linears = [m for m in modules if _packed(m) is not None]  # modules only: a list of the old
    # buffers would keep every one of them alive until the last copy is made
    if not linears or not available():
        return 0
    sizes = [_rounded(_nbytes(linear)) for linear in linears]
    try:
        arena = buffer(sum(sizes))
    except OSError:  # no room for the mapping, or the kernel refuses the advice: stay where they are
        return 0
    offset = trimmed = 0
    for linear, size in zip(linears, sizes, strict=True):
        packed = _packed(linear)
        assert packed is not None
        placed = arena[offset : offset + packed.nbytes].numpy()
        placed[:] = packed.reshape(-1).view(np.uint8)
        moved = placed.view(packed.dtype).reshape(packed.shape)
        del packed
        native.settle_helper()  # the kernel's helper may still read the old buffer (helper_cpu.c)
        # The old buffer is freed here: one module's copy at a time.
        setattr(linear, "packed", torch.from_numpy(moved) if isinstance(linear, Int4Linear) else moved)  # noqa: B010
        offset += size
        if offset - trimmed >= _TRIM_EVERY:  # the old buffers go back to the OS as the copies grow
            return_freed_memory()
            trimmed = offset
    return offset


def _nbytes(module: nn.Module) -> int:
    packed = _packed(module)
    return 0 if packed is None else packed.nbytes


def _packed(module: nn.Module) -> np.ndarray | None:
    """The module's packed 4/6-bit weights as a numpy view of the same memory, if it has any."""
    packed = getattr(module, "packed", None)
    if isinstance(module, Int4Linear) and isinstance(packed, torch.Tensor):
        return packed.numpy()
    return packed if isinstance(packed, np.ndarray) else None


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing).

    Quantizing frees the full-precision copies it made, and moving weights into huge pages
    frees their old buffers; glibc keeps freed memory for later allocations, where it stays
    counted as the process's."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return
    trim(0)


def granted_bytes() -> int | None:
    """Bytes of this process's memory in transparent huge pages now (None: not Linux)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text(encoding="utf-8")
    except OSError:
        return None
    found = re.search(r"^AnonHugePages:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


def buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of uint8 (zeros) starting on a 2 MB boundary, in a mapping that asked for huge pages.

    The tensor holds the mapping (torch.frombuffer keeps its buffer alive), and so does
    every view of it: the memory lives as long as any module points into it."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the pages are huge from the start
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def _rounded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
