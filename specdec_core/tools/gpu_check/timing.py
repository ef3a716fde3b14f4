"""What a step costs and what it must cost: timed forwards, bytes read, memory bandwidth.

A decoding step of one sequence reads every weight once, so its floor on a device is the
bytes of the weights as stored over the device's memory bandwidth (the *bandwidth
bound*). The bandwidth is measured, not taken from a data sheet: a device-to-device copy
of a buffer far larger than any cache, which reads and writes each byte once.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ...kernels.runner import Runner


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_gb_s(device: torch.device | str, megabytes: int, repeats: int = 10) -> float:
    """Measured memory bandwidth in GB/s: bytes read plus bytes written by a copy, median."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch and any lazy allocation, untimed
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return 2 * source.numel() / statistics.median(seconds) / 1e9


def _quant_state_tensors(parameter: Any) -> list[torch.Tensor]:
    """bitsandbytes keeps a 4-bit weight's scales beside it (quant_state), not as buffers."""
    found, state = [], getattr(parameter, "quant_state", None)
    while state is not None:
        found += [t for t in (getattr(state, "absmax", None), getattr(state, "code", None)) if t is not None]
        state = getattr(state, "state2", None)
    return found


def _read_by(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors `module` itself reads: its parameters and buffers, and either the tensors it
    keeps as plain attributes (a kernel's own layout of its weights) or, without those, its
    4-bit weights' quant_state."""
    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    kept = [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
    return own + (kept or [t for p in own for t in _quant_state_tensors(p)])


def bytes_read_per_step(model: Any) -> int:
    """Bytes a one-token step reads: every tensor the model's modules read, once (a view of
    the same bytes, a tied weight, counts once), less the input embedding when it is not
    the output head too (a step reads one row of it)."""

    def extent(tensor: torch.Tensor) -> tuple[int, int]:
        return tensor.data_ptr(), tensor.numel() * tensor.element_size()

    embedding = model.get_input_embeddings()
    tied = embedding.weight is model.get_output_embeddings().weight
    skipped = set() if tied else {extent(embedding.weight)}
    extents = {extent(t) for module in model.modules() for t in _read_by(module)} - skipped
    return sum(size for _, size in extents)


def time_forwards(
    runner: Runner, context: Sequence[int], sizes: Iterable[int], repeats: int = 5
) -> dict[int, float]:
    """Median milliseconds of a forward of m tokens after `context`, device-synchronized.

    One untimed round first (a fixed-shape runner captures each shape there); then the
    sizes interleaved, so a burst of outside load hits all alike.
    """
    sizes = list(sizes)
    runner.reset()
    runner.forward(list(context), logits_to_keep=1)
    times: dict[int, list[float]] = {m: [] for m in sizes}
    for round_ in range(repeats + 1):
        for m in sizes:
            seconds = runner.time_forward(list(context), m)
            if round_ > 0:
                times[m].append(seconds * 1e3)
    runner.reset()
    return {m: statistics.median(v) for m, v in times.items()}
