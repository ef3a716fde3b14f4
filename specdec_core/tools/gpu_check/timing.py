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
from typing import Any, Protocol

import torch


class Runner(Protocol):
    """What a timed runner offers: `kvcache.CachedModel`'s interface, or the fixed-shape step's."""

    def reset(self) -> None: ...

    def crop(self, length: int) -> None: ...

    def synchronize(self) -> None: ...

    def forward(self, new_ids: Sequence[int], logits_to_keep: int) -> torch.Tensor: ...


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


def _tensor_bytes(tensor: Any) -> int:
    return int(tensor.numel() * tensor.element_size()) if isinstance(tensor, torch.Tensor) else 0


def _quant_state_bytes(parameter: Any) -> int:
    """bitsandbytes keeps a 4-bit weight's scales beside it (quant_state), not as buffers."""
    state = getattr(parameter, "quant_state", None)
    total = 0
    while state is not None:
        total += _tensor_bytes(getattr(state, "absmax", None)) + _tensor_bytes(getattr(state, "code", None))
        state = getattr(state, "state2", None)
    return total


def bytes_read_per_step(model: Any) -> int:
    """Bytes a one-token step reads: every parameter and buffer as stored (with 4-bit scales),
    less the input embedding when it is not the output head too (a step reads one row of it)."""
    embedding = model.get_input_embeddings()
    tied = embedding.weight is model.get_output_embeddings().weight
    skip = set() if tied else {id(embedding.weight)}
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen or id(tensor) in skip:
            continue
        seen.add(id(tensor))
        total += _tensor_bytes(tensor) + _quant_state_bytes(tensor)
    return total


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
            runner.crop(len(context))
            runner.synchronize()
            start = time.perf_counter()
            runner.forward(list(context[:m]), logits_to_keep=m)
            runner.synchronize()
            if round_ > 0:
                times[m].append((time.perf_counter() - start) * 1e3)
    runner.reset()
    return {m: statistics.median(v) for m, v in times.items()}
