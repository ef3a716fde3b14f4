"""The chat window over a real served engine: llama.cpp's server (the xllamacpp package) on
127.0.0.1 with tiny GGUFs. An answer streams into the transcript with what the server can
tell (exactness not verified, speedup unknown); Stop and a server killed mid-answer keep
the text; the window starts llama.cpp's server for a .gguf target and stops it when it
closes; and no request runs on the UI thread, however slow the server. Waits on signals.

The tests skip, with the reason, where xllamacpp cannot be imported.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QElapsedTimer, Qt, QTimer
from specdec_app import model_toolbar
from specdec_app.main import build_main_window
from specdec_app.model_toolbar import LOCAL_SERVER
from test_gguf_convert import write_tiny_llama_gguf
from test_served import Server, _server_binary

TIMEOUT_MS = 60_000
PROXY_SCRIPT = Path(__file__).with_name("slow_proxy.py")
SLOW_S = 1.0  # how long the slow server holds back each reply
# Wall-clock lateness of the UI heartbeat (the bounds of test_app_window's heartbeat test).
MAX_LATE_P95_MS = 100.0
MAX_LATE_MS = 300.0


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny GGUF, the same that never picks an end token: answers run to their limit)."""
    pytest.importorskip("xllamacpp", reason="llama.cpp's server comes from the xllamacpp package")
    folder = tmp_path_factory.mktemp("served-window")
    return (
        write_tiny_llama_gguf(folder / "tiny.gguf"),
        write_tiny_llama_gguf(folder / "endless.gguf", context_length=4096, never_ends=True),
    )


@pytest.fixture(scope="module")
def speculating(models) -> Iterator[Server]:
    """The endless model served with itself as the draft (llama.cpp's -md)."""
    server = Server(models[1], "-md", str(models[1]), "-c", "4096")
    yield server
    server.stop()


@pytest.fixture
def open_window(qtbot, tmp_path, monkeypatch):
    """Build the window like `specdec chat ARGS` and wait until it is connected."""
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / "data"))
    releases: list[threading.Event] = []

    def open_(*args: str):
        window = build_main_window([*args, "--theme", "light"])
        qtbot.addWidget(window)
        window.show()
        window.worker.emit_interval_s = 0.0  # a batch per chunk: "mid-answer" is reachable
        window.releases = releases
        with qtbot.waitSignal(window.modelReady, timeout=TIMEOUT_MS):
            pass
        return window

    yield open_
    for release in releases:  # never leave a worker parked if a test failed half way
        release.set()


def _hold_first_batch(window, server: Server) -> threading.Event:
    """Park the worker thread inside the answer's first batch until the returned event is set,
    with the server frozen (SIGSTOP) there: the answer is mid-stream, however fast the server."""
    release = threading.Event()
    window.releases.append(release)
    held: list[bool] = []

    def hold(batch) -> None:  # Direct: runs in the worker thread, the UI's delivery already posted
        if not held and batch:
            held.append(True)
            os.kill(server.process.pid, signal.SIGSTOP)
            release.wait(60)

    window.worker.streamed.connect(hold, Qt.ConnectionType.DirectConnection)
    return release


