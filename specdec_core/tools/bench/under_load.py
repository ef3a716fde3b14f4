"""Decoding speed with and without a busy neighbour, with the thread governor on and off.

A desktop always runs other processes. This times the target alone through our
engine (no drafter) in four interleaved conditions — quiet or with one
`python -c "while True: pass"` running, threads pinned at the maximum (the governor
off) or chosen by the governor — so `docs/performance.md` can show what following
the load keeps. "Quiet" means no extra busy process: whatever else the machine runs
is in the load averages the result carries.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ...engine.events import DoneEvent
from ...engine.selfcheck import check_exactness
from ...engine.speculative import GenerationParams, SpeculativeEngine
from ...kernels.cpu.threads import default_governor

BUSY_LOOP = "while True: pass"


@dataclass(frozen=True)
class LoadRun:
    busy: bool  # one extra busy process running
    governor: str  # "auto" | "pinned N"
    tokens_per_s: float  # decoding, as the engine measured it
    threads_at_end: int
    load_average: float  # 1-minute, at the start of the run


@contextmanager
def busy_neighbour(on: bool) -> Iterator[None]:
    """One process spinning on a core while the block runs (nothing when `on` is False)."""
    if not on:
        yield
        return
    process = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        yield
    finally:
        process.kill()
        process.wait()


def measure_under_load(
    engine: SpeculativeEngine, prompt_ids: Sequence[int], max_new_tokens: int = 64, repeats: int = 1
) -> list[LoadRun]:
    """quiet/busy × pinned/auto, interleaved `repeats` times; the governor is restored after."""
    # The governor follows the load only where the self-check saw thread counts not change results.
    check_exactness(engine)
    governor = default_governor()
    saved = governor.pinned
    params = GenerationParams(max_new_tokens=max_new_tokens)
    runs = []
    try:
        for _ in range(repeats):
            for busy in (False, True):
                with busy_neighbour(busy):
                    for pin in (governor.max_threads, None):
                        governor.pin(pin)
                        runs.append(_timed(engine, prompt_ids, params, busy, pin))
    finally:
        governor.pin(saved)
    return runs


def _timed(
    engine: SpeculativeEngine,
    prompt_ids: Sequence[int],
    params: GenerationParams,
    busy: bool,
    pin: int | None,
) -> LoadRun:
    load = os.getloadavg()[0]
    engine.target.reset()
    done = None
    for event in engine.generate(prompt_ids, params):
        if isinstance(event, DoneEvent):
            done = event
    assert done is not None
    return LoadRun(
        busy=busy,
        governor="auto" if pin is None else f"pinned {pin}",
        tokens_per_s=done.stats.tokens_per_second,
        threads_at_end=default_governor().threads,
        load_average=round(load, 2),
    )
