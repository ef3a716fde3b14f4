"""Progress reporting shared by fetch, conversion, loading and the benchmark — and the one
terminal bar every CLI command draws it with.

A long operation calls `progress(Progress(...))` as it goes; the terminal draws a
bar from it (`TerminalProgress`) and the app a QProgressBar. Cancellation is a
`threading.Event` the caller sets; the operation checks it between chunks and raises
`Cancelled`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from .errors import Cancelled

BYTES = "B"


@dataclass(frozen=True)
class Progress:
    stage: str  # human words: "Downloading qwen2.5-coder-1.5b-instruct", "Converting", "Loading"
    done: int  # units done
    total: int  # 0 when unknown (an indeterminate bar)
    unit: str = BYTES  # "B" for downloads and hashing; a plural noun otherwise ("tensors", "runs")
    # A message to keep, not a stage to replace: "the cached file was damaged; deleted it,
    # downloading again". A front end shows it where it stays readable (a log line, a banner).
    notice: bool = False


ProgressCallback = Callable[[Progress], None]


def check_cancelled(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled("cancelled")


class TerminalProgress:
    """The progress bar of every CLI command, on stderr: redrawn in place on a terminal,
    one line per stage otherwise (logs, pipes, CI).

    Use it as a `ProgressCallback`; `detail` adds a few words after the bar (the benchmark's
    current prompt and speed). Stages that differ only in "(part i/n)" share one bar: a
    fetch of 22 chunks is one download to the user.
    """

    WIDTH = 24

    def __init__(self, stream: TextIO | None = None, min_interval_s: float = 0.1):
        self._stream = stream
        self.interactive = self.stream.isatty()
        self.min_interval_s = min_interval_s
        self.bar: str | None = None
        self.started = 0.0
        self.start_done = 0
        self.last_draw = 0.0
        self.line_open = False  # a bar is drawn on the current line, without its newline yet

    @property
    def stream(self) -> TextIO:
        # sys.stderr looked up at each write: a bar made at import time follows a redirection.
        return self._stream or sys.stderr

    def __call__(self, p: Progress, detail: str = "") -> None:
        if p.notice:
            self.close()
            self.stream.write(f"specdec: {p.stage}\n")
            self.stream.flush()
            return
        bar = p.stage.split(" (part ")[0]
        now = time.monotonic()
        if bar != self.bar:
            self._start(bar, p, now)
        finished = p.total > 0 and p.done >= p.total
        if self.interactive and p.total > 0 and (finished or now - self.last_draw >= self.min_interval_s):
            self.stream.write("\r" + self._line(p, now, detail) + "\x1b[K")
            self.last_draw, self.line_open = now, True
        self.stream.flush()

    def close(self) -> None:
        """End the current bar's line (before printing anything else to the terminal)."""
        if self.line_open:
            self.stream.write("\n")
            self.stream.flush()
        self.bar, self.line_open = None, False

    def _start(self, bar: str, p: Progress, now: float) -> None:
        if self.line_open:
            self.stream.write("\n")
            self.line_open = False
        self.bar, self.started, self.start_done, self.last_draw = bar, now, p.done, 0.0
        if p.total == 0:
            self.stream.write(f"{p.stage}…\n")
        elif not self.interactive:
            self.stream.write(f"{bar}: {format_amount(p.total, p.unit)}\n")

    def _line(self, p: Progress, now: float, detail: str) -> str:
        filled = int(self.WIDTH * min(p.done, p.total) / p.total)
        elapsed = max(now - self.started, 1e-6)
        rate = (p.done - self.start_done) / elapsed
        amounts = f"{format_amount(p.done, p.unit)}/{format_amount(p.total, p.unit)}"
        speed = f" {human_bytes(int(rate))}/s" if p.unit == BYTES else ""
        eta = f" ETA {human_seconds((p.total - p.done) / rate)}" if rate > 0 and p.done < p.total else ""
        more = f" · {detail}" if detail else ""
        return (
            f"{p.stage} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {100 * p.done // p.total:3d}% "
            f"{amounts}{speed}{eta}{more}"
        )


def format_amount(n: int, unit: str) -> str:
    return human_bytes(n) if unit == BYTES else f"{n} {unit}"


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def human_seconds(seconds: float) -> str:
    if seconds < 90:
        return f"{int(seconds)} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