def _send(qtbot, window, text: str):
    window.prompt.setPlainText(text)
    with qtbot.waitSignal(window.answerFinished, timeout=TIMEOUT_MS) as blocker:
        qtbot.keyClick(window.prompt, Qt.Key.Key_Return)
    return blocker.args[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- an answer ------------------------------------------------------------------------------------
def test_an_answer_streams_into_the_window_with_what_the_server_can_tell(qtbot, open_window, speculating):
    window = open_window("--server", speculating.url)
    assert window.pair.server is not None and window.pair.device == "server"
    assert window.side.gauges.exactness.text() == "Exactness: not verified (llama.cpp server)"
    window.side.generation.max_new_tokens.setValue(40)
    progressed: list[int] = []
    window.answerProgressed.connect(progressed.append)
    message = _send(qtbot, window, "hello")
    assert len(progressed) > 1 and progressed == sorted(progressed)  # streamed, chunk by chunk
    assert len(message.tokens) == 40 and message.content and message.content in window.view.toPlainText()
    assert not message.stopped
    # The server kept drafting when asked for a plain run at load: no baseline, so no figure.
    assert "speedup unknown" in message.footer and "faster" not in message.footer
    assert "accepted " in message.footer  # the server's own draft counts
    assert all(token_id >= -1 for token_id in window.live_token_ids())


def test_stop_ends_a_served_answer_and_keeps_its_text(qtbot, open_window, speculating):
    window = open_window("--server", speculating.url)
    window.side.generation.max_new_tokens.setValue(4000)
    release = _hold_first_batch(window, speculating)
    window.prompt.setPlainText("hello")
    try:
        with qtbot.waitSignal(window.answerProgressed, timeout=TIMEOUT_MS):
            window.send_button.click()
        clock = QElapsedTimer()
        with qtbot.waitSignal(window.answerFinished, timeout=TIMEOUT_MS) as blocker:
            qtbot.mouseClick(window.stop_button, Qt.MouseButton.LeftButton)
            clock.start()
            release.set()  # the server stays frozen: Stop must not wait for it
    finally:
        os.kill(speculating.process.pid, signal.SIGCONT)
    assert clock.elapsed() < 1000, f"Stop took {clock.elapsed()} ms over a served engine"
    stopped = blocker.args[0]
    assert stopped.stopped and stopped.footer.endswith(" · stopped")
    assert 0 < len(stopped.tokens) < 4000 and stopped.content in window.view.toPlainText()
    assert [m.role for m in window.conversation.messages] == ["user", "assistant"]


def test_a_server_killed_mid_answer_is_one_line_and_the_text_stays(qtbot, open_window, models):
    server = Server(models[1], "-c", "4096")
    try:
        window = open_window("--server", server.url)
        window.side.generation.max_new_tokens.setValue(4000)
        release = _hold_first_batch(window, server)
        window.prompt.setPlainText("hello")
        with qtbot.waitSignal(window.answerProgressed, timeout=TIMEOUT_MS):
            window.send_button.click()
        server.stop()
        with qtbot.waitSignal(window.answerFinished, timeout=TIMEOUT_MS) as blocker:
            release.set()
    finally:
        server.stop()
    message = blocker.args[0]
    reason = message.footer.split(" · stopped: ")[-1]
    assert reason != message.footer and "\n" not in reason and server.url in reason
    assert 0 < len(message.tokens) < 4000 and message.content in window.view.toPlainText()
    assert window.conversation.messages[-1].content == message.content  # kept in the conversation


# -- a server the window starts ---------------------------------------------------------------------
def test_the_window_serves_its_gguf_with_llama_cpp_and_stops_the_server_when_it_closes(
    qtbot, open_window, models, speculating, tmp_path, monkeypatch
):
    binary = _server_binary(tmp_path)
    window = open_window("--server", speculating.url)
    # The .gguf pair the entry serves, as "Open GGUF file…" in both menus would leave it.
    window.models.target = window.models.draft = str(models[0])
    asked: list[str] = []

    def answer_dialog(parent, title, label, text=""):
        asked.append(label)
        return str(binary), True

    monkeypatch.setattr(model_toolbar.QInputDialog, "getText", answer_dialog)
    menu = window.toolbar.target_menu
    index = menu.findData(LOCAL_SERVER)
    assert menu.itemText(index) == "Start llama.cpp's server…"
    with qtbot.waitSignal(window.modelReady, timeout=TIMEOUT_MS) as ready:
        window.toolbar._on_target_activated(index)
    info = ready.args[0]
    assert "tiny.gguf" in asked[0] and "127.0.0.1" in asked[0]
    assert info.target == str(models[0]) and info.server is not None
    assert info.description.startswith("llama.cpp's server started here at http://127.0.0.1:")
    assert window.settings.llama_server == str(binary) and window.settings.target == str(models[0])
    process = window.worker.session._local_server.process
    assert process is not None and process.poll() is None

    window.side.generation.max_new_tokens.setValue(8)
    message = _send(qtbot, window, "hello")
    assert len(message.tokens) == 8 and "accepted " in message.footer  # served with its -md draft

    with qtbot.waitSignal(window.modelReady, timeout=TIMEOUT_MS):  # another draft: a restart
        window.toolbar.draftChosen.emit("none", False)
    assert process.wait(10) is not None
    process = window.worker.session._local_server.process
    assert process is not None and process.poll() is None
    assert "target alone" in _send(qtbot, window, "hello").footer  # served without a draft now

    with qtbot.waitSignal(window.engine_thread.finished, timeout=TIMEOUT_MS):
        window.close()
    assert process.wait(10) is not None  # no server left behind the closed window


# -- the UI thread and the network ------------------------------------------------------------------
class SlowServer:
    """tests/slow_proxy.py in front of `upstream`: every reply starts SLOW_S late."""

    def __init__(self, upstream: Server) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        command = [sys.executable, str(PROXY_SCRIPT), str(self.port), str(upstream.port), str(SLOW_S)]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not self._listening():
            assert self.process.poll() is None and time.monotonic() < deadline, "the slow proxy did not start"

    def _listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def test_the_ui_heartbeat_stays_on_time_while_a_server_is_slow_to_answer(
    qtbot, tmp_path, monkeypatch, models
):
    """Connecting, timing and answering wait seconds on a slow server: all of it in the worker
    thread, so a 20 ms timer on the UI thread keeps arriving on time throughout."""
    upstream = Server(models[1], "-c", "4096")
    slow = SlowServer(upstream)
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / "data"))
    interval_ms = 20
    clock = QElapsedTimer()
    late: list[float] = []
    last = [0.0]

    def beat() -> None:
        now = clock.nsecsElapsed() / 1e6
        late.append(max(0.0, now - last[0] - interval_ms))
        last[0] = now

    try:
        window = build_main_window(["--server", slow.url, "--theme", "light"])
        qtbot.addWidget(window)
        timer = QTimer(window)
        timer.setTimerType(Qt.TimerType.PreciseTimer)
        timer.setInterval(interval_ms)
        timer.timeout.connect(beat)
        clock.start()
        timer.start()
        window.show()
        with qtbot.waitSignal(window.modelReady, timeout=TIMEOUT_MS):
            pass
        window.side.generation.max_new_tokens.setValue(16)
        message = _send(qtbot, window, "hello")
        timer.stop()
        beat()  # the time since the last beat counts too
    finally:
        slow.stop()
        upstream.stop()
    assert len(message.tokens) == 16
    assert clock.elapsed() > 3 * SLOW_S * 1000  # the server's delays were waited out
    ordered = sorted(late)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    assert p95 <= MAX_LATE_P95_MS, f"heartbeat p95 late by {p95:.0f} ms: {[round(x) for x in late]}"
    assert ordered[-1] <= MAX_LATE_MS, f"heartbeat late by {ordered[-1]:.0f} ms: {[round(x) for x in late]}"


def test_the_slow_proxy_really_holds_replies_back(speculating):
    # The heartbeat test means something only if the server it talks to is slow.
    slow = SlowServer(speculating)
    try:
        clock = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{slow.port}/health", timeout=10) as reply:
            assert reply.status == 200
        assert time.perf_counter() - clock >= SLOW_S
    finally:
        slow.stop()
