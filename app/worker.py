"""The engine worker: a thin signal adapter over `specdec_core.session.ChatSession`.

It is a QObject living in its own QThread (the "specdec-engine" thread, see
`EngineThread`); the UI thread never runs model code. The UI asks for work through
queued signals connected to the slots below and hears back only through signals.
The session does the work and maps every failure to one `SpecdecError` line; this
adapter only turns what the session returns or yields into signals, the way
superqt's `GeneratorWorker` turns a generator's yields into signals:

- the core's own events are forwarded, never re-typed: `TokenEvent`s and
  `StepEvent`s in batches (`streamed`), a long prompt's `ReadingEvent`s, the
  `PrefillEvent`, the final `DoneEvent`;
- batches go out at most every `EMIT_INTERVAL_S`, always ending on a `StepEvent`
  (tiny or fast models commit thousands of tokens a second, and a signal per
  token would flood the UI thread's event queue);
- a read ahead (`read_ahead`) streams its `ReadAheadEvent`s with the request they
  answer; its `stop` event ends it at the next chunk, so a queued Send waits at most
  one chunk;
- the abort flag is the request's `threading.Event`, which the session checks
  between steps and between a long prompt's chunks (and fetch/conversion between
  theirs), so Stop ends an answer at the next step or chunk with stop reason
  "cancelled" and the tokens so far.

Three calls must reach the worker *while it is busy* in a slot, so they are plain
thread-safe calls instead of queued slots: `stop()` / `cancel_load()` /
`cancel_everything()` set those events, and `set_speculation()` sets the session's
flag, which the engine reads at every step.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot

from specdec_core import (
    Cancelled,
    ChatSession,
    DoneEvent,
    Event,
    GenerationParams,
    LoadSpec,
    Message,
    PrefillEvent,
    Progress,
    ReadingEvent,
    SessionInfo,
    SpecdecError,
    StepEvent,
    TokenEvent,
)

log = logging.getLogger(__name__)
EMIT_INTERVAL_S = 0.03

StreamBatch = tuple[TokenEvent | StepEvent, ...]


@dataclass(frozen=True)
class LoadRequest:
    target: str
    draft: str
    device: str
    precision: str
    offload: bool = False
    trust_remote_code: bool = False
    # Drafts to rate against the new target (the draft menu), as part of the load.
    candidates: tuple[str, ...] = ()
    # Serve the .gguf target with llama.cpp's server started on 127.0.0.1: its binary, or
    # "auto" ($SPECDEC_LLAMA_SERVER, else llama-server on PATH); "" = no local server.
    local_server: str = ""
    cancel: threading.Event = field(default_factory=threading.Event, compare=False)

    @property
    def spec(self) -> LoadSpec:
        return LoadSpec(
            target=self.target,
            draft=self.draft,
            device=self.device,
            precision=self.precision,
            offload=self.offload,
            trust_remote_code=self.trust_remote_code,
            local_server=self.local_server,
        )


@dataclass(frozen=True)
class ReadAheadRequest:
    """Read a conversation and the message being typed ahead of its Send (`read_ahead.py`)."""

    messages: tuple[Message, ...]
    typing: str
    system: str | None
    stop: threading.Event = field(default_factory=threading.Event, compare=False)


@dataclass(frozen=True)
class GenerateRequest:
    messages: tuple[Message, ...]
    system: str | None
    params: GenerationParams
    cancel: threading.Event = field(default_factory=threading.Event, compare=False)


class EngineWorker(QObject):
    loadProgress = Signal(str, int, int)  # stage, done, total (0 = unknown)
    loaded = Signal(object)  # SessionInfo
    loadFailed = Signal(str)
    loadCancelled = Signal()
    draftVerdicts = Signal(object)  # dict[str, Compatibility]
    reading = Signal(object)  # ReadingEvent: how much of a long prompt the target has read
    prefilled = Signal(object)  # PrefillEvent
    streamed = Signal(object)  # StreamBatch: TokenEvents then the StepEvent that committed them
    answerDone = Signal(object)  # DoneEvent (its text holds no stop token)
    generationFailed = Signal(str)
    readAhead = Signal(object, object)  # ReadAheadRequest, ReadAheadEvent: how far it has read

    def __init__(self, session: ChatSession | None = None) -> None:
        super().__init__()
        self.session = session or ChatSession()
        self._cancel_events: set[threading.Event] = set()
        self._lock = threading.Lock()
        self.emit_interval_s = EMIT_INTERVAL_S  # tests set 0 to see every step

    # -- thread-safe calls from the UI thread ------------------------------------------------
    def set_speculation(self, enabled: bool) -> None:
        self.session.speculation_enabled = enabled

    @property
    def speculation_enabled(self) -> bool:
        return self.session.speculation_enabled

    def stop(self, request: GenerateRequest) -> None:
        request.cancel.set()

    def cancel_load(self, request: LoadRequest) -> None:
        request.cancel.set()

    def cancel_everything(self) -> None:
        """Closing the window: whatever runs now ends at its next check."""
        with self._lock:
            for event in self._cancel_events:
                event.set()

    # -- slots (run in the worker thread) -----------------------------------------------------
    @Slot(object)
    def load(self, request: LoadRequest) -> None:
        with self._attempt(request.cancel, self.loadFailed.emit, self.loadCancelled.emit):
            self.session.load(request.spec, progress=self._progress, cancel=request.cancel)
            info = self._calibrated()
            self._rate_drafts(request.candidates)
            self.loaded.emit(info)

    @Slot(object)
    def swap_draft(self, request: LoadRequest) -> None:
        """Change only the drafter of the loaded target (no target reload)."""
        if self.session.info is None:
            return self.load(request)
        with self._attempt(request.cancel, self.loadFailed.emit, self.loadCancelled.emit):
            self.session.swap_draft(request.draft, progress=self._progress, cancel=request.cancel)
            self.loaded.emit(self._calibrated())

    @Slot(object)
    def generate(self, request: GenerateRequest) -> None:
        with self._attempt(request.cancel, self.generationFailed.emit):
            events = self.session.answer(
                request.messages, system=request.system, params=request.params, cancel=request.cancel
            )
            self._forward(events)

    @Slot(object)
    def read_ahead(self, request: ReadAheadRequest) -> None:
        """Read ahead until done or stopped; a failure is only logged: Send meets it again."""
        if request.stop.is_set():
            return  # superseded while it waited in the queue
        with self._attempt(request.stop, lambda message: log.warning("reading ahead failed: %s", message)):
            events = self.session.read_ahead(
                request.messages, request.typing, system=request.system, stop=request.stop
            )
            for event in events:
                self.readAhead.emit(request, event)

    @Slot()
    def release(self) -> None:
        self.session.release()

    # -- the adapter -------------------------------------------------------------------------
    def _forward(self, events: Iterable[Event]) -> None:
        """The session's events as signals: prefill, batched tokens and steps, done."""
        batch: list[TokenEvent | StepEvent] = []
        last_emit = time.perf_counter()
        for event in events:
            if isinstance(event, DoneEvent):
                if batch:
                    self.streamed.emit(tuple(batch))
                self.answerDone.emit(event)
                return
            if isinstance(event, ReadingEvent):
                self.reading.emit(event)
                continue
            if isinstance(event, PrefillEvent):
                self.prefilled.emit(event)
                continue
            batch.append(event)
            now = time.perf_counter()
            if isinstance(event, StepEvent) and now - last_emit >= self.emit_interval_s:
                self.streamed.emit(tuple(batch))
                batch, last_emit = [], now

    def _calibrated(self) -> SessionInfo:
        # Timing target forwards gives the speedup gauge a measured baseline (and the
        # draft-length controller real costs) from the first message on.
        self.loadProgress.emit("Warming up (timing the target)", 0, 0)
        self.session.calibrate()
        assert self.session.info is not None  # set by the load that just returned
        return self.session.info

    def _rate_drafts(self, candidates: tuple[str, ...]) -> None:
        """The session's verdicts for the draft menu, sent before `loaded`.

        Rating reads the tokenizer files of drafts on disk: a 150k-token tokenizer.json
        is parsed in one call that holds the GIL for about a second, freezing the UI
        thread meanwhile. Done as a stage of the load (behind the progress panel), it
        never delays or stalls an answer, as a request queued after `loaded` did.
        """
        if not candidates:
            return
        self.loadProgress.emit("Checking which drafts fit the target", 0, 0)
        with self._attempt(None, lambda message: log.warning("cannot rate the drafts: %s", message)):
            self.draftVerdicts.emit(self.session.rate_drafts(candidates))

    def _progress(self, progress: Progress) -> None:
        self.loadProgress.emit(progress.stage, progress.done, progress.total)

    @contextmanager
    def _attempt(
        self,
        cancel: threading.Event | None,
        failed: Callable[[str], object],
        cancelled: Callable[[], object] | None = None,
    ) -> Iterator[None]:
        """The one exception path: a failure becomes its one-line message, sent to `failed`."""
        if cancel is not None:
            with self._lock:
                self._cancel_events.add(cancel)
        try:
            yield
        except Cancelled as exc:
            cancelled() if cancelled is not None else failed(str(exc))
        except SpecdecError as exc:
            failed(str(exc))
        except Exception as exc:
            # The session maps every failure to a SpecdecError, so this is a bug: a slot's
            # exception would only be printed in this thread while the window waited for an
            # answer forever, so say it (the traceback goes to the log for a bug report).
            log.exception("the engine worker failed")
            failed(f"{type(exc).__name__}: {exc} (a bug in specdec; the log has the details)")
        finally:
            if cancel is not None:
                with self._lock:
                    self._cancel_events.discard(cancel)


