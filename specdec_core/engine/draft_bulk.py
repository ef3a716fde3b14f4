"""A 4-bit draft's reads of many tokens through oneDNN's int8 matmul (AMX where there is one).

Before its first draft of an answer a model draft reads every prompt token its cache
lacks (up to `ModelDrafter`'s window). In the 4-bit kernel (`int4_cpu.c`) a row costs its
`vpdpbusd` instructions at one a cycle plus a group's float work every 32 inputs, so a
long read costs a sizeable share of an answer that copies carry anyway. oneDNN's int8
matmul scales once per row and channel, and on CPUs with AMX its tiles do the integer
sums, so it reads many rows faster. Each oneDNN call has a fixed cost however few its
rows, so shorter forwards keep the 4-bit kernel (the crossover:
docs/performance.md#measurements-behind-the-design).

A draft's numbers never reach the answer (the target verifies every token it proposes),
so its reads may use other weights: its 4-bit values re-quantized to int8 per output
channel, with activations int8 per row. Never a target's: its rows must stay bitwise the
same in every grouping. The 4-bit one-call layers keep every forward under `MIN_ROWS`
rows (draft steps, the catch-up after a verify).

The int8 copy costs memory and load time, so `speed_up_reads` keeps it only where a read
of `PROBE_ROWS` tokens is clearly faster and the memory is there. `SPECDEC_DRAFT_BULK=0`
turns it off (for A/B measurements).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from typing import Any

import psutil
import torch
from torch import nn

from ..kernels.cpu import native
from ..kernels.cpu.int4_cpu import LANES, Int4Linear
from ..kernels.cpu.quant_cpu import OnednnInt8, onednn_available, onednn_sums_exactly, quantize_weight
from ..kernels.cpu.runner import CachedModel
from ..progress import check_cancelled

ENV_VAR = "SPECDEC_DRAFT_BULK"
# Reads of at least this many rows take the int8 copy: above the crossover with the 4-bit
# one-call layers (docs/performance.md#measurements-behind-the-design).
MIN_ROWS = 40
PROBE_ROWS = 128
MIN_GAIN = 0.85  # keep the int8 reads only if one takes at most 85% of the 4-bit one
SPARE_BYTES = 2 << 30  # memory that must stay available after the int8 copy


class BulkReads:
    """One linear's weights at int8 per output channel, for forwards of `min_rows` rows or more."""

    def __init__(self, linear: Int4Linear) -> None:
        self.min_rows = MIN_ROWS
        self.kernel = OnednnInt8(*_int8_weight(linear))

    def matmul(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """rows [T, in] -> [T, out] fp32, plus bias unless it is None. The quantizing and the
        scaling are one pass of C each (layers_cpu.c): in torch they cost a third of a read."""
        rows, lib, threads = rows.float().contiguous(), native.library(), torch.get_num_threads()
        q, row_scale = torch.empty(rows.shape, dtype=torch.uint8), torch.empty(rows.shape[0])
        lib.int8_quantize_rows(rows.data_ptr(), *rows.shape, q.data_ptr(), row_scale.data_ptr(), threads)
        sums = self.kernel.sums(q)
        lib.int8_scale_rows(
            sums.data_ptr(), *sums.shape, row_scale.data_ptr(), self.kernel.scales.data_ptr(),
            None if bias is None else bias.data_ptr(), threads,
        )  # fmt: skip
        return sums


def _int8_weight(linear: Int4Linear, channels: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit weights re-quantized to int8 per output channel, `channels` at a time: the
    whole weight in fp32 at once (35 MB for the 0.5B's gate/up) would stay in the heap."""
    values = torch.empty(linear.out_features, linear.in_features, dtype=torch.int8)
    scales = torch.empty(linear.out_features)
    for start in range(0, linear.out_features, channels):
        stop = min(start + channels, linear.out_features)
        part = Int4Linear(linear.packed[start // LANES : -(-stop // LANES)], stop - start, None)
        values[start:stop], scales[start:stop] = quantize_weight(part.dense_weight())
    return values, scales


def speed_up_reads(model: nn.Module, repeats: int = 3, cancel: threading.Event | None = None) -> bool:
    """Give a 4-bit draft's layers int8 reads if that makes a read of many tokens faster here.
    Raises `Cancelled` once `cancel` is set (checked between linears)."""
    if os.environ.get(ENV_VAR, "1").strip() == "0" or not onednn_available():
        return False
    layers = _layers(model)
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, Int4Linear)]
    if not layers or not linears or not all(getattr(layer, "one_call", None) is not None for layer in layers):
        return False
    # Where oneDNN's sums saturate (no VNNI or AMX), the draft would read prompts wrongly.
    if not onednn_sums_exactly((MIN_ROWS, PROBE_ROWS)):
        return False
    if psutil.virtual_memory().available - sum(m.out_features * m.in_features for m in linears) < SPARE_BYTES:
        return False
    paths = {}
    for linear in linears:
        check_cancelled(cancel)
        try:
            paths[linear] = BulkReads(linear)
        except RuntimeError:  # a kernel this torch build lacks on this CPU, or no memory
            return False
    with_int8, with_int4 = [], []
    for _ in range(repeats + 1):  # interleaved, so a burst of load hits both alike
        _attach(layers, paths)
        with_int8.append(_read_seconds(model))
        _detach(layers, paths)
        with_int4.append(_read_seconds(model))
    # Medians of all but the first (it allocates): one stalled read must not decide it.
    if statistics.median(with_int8[1:]) <= MIN_GAIN * statistics.median(with_int4[1:]):
        _attach(layers, paths)
        return True
    return False


def has_bulk_reads(model: nn.Module) -> bool:
    return any(getattr(layer, "bulk_rows", sys.maxsize) < sys.maxsize for layer in _layers(model))


def _layers(model: nn.Module) -> list[Any]:  # decoder layers with FastLayer's bulk_rows
    return list(getattr(getattr(model, "model", None), "layers", None) or [])


def _attach(layers: list[Any], paths: dict[Int4Linear, BulkReads]) -> None:
    for linear, path in paths.items():
        linear.many_rows = path
    for layer in layers:
        layer.bulk_rows = MIN_ROWS  # the one-call layer steps aside from here (layers_cpu)


def _detach(layers: list[Any], paths: dict[Int4Linear, BulkReads]) -> None:
    for linear in paths:
        linear.many_rows = None
    for layer in layers:
        layer.bulk_rows = sys.maxsize


def _read_seconds(model: nn.Module) -> float:
    runner = CachedModel(model)
    vocab = model.get_input_embeddings().num_embeddings  # type: ignore[operator]
    ids = [(1000 + i) % vocab for i in range(PROBE_ROWS)]
    with torch.inference_mode():
        start = time.perf_counter()
        runner.forward(ids, logits_to_keep=1)
        return time.perf_counter() - start
