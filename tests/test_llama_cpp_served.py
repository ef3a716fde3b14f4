"""llama.cpp's own server as built for this machine: the app's local server drafts with its
draft model, and the split across machines runs for real on one (two `ggml-rpc-server`
processes on 127.0.0.1 lend their compute to `llama-server --rpc`, which serves a target with
its draft; `specdec generate --server` and the window answer through it; docs/serving.md).

Runs where `scripts/build-llama-cpp` has built the binaries (`make test-parity` builds them,
and CI runs it); skips with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from llama_cpp_tools import find
from test_gguf_convert import write_tiny_llama_gguf

from specdec_core.served.local_server import draft_flags

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

RPC_SERVER = "ggml-rpc-server"
HELPERS = 2
START_S = 60.0


@dataclass
class Split:
    url: str
    log: Path  # llama-server's output: where it put each model's layers
    helpers: list[str]  # the helpers' host:port


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(ready, process: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"{what} did not start: {' | '.join(tail)}")
        time.sleep(0.1)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def built() -> Path:
    """The folder of llama.cpp's binaries built for this machine."""
    found = find()
    if isinstance(found, str):
        pytest.skip(found)
    if not (found.bin / RPC_SERVER).is_file():
        pytest.skip(f"{found.bin} has no {RPC_SERVER} (scripts/build-llama-cpp builds it)")
    return found.bin


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny target and a smaller draft of the same vocabulary, answers running to their limit."""
    folder = tmp_path_factory.mktemp("pair")
    return (
        write_tiny_llama_gguf(folder / "target.gguf", hidden=128, ffn=256, never_ends=True, context_length=1024),
        write_tiny_llama_gguf(folder / "draft.gguf", never_ends=True, context_length=1024),
    )


@pytest.fixture(scope="module")
def split(built, pair, tmp_path_factory) -> Iterator[Split]:
    folder = tmp_path_factory.mktemp("rpc")
    target, draft = pair
    processes: list[subprocess.Popen] = []
    try:
        helpers = []
        for index in range(HELPERS):
            port, log = _free_port(), folder / f"helper-{index}.log"
            helper = subprocess.Popen(
                [str(built / RPC_SERVER), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                stdout=log.open("wb"), stderr=subprocess.STDOUT,
            )  # fmt: skip
            processes.append(helper)
            _wait(lambda port=port: _listening(port), helper, RPC_SERVER, log)
            helpers.append(f"127.0.0.1:{port}")
        port, log = _free_port(), folder / "llama-server.log"
        server = subprocess.Popen(
            [str(built / "llama-server"), "-m", str(target), "-md", str(draft), "--rpc", ",".join(helpers),
             "-ngl", "99", "-ngld", "99", "-c", "1024", "--host", "127.0.0.1", "--port", str(port), "-t", "1",
             "-lv", "4", *draft_flags(str(built / "llama-server"))],  # -lv 4: the log says which device holds what
            stdout=log.open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        processes.append(server)
        _wait(lambda: _healthy(port), server, "llama-server --rpc", log)
        yield Split(f"http://127.0.0.1:{port}/v1", log, helpers)
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_the_helpers_hold_the_models_layers(split):
    log = split.log.read_text(errors="replace")
    for helper in split.helpers:  # each helper holds weights: "RPC0[127.0.0.1:port] model buffer size"
        assert f"[{helper}] model buffer size" in log, log[-3000:]


def test_generate_answers_through_the_split_with_the_servers_draft(split, capsys):
    from specdec_core.tools.cli import main

    code = main(["generate", "--server", split.url, "--prompt", "hello", "--max-new-tokens", "24", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["tokens"]) == 24 and doc["text"]
    assert doc["stats"]["drafter"] == "draft-simple" and doc["stats"]["proposed"] > 0


def test_the_window_answers_through_the_split(qtbot, split, tmp_path, monkeypatch):
    from PySide6.QtCore import Qt
    from specdec_app.main import build_main_window

    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / "data"))
    window = build_main_window(["--server", split.url, "--theme", "light"])
    qtbot.addWidget(window)
    window.show()
    with qtbot.waitSignal(window.modelReady, timeout=60_000):
        pass
    window.side.generation.max_new_tokens.setValue(16)
    window.prompt.setPlainText("hello")
    with qtbot.waitSignal(window.answerFinished, timeout=60_000) as blocker:
        qtbot.keyClick(window.prompt, Qt.Key.Key_Return)
    message = blocker.args[0]
    assert len(message.tokens) == 16 and message.content in window.view.toPlainText()


def test_the_apps_local_server_drafts_with_its_draft_model(built, pair):
    from specdec_core import ChatSession, GenerationParams, LoadSpec, Message
    from specdec_core.engine.events import DoneEvent

    session = ChatSession()  # as the window's "Start llama.cpp's server" does
    session.load(LoadSpec(target=str(pair[0]), draft=str(pair[1]), local_server=str(built / "llama-server")))
    try:
        done = list(session.answer([Message("user", "hello")], params=GenerationParams(max_new_tokens=24)))[-1]
        assert isinstance(done, DoneEvent) and done.stats.new_tokens == 24
        assert done.stats.drafter == "draft-simple" and done.stats.proposed > 0  # it drafted
    finally:
        session.release()