class EngineThread(QThread):
    """The worker's thread, which may outlive the window that started it.

    Closing the window must not wait for the engine: a model load or a first-use
    conversion can take minutes, and even a cancelled one finishes its current
    chunk or tensor first. So `wind_down()` cancels everything, asks the thread to
    quit and returns; a thread still busy keeps itself and its worker alive (in
    `_winding_down`, not parented to the window) until it has finished. Before the
    process exits, `wait_all()` waits for those (the window is gone by then).
    """

    _winding_down: ClassVar[set[EngineThread]] = set()

    def __init__(self, worker: EngineWorker) -> None:
        super().__init__()  # no parent: destroying the window must not destroy a running thread
        self.setObjectName("specdec-engine")
        self.worker = worker
        worker.moveToThread(self)
        self.finished.connect(worker.deleteLater)

    def run(self) -> None:
        self.exec()
        # The thread's last act, after the window has gone: a llama.cpp server the session
        # started for it must not outlive it.
        self.worker.release()

    def wind_down(self, wait_ms: int = 100) -> bool:
        """Cancel, quit and wait at most `wait_ms`; True when the thread has finished."""
        self.worker.cancel_everything()
        self.quit()
        if self.wait(wait_ms):
            return True
        if not EngineThread._winding_down:
            atexit.register(EngineThread.wait_all)  # after PySide's own hooks: runs before them
        EngineThread._winding_down.add(self)
        # Queued to this object's (the UI) thread: dropped only once the thread has ended.
        self.finished.connect(self._forget, Qt.ConnectionType.QueuedConnection)
        return False

    def _forget(self) -> None:
        self.wait()  # returns at once: `finished` is the thread's last act
        EngineThread._winding_down.discard(self)

    @classmethod
    def wait_all(cls) -> None:
        """Block until every winding-down engine thread has finished (at exit, no UI left)."""
        for thread in list(cls._winding_down):
            thread.wait()
        cls._winding_down.clear()
