"""Python's garbage collector runs only on the UI thread.

CPython collects cycles in whichever thread happens to allocate when a threshold
is crossed — here usually the engine thread, which allocates heavily while loading
a model. If that collection frees a cycle holding a Qt object of the UI thread (a
closed window, a dialog, a connected lambda), Qt destroys it from the wrong thread
and the process segfaults (seen as a crash inside `from_pretrained` after a window
was closed). So automatic collection is switched off and the UI thread collects on
a timer, the pattern pyqtgraph's GarbageCollector uses for the same reason.
"""

from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer

INTERVAL_MS = 1000


class UiThreadGarbageCollector(QObject):
    """Owns the collector while it lives; create it on the UI thread, once."""

    def __init__(self, parent: QObject | None = None, interval_ms: int = INTERVAL_MS) -> None:
        super().__init__(parent)
        self._threshold = gc.get_threshold()
        gc.disable()
        self._timer = QTimer(self)
        self._timer.timeout.connect(self.check)
        self._timer.start(interval_ms)

    def check(self) -> None:
        """Collect the generations whose thresholds have been crossed, as gc would."""
        counts = gc.get_count()
        for generation in (2, 1, 0):
            if counts[generation] > self._threshold[generation]:
                gc.collect(generation)
                return


_guard: UiThreadGarbageCollector | None = None


def install(app: QObject) -> None:
    """Collect on `app`'s thread from now on (idempotent)."""
    global _guard
    if _guard is None:
        _guard = UiThreadGarbageCollector(app)
