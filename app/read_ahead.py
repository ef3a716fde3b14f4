"""Reading ahead while the user types: the engine reads the message box before Send.

Once the box has been still for `PAUSE_MS`, or at once after a paste, `ReadAhead` asks
the worker to read the conversation and the message so far into the model's caches
(`ChatSession.read_ahead`), so that Send reads only the rest. Typing never stops a read;
the next request (after the next pause) or Send does, at the read's next chunk, and what
it read stays cached. The UI never waits for a read: requests are queued signals and a
stop is a thread-safe event. A label says quietly how far it got.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, QTimer, Signal

from specdec_core import ReadAheadEvent

from .widgets import PromptEdit
from .worker import EngineWorker, ReadAheadRequest

# How long the box must be still before a read: a typing pause, not each keystroke.
PAUSE_MS = 500


class ReadAhead(QObject):
    requested = Signal(object)  # ReadAheadRequest, to the worker
    shown = Signal(str)  # the label's text; "" clears it

    def __init__(
        self, edit: PromptEdit, snapshot: Callable[[], ReadAheadRequest | None], parent: QObject | None = None
    ) -> None:
        super().__init__(parent)
        self._edit = edit
        self._snapshot = snapshot  # what Send would read now, or None when it cannot send
        self._current: ReadAheadRequest | None = None
        self._timer = QTimer(self, singleShot=True, interval=PAUSE_MS)
        self._timer.timeout.connect(self.read_now)
        edit.textChanged.connect(self._timer.start)
        edit.pasted.connect(self.read_now)

    def attach(self, worker: EngineWorker) -> None:
        self.requested.connect(worker.read_ahead)
        worker.readAhead.connect(self._on_progress)

    def read_now(self) -> None:
        """Ask for a read of what the box holds now; the running one stops at its next chunk."""
        self._timer.stop()
        request = self._snapshot()
        if request is None:
            return
        self.stop()
        self._current = request
        self.requested.emit(request)

    def resume(self) -> None:
        """Sending became possible again (an answer ended, a model loaded): read what waits in the box."""
        if self._edit.toPlainText().strip():
            self._timer.start()

    def stop(self) -> None:
        """Send (or a newer request): the running read ends at its next chunk, keeping what it read."""
        self._timer.stop()
        if self._current is not None:
            self._current.stop.set()
            self._current = None
            self.shown.emit("")

    def _on_progress(self, request: ReadAheadRequest, event: ReadAheadEvent) -> None:
        if request is not self._current:
            return  # a read that was stopped: Send or a newer read speaks now
        if event.cached < event.total:
            self.shown.emit(f"reading ahead: {event.cached:,} of {event.total:,} tokens")
        else:
            self.shown.emit(f"read {event.total:,} tokens ahead")
