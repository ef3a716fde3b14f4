"""Torch's intra-op thread count, following the machine's load (`ThreadGovernor`).

Why: torch's OpenMP threads wait for each other at the end of every op. When another
process keeps one of the cores busy, the thread that shares it is descheduled for
whole time slices and every op waits for it: beside a busy process two threads lose
most of their quiet speed where one thread keeps most of its own
(docs/performance.md#beside-a-busy-process). So the thread count should be the number
of cores other processes leave free, re-checked while running.

How: about once a second (the engine calls `maybe_adjust()` once per step and before
each chunk of a long prompt; most calls only read a clock) the governor reads how busy
every core was since the last check and subtracts this process's own use: what is left
is the load of other processes.
It drops threads at once when one of ours would share a core with more than 0.15 of
a core of someone else's work, and adds one back only after two checks in a row with
a free core (hysteresis: a brief lull does not bring the collapse back).

A window says little about now when it is long: while the user reads an answer the
engine makes no calls, and a neighbour that started a second before the next message is
a sixtieth of a minute's window. So a check that comes more than `STALE_S` past due, and
the very first call, count the threads of other processes that are runnable at that
instant instead (`running_elsewhere`; Linux): a prompt read at two threads beside a
neighbour that started just before is several times slower than quiet
(docs/performance.md#measurements-behind-the-design).

At one thread, the core it leaves still has spare time: the scheduler gives another
process's busy thread half of a shared core, not all of it. So while the governor runs
fewer threads than it would on a quiet machine, the C kernels' linears share their work
with helper threads that never make the caller wait (helper_cpu.c); beside a busy
process they make every answer faster (docs/performance.md#beside-a-busy-process). The
helpers' time comes out of the neighbour's, which is still far more load than the
`UP_MARGIN` of a core under which a second thread comes back.

A thread count changed in the middle of an answer must not change its numbers. Our
int8 rows come out bitwise the same at 1 and 2 threads (tests/test_threads.py), but an
fp32 matmul's last bits depend on the thread count, so the process's governor
follows the load only once the exactness self-check has seen every count it may choose
(1 to `max_threads`) reproduce the verify and plain steps of the count it ran at
(`follow_load`, set by selfcheck.py); until then it keeps the count it has.
`SPECDEC_THREADS=N` pins N threads (the governor then only applies it); unset or `auto`
lets the governor choose between 1 and torch's initial count.

Torch keeps the OpenMP thread count per calling thread, so the governor sets it from
the thread that runs the forwards: the engine's step loop.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil
import torch

from ...errors import SpecdecError
from . import native

ENV_VAR = "SPECDEC_THREADS"
CHECK_INTERVAL_S = 1.0
FIRST_CHECK_S = 0.25  # the first decision comes early: a stalled first second is most of a short answer
# Drop a thread when it would share a core with more than this much foreign work. Low,
# because one thread with the helpers costs little when it was not needed, while two
# threads beside even a light neighbour stall at every barrier
# (docs/performance.md#beside-a-busy-process).
DOWN_MARGIN = 0.15
UP_MARGIN = 0.08  # add one when a whole core but this much is free ...
UP_CHECKS = 2  # ... on this many checks in a row
# A check this long past due reads the instant count, not the window (see the module doc).
STALE_S = 2.0


class LoadProbe(Protocol):
    def others_busy(self) -> float:
        """Cores' worth of CPU time other processes used since the last call."""
        ...


class PsutilProbe:
    """Per-CPU busy time of the machine minus this process's own CPU time."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._cpus = _usable_cpus()
        # Both counters report "since the previous call": prime them now.
        psutil.cpu_percent(percpu=True)
        self._process.cpu_percent(None)

    def others_busy(self) -> float:
        per_cpu = psutil.cpu_percent(percpu=True)
        busy = sum(per_cpu[i] for i in self._cpus if i < len(per_cpu)) / 100.0
        own = self._process.cpu_percent(None) / 100.0
        return max(0.0, busy - own)


def running_elsewhere() -> float | None:
    """Threads of other processes runnable at this instant: the kernel's count of runnable
    threads less this process's own (Linux); None where either cannot be read."""
    try:
        stat = Path("/proc/stat").read_text()
        running = int(next(line.split()[1] for line in stat.splitlines() if line.startswith("procs_running")))
        own = sum(_running(task) for task in Path("/proc/self/task").iterdir())
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return float(max(0, running - own))


def _running(task: Path) -> bool:
    """Whether one of this process's threads is runnable (its stat's state, after the name)."""
    try:
        return (task / "stat").read_text().rpartition(")")[2].split()[0] == "R"
    except (OSError, IndexError):
        return False  # a thread that ended while being read


def _usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class ThreadDecision:
    """One check: what it saw and what it chose (kept for docs and tests)."""

    others_busy: float
    free_cores: float
    threads: int


