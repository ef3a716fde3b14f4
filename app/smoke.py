"""`specdec-chat --smoke-test PROMPT`: the real window answers one prompt, offscreen, and exits.

For packagers and CI: it proves that a build (the PyInstaller bundle in particular) starts
Qt, loads the models in the worker, and streams an answer through the real controller; with
`--precision int4` it also proves that the C kernels compile from the shipped sources and
load. The run stops the answer after its first tokens and prints one line: `smoke test ok: …`
with exit status 0, or `smoke test failed: …` with 1. Any message in the window's error
banner fails it, as does no answer within `TIMEOUT_S`.

The run never touches the user's conversations or settings: unless SPECDEC_DATA_DIR is set,
they live in a temporary folder for its length. Compiled kernels go to the user cache as in
any run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import TextIO

from PySide6.QtCore import QObject, QTimer
from PySide6.QtWidgets import QMainWindow

from specdec_core import SessionInfo

from .conversations import DATA_DIR_ENV, StoredMessage

TIMEOUT_S = 600  # loading, a first kernel compile and one answer, on a slow machine
PLATFORM_ENV = "QT_QPA_PLATFORM"
FIRST_CHARS = 60  # of the answer, in the one line printed


def use_offscreen_platform() -> None:
    """Draw into memory unless the caller picked a platform: the run needs no display."""
    os.environ.setdefault(PLATFORM_ENV, "offscreen")


@contextlib.contextmanager
def scratch_data_dir() -> Iterator[None]:
    """Conversations and settings in a temporary folder for the run, unless SPECDEC_DATA_DIR
    already points somewhere; the environment is as it was afterwards."""
    if os.environ.get(DATA_DIR_ENV):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="specdec-smoke-") as scratch:
        os.environ[DATA_DIR_ENV] = scratch
        try:
            yield
        finally:
            os.environ.pop(DATA_DIR_ENV, None)


class SmokeTest(QObject):
    """Sends `prompt` once the models are ready, stops after the first tokens, and calls `done`.

    `done` ends the caller's own event loop, not the application's: quitting the application
    would leave it closing, and every event loop started in the process after that (a
    second window's, a test's) would return at once."""

    def __init__(self, window: QMainWindow, prompt: str, done: Callable[[], None]) -> None:
        super().__init__(window)
        self.window = window
        self.prompt = prompt
        self._done = done
        self.code: int | None = None  # the exit status, once decided
        self._info: SessionInfo | None = None
        window.modelReady.connect(self._on_ready)
        window.answerProgressed.connect(self._on_progress)
        window.answerFinished.connect(self._on_finished)
        window.errorShown.connect(self._fail)
        QTimer.singleShot(TIMEOUT_S * 1000, self, lambda: self._fail(f"no answer within {TIMEOUT_S} s"))

    def _on_ready(self, info: SessionInfo) -> None:
        if self._info is not None or self.code is not None:
            return
        self._info = info
        self.window.prompt.setPlainText(self.prompt)
        self.window.send()

    def _on_progress(self, tokens: int) -> None:
        if tokens > 0:
            self.window.stop()  # the first tokens are the proof; the rest would only take time

    def _on_finished(self, message: StoredMessage) -> None:
        if not self.window.live_token_ids():
            self._fail("the answer ended without a token")
            return
        info = self._info
        where = f"{info.description}, draft {info.draft_name}" if info else "no model"
        first = message.content[:FIRST_CHARS]
        self._end(0, f"smoke test ok: first tokens {first!r} ({where})", sys.stdout)

    def _fail(self, reason: str) -> None:
        self._end(1, f"smoke test failed: {' '.join(reason.split())}", sys.stderr)

    def _end(self, code: int, line: str, stream: TextIO) -> None:
        if self.code is not None:
            return
        self.code = code
        print(line, file=stream, flush=True)
        self.window.close()  # stops the engine thread and saves, as a user's close does
        self._done()
