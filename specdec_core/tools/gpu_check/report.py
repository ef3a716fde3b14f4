"""A check made of parts, each run against a time budget, its results saved as it goes.

Every part gets an entry in the results, whatever happens to it: `status` is "done",
"skipped" (with `why`: the budget, or something the machine lacks), "cut" (it ran past
the time left; what it measured before is kept) or "failed" (the error's first line).
The JSON file is rewritten after every part, so a run stopped from outside keeps what
it measured; a part never vanishes silently.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

DONE, SKIPPED, CUT, FAILED = "done", "skipped", "cut", "failed"


class Skip(Exception):
    """Raised by a part that cannot run here; its message is the recorded reason."""


class OverTime(Exception):
    """The part ran past the time it was given."""


@contextmanager
def time_box(seconds: float) -> Iterator[None]:
    """Raise OverTime in this (main) thread once `seconds` have passed."""

    def _over(signum: int, frame: FrameType | None) -> None:
        raise OverTime(f"ran past its {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, _over)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Check:
    """The results document and the clock the parts share."""

    def __init__(self, out: Path, budget_s: float, header: dict[str, Any]) -> None:
        self.out = out
        self.budget_s = budget_s
        self.start = time.perf_counter()
        self.results: dict[str, Any] = {**header, "budget_s": budget_s, "parts": {}}
        self.save()

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def save(self) -> None:
        self.results["seconds"] = round(time.perf_counter() - self.start, 1)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.results, indent=1, default=str) + "\n")

    def part(
        self, name: str, needs_s: float, run: Callable[[dict[str, Any]], None], cap_s: float | None = None
    ) -> dict[str, Any]:
        """Run `run(entry)` if `needs_s` seconds are left, within the time left (and `cap_s`).

        `run` writes its figures into `entry` as it measures them, so a cut part keeps them."""
        entry: dict[str, Any] = {}
        self.results["parts"][name] = entry
        left = self.left()
        if left < needs_s:
            entry.update(
                status=SKIPPED, why=f"time budget: {left:.0f} s left, the part needs {needs_s:.0f} s"
            )
        else:
            started = time.perf_counter()
            try:
                with time_box(min(left, cap_s) if cap_s is not None else left):
                    run(entry)
                entry["status"] = DONE
            except Skip as exc:
                entry.update(status=SKIPPED, why=str(exc))
            except OverTime as exc:
                entry.update(status=CUT, why=str(exc))
            except Exception as exc:  # a part's failure is a finding, not the end of the check
                first = (str(exc).strip().splitlines() or [""])[0]
                entry.update(status=FAILED, why=f"{type(exc).__name__}: {first}"[:300])
            entry["seconds"] = round(time.perf_counter() - started, 1)
        print(f"[{name}] {entry['status']}" + (f": {entry['why']}" if "why" in entry else ""), flush=True)
        self.save()
        return entry