class ThreadGovernor:
    """Chooses torch's intra-op thread count from the free cores; see the module doc."""

    def __init__(
        self,
        max_threads: int | None = None,
        *,
        cores: int | None = None,
        pinned: int | None = None,
        probe: LoadProbe | None = None,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = CHECK_INTERVAL_S,
        follow_load: bool = True,
        running_now: Callable[[], float | None] | None = None,
    ) -> None:
        self.max_threads = max(1, max_threads or torch.get_num_threads())
        self.cores = cores or len(_usable_cpus())
        self.pinned = pinned
        self.follow_load = follow_load  # False: keep the thread count (results may depend on it)
        self._probe = probe
        self._running_now = running_now  # the instant count for stale checks (None: windows only)
        self._clock = clock
        self._interval_s = interval_s
        self._threads = self.max_threads
        self._next_check: float | None = None
        self._free_streak = 0
        self._sharing: bool | None = None  # what native.share_spare_core was last told
        self.last: ThreadDecision | None = None

    @property
    def threads(self) -> int:
        """The count the governor wants now (what it applies at the next step)."""
        return self.pinned if self.pinned is not None else self._threads

    def pin(self, threads: int | None) -> None:
        """Pin a thread count (None: follow the load again)."""
        if threads is not None and threads < 1:
            raise SpecdecError(f"threads must be at least 1, not {threads}")
        self.pinned = threads

    def maybe_adjust(self) -> None:
        """Called once per engine step: cheap unless a check is due."""
        if self.pinned is None:
            if not self.follow_load:
                return
            now = self._clock()
            if self._next_check is None:  # first call: start the measuring window
                self._probe = self._probe or PsutilProbe()
                self._next_check = now + min(FIRST_CHECK_S, self._interval_s)
                self._decide_from_instant()
            elif now >= self._next_check:
                stale = now - self._next_check > STALE_S
                self._next_check = now + self._interval_s
                assert self._probe is not None
                busy = self._probe.others_busy()  # also starts the next window
                if not (stale and self._decide_from_instant()):
                    self.last = self.decide(busy)
            else:
                return
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if self._sharing != self.shares_spare_core:
            self._sharing = self.shares_spare_core
            native.share_spare_core(self._sharing)

    def _decide_from_instant(self) -> bool:
        """Decide from the instant count of other runnable threads, if there is one."""
        running = self._running_now() if self._running_now is not None else None
        if running is None:
            return False
        self.last = self.decide(running)
        return True

    @property
    def shares_spare_core(self) -> bool:
        """Whether one-thread ops share with a helper: when load, not the user, took threads away."""
        return self.shares_at(self.threads)

    def shares_at(self, threads: int) -> bool:
        """Whether ops share with a helper while the governor runs `threads` threads."""
        return self.pinned is None and threads < self.max_threads

    def restart_window(self) -> None:
        """Measure the next check's load from now on.

        For CPU time that is not a neighbour's, though the probe cannot tell it apart:
        `specdec bench`'s peer server runs its request while our engine waits, so its
        two busy cores are no load on ours. Counted, they would move every method that runs
        next to one thread for a second or more, and slow it
        (docs/performance.md#measurements-behind-the-design).
        """
        if self._probe is not None:
            self._probe.others_busy()  # the probe reports "since the previous call"

    def decide(self, others_busy: float) -> ThreadDecision:
        """The thread count for this much foreign load, with hysteresis (see the module doc)."""
        free = self.cores - others_busy
        current = self._threads
        if free < current - DOWN_MARGIN:
            self._threads = max(1, min(self.max_threads, math.floor(free + DOWN_MARGIN)))
            self._free_streak = 0
        elif current < self.max_threads and free >= current + 1 - UP_MARGIN:
            self._free_streak += 1
            if self._free_streak >= UP_CHECKS:
                self._threads = current + 1
                self._free_streak = 0
        else:
            self._free_streak = 0
        return ThreadDecision(others_busy, free, self._threads)


def parse_threads_setting(text: str | None) -> int | None:
    """`auto`/empty -> None (follow the load); a whole number >= 1 -> pinned."""
    if text is None or text.strip().lower() in ("", "auto"):
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise SpecdecError(f"{ENV_VAR} must be 'auto' or a whole number of threads, not {text!r}")
    return int(text)


_default: ThreadGovernor | None = None
_default_lock = threading.Lock()


def default_governor() -> ThreadGovernor:
    """The process's governor (torch's thread pool is per process), made on first use."""
    global _default
    with _default_lock:
        if _default is None:
            # Follows the load once a self-check has shown that thread counts don't change results.
            _default = ThreadGovernor(
                pinned=parse_threads_setting(os.environ.get(ENV_VAR)),
                follow_load=False,
                running_now=running_elsewhere,
            )
        return _default
