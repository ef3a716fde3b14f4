"""Progress reporting shared by fetch, conversion and loading.

A long operation calls `progress(Progress(...))` as it goes; the terminal draws a
bar from it and the app a QProgressBar. Cancellation is a `threading.Event` the
caller sets; the operation checks it between chunks and raises `Cancelled`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from .errors import Cancelled


@dataclass(frozen=True)
class Progress:
    stage: str  # human words: "Downloading qwen2.5-coder-1.5b-instruct", "Converting", "Loading"
    done: int  # units done (bytes for downloads; steps otherwise)
    total: int  # 0 when unknown (an indeterminate bar)


ProgressCallback = Callable[[Progress], None]


def check_cancelled(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled("cancelled")
