"""Python's garbage collector runs only on the UI thread.

CPython collects cycles in whichever thread happens to allocate when a threshold
is crossed — here usually the engine thread, which allocates heavily while loading
a model. If that collection frees a cycle holding a Qt object of the UI thread (a
closed window, a dialog, a connected lambda), Qt destroys it from the wrong thread
and the process segfaults (seen as a crash inside `from_pretrained` after a window
was closed). So automatic collection is switched off and the UI thread collects on
a timer, the pattern pyqtgraph's GarbageCollector uses for the same reason.

A full collection walks every tracked object, and after the imports (torch,
transformers, Qt) and a model load there are hundreds of thousands: such a
collection holds the UI thread for a few hundred milliseconds, a visible stutter
when it lands in an answer (issue #57). So what is alive once a load has ended is
frozen (`gc.freeze`): later collections walk only what was allocated since. It is
frozen without a collection first, which would be that same pause at "Ready": the few
cycles the load left behind (small objects, no tensors) wait for the next load, which
thaws everything so that the pair it replaces can be collected.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

from PySide6.QtCore import QObject, QTimer

INTERVAL_MS = 1000


class UiThreadGarbageCollector(QObject):
    """Owns the collector while it lives; create it on the UI thread, once."""

    def __init__(self, parent: QObject | None = None, interval_ms: int = INTERVAL_MS) -> None:
        super().__init__(parent)
        gc.disable()
        self._timer = QTimer(self)
        self._timer.timeout.connect(collect_due)
        self._timer.start(interval_ms)


def collect_due() -> None:
    """Collect the oldest generation whose threshold has been crossed, as gc itself would."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    for generation in (2, 1, 0):
        if counts[generation] > thresholds[generation]:
            gc.collect(generation)
            return


def freeze_long_lived() -> None:
    """Keep what is alive out of later collections: call on the UI thread when a load has
    ended (its objects live as long as the pair)."""
    gc.freeze()


def thaw() -> None:
    """Let collections walk the frozen objects again: call when a load begins, so that
    the pair it replaces is collected even where it is held by reference cycles."""
    gc.unfreeze()


_guard: UiThreadGarbageCollector | None = None


def install(app: QObject) -> None:
    """Collect on `app`'s thread from now on (idempotent)."""
    global _guard
    if _guard is None:
        _guard = UiThreadGarbageCollector(app)


@contextmanager
def suspended() -> Iterator[None]:
    """No timed collections inside: for measuring the UI thread's own work without the
    collector's pauses (which scale with what was allocated, not with what is drawn)."""
    timer = _guard._timer if _guard is not None else None
    if timer is not None:
        timer.stop()
    try:
        yield
    finally:
        if timer is not None:
            timer.start()
