"""ChatSession over a served engine: llama.cpp's real server (from the xllamacpp package) on
127.0.0.1 with tiny GGUFs (vLLM's and SGLang's metrics: tests/test_served_metrics.py). The
server tests skip, with the reason, where xllamacpp cannot be imported."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_gguf_convert import write_tiny_llama_gguf

from specdec_core import ChatSession, DoneEvent, GenerationParams, LoadSpec, Message, StepEvent, TokenEvent
from specdec_core.engine.events import Source
from specdec_core.errors import Cancelled, ServerError
from specdec_core.served import engines, local_server
from specdec_core.served.backend import ServedBackend
from specdec_core.served.client import ServerAddress, is_server_url

SERVER_SCRIPT = Path(__file__).with_name("llama_server.py")
HELLO = [Message("user", "hello")]


# -- a real llama.cpp server -----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """tests/llama_server.py in its own process, answering on 127.0.0.1:port."""

    def __init__(self, model: Path, *extra: str) -> None:
        pytest.importorskip("xllamacpp", reason="llama.cpp's server comes from the xllamacpp package")
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        command = [sys.executable, str(SERVER_SCRIPT), "-m", str(model), "--port", str(self.port), *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.skip("llama.cpp's server (xllamacpp) did not start on this machine")
            time.sleep(0.05)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as reply:
                return reply.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny GGUF, the same that never picks an end token: answers run to their limit)."""
    folder = tmp_path_factory.mktemp("served")
    return (
        write_tiny_llama_gguf(folder / "tiny.gguf"),
        write_tiny_llama_gguf(folder / "endless.gguf", context_length=4096, never_ends=True),
    )


@pytest.fixture(scope="module")
def speculating(models) -> Iterator[Server]:
    """The tiny model served with itself as the draft (llama.cpp's -md)."""
    server = Server(models[0], "-md", str(models[0]))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain(models) -> Iterator[Server]:
    server = Server(models[0])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def endless(models) -> Iterator[Server]:
    server = Server(models[1], "-c", "4096")
    yield server
    server.stop()


def connect(url: str, **spec: str) -> ChatSession:
    session = ChatSession()
    session.load(LoadSpec(target=url, **spec))
    return session


# -- answering ------------------------------------------------------------------------------------
def test_a_served_answer_streams_the_engines_events_with_the_servers_draft_counts(speculating):
    session = connect(speculating.url)
    assert session.info is not None and session.info.server is not None
    assert session.info.server.kind == engines.LLAMA_CPP and session.info.device == "server"
    events = list(session.answer(HELLO, params=GenerationParams(max_new_tokens=24)))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    done = events[-1]
    assert isinstance(done, DoneEvent) and sum(isinstance(e, DoneEvent) for e in events) == 1
    assert any(isinstance(e, StepEvent) for e in events)
    assert len(tokens) == done.stats.new_tokens == 24 and done.stats.stop_reason == "max_tokens"
    assert done.text == "".join(t.text for t in tokens)
    assert {t.source for t in tokens} == {Source.UNKNOWN}  # the server does not say which were drafted
    assert any(t.token_id >= 0 for t in tokens)  # ids as llama.cpp's stream lists them
    assert 0 < done.stats.accepted <= done.stats.proposed  # timings.draft_n / draft_n_accepted
    assert done.stats.drafter == "draft-simple" and session.info.server.exactness == engines.NOT_VERIFIED


def test_the_speedup_is_unknown_when_the_server_keeps_speculating_with_it_switched_off(speculating):
    # llama.cpp's current server reads no per-request draft length: the plain run it is asked
    # for at calibration still drafts, so there is no baseline to measure the speedup against.
    session = connect(speculating.url)
    session.calibrate()
    done = list(session.answer(HELLO, params=GenerationParams(max_new_tokens=8)))[-1]
    assert isinstance(done, DoneEvent)
    assert done.stats.speedup_known is False and done.stats.as_dict()["measured_speedup"] is None


def test_a_server_without_a_draft_gives_a_measured_baseline(plain):
    session = connect(plain.url)
    session.calibrate()
    done = list(session.answer(HELLO, params=GenerationParams(max_new_tokens=8)))[-1]
    assert isinstance(done, DoneEvent)
    assert done.stats.proposed == 0 and done.stats.speedup_known and done.stats.measured_speedup > 0


def test_the_exactness_check_compares_speculation_on_with_a_plain_server_token_for_token(speculating, plain):
    session = connect(speculating.url)
    result = session.check_server_exactness("hello", against=plain.url)
    assert result.drafted > 0 and result.compared > 0
    assert result.identical, result.summary()


def test_the_exactness_check_refuses_a_server_that_cannot_switch_speculation_off(speculating):
    session = connect(speculating.url)
    with pytest.raises(ServerError, match="kept speculating"):
        session.check_server_exactness("hello")


def test_stop_ends_a_served_answer_within_a_second_and_keeps_the_text(endless):
    session = connect(endless.url)
    cancel = threading.Event()
    tokens: list[TokenEvent] = []
    stopped_at = 0.0
    for event in session.answer(HELLO, params=GenerationParams(max_new_tokens=4000), cancel=cancel):
        if isinstance(event, TokenEvent):
            tokens.append(event)
            if not cancel.is_set():
                cancel.set()
                stopped_at = time.perf_counter()
        elif isinstance(event, DoneEvent):
            done = event
    assert time.perf_counter() - stopped_at < 1.0
    assert done.stats.stop_reason == "cancelled" and 0 < done.stats.new_tokens < 4000
    assert done.text == "".join(t.text for t in tokens)


def test_a_server_killed_mid_answer_ends_it_with_the_text_so_far(models):
    server = Server(models[1], "-c", "4096")
    session = connect(server.url)
    tokens: list[TokenEvent] = []
    try:
        for event in session.answer(HELLO, params=GenerationParams(max_new_tokens=4000)):
            if isinstance(event, TokenEvent):
                tokens.append(event)
                if server.process.poll() is None:
                    server.stop()
            elif isinstance(event, DoneEvent):
                done = event
    finally:
        server.stop()
    assert done.stats.stop_reason == "server_stopped" and "stream" in done.stats.note
    assert 0 < done.stats.new_tokens < 4000 and done.text == "".join(t.text for t in tokens)


# -- errors, one line each -------------------------------------------------------------------------
def test_a_wrong_port_is_one_line_that_says_connection_refused():
    with pytest.raises(ServerError, match="connection refused") as caught:
        connect(f"http://127.0.0.1:{_free_port()}/v1")
    assert "\n" not in str(caught.value)


def test_a_key_checking_server_refuses_no_key_and_takes_the_one_in_the_environment(models, monkeypatch):
    server = Server(models[0], "--api-key", "sesame")
    try:
        monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
        with pytest.raises(ServerError, match=r"HTTP 401.*set SPECDEC_API_KEY"):
            connect(server.url)
        monkeypatch.setenv("SPECDEC_API_KEY", "wrong")
        with pytest.raises(ServerError, match=r"HTTP 401.*was refused"):
            connect(server.url)
        monkeypatch.setenv("SPECDEC_API_KEY", "sesame")
        done = list(connect(server.url).answer(HELLO, params=GenerationParams(max_new_tokens=4)))[-1]
        assert isinstance(done, DoneEvent) and done.stats.new_tokens == 4
    finally:
        server.stop()


def test_a_model_the_server_does_not_serve_is_named_with_those_it_does(plain):
    with pytest.raises(ServerError, match=r"does not serve .nope. \(it serves: .*tiny\.gguf"):
        connect(plain.url, served_model="nope")


def test_a_server_that_never_answers_times_out_in_one_line():
    with socket.socket() as listener:  # accepts the connection and says nothing
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        with pytest.raises(ServerError, match=r"sent nothing for 0\.3 s"):
            ServedBackend.connect(url, read_timeout=0.3)


# -- addresses and documented metric formats -------------------------------------------------------
def test_server_addresses_keep_the_host_the_user_typed():
    address = ServerAddress.parse("http://127.0.0.1:8080/v1")
    assert (address.host, address.port, address.api_prefix, address.root) == (
        "127.0.0.1", 8080, "/v1", "http://127.0.0.1:8080",
    )  # fmt: skip
    assert ServerAddress.parse("https://gpu-box.example:8443").api_prefix == "/v1"
    assert is_server_url("HTTP://localhost:1/v1") and not is_server_url("qwen2.5-coder-1.5b-instruct")
    for bad in ("ftp://x/v1", "http://:80/v1", "http://user:pw@127.0.0.1:1/v1"):
        with pytest.raises(ServerError):
            ServerAddress.parse(bad)


def test_each_server_is_told_apart_by_its_models_reply():
    def models(owner: str) -> dict:
        return {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": owner}]}

    assert engines.identify(models("llamacpp")) == engines.LLAMA_CPP
    assert engines.identify(models("vllm")) == engines.VLLM
    assert engines.identify(models("sglang")) == engines.SGLANG
    assert engines.identify(models("openai")) == engines.OPENAI
    assert engines.served_models({"data": [{"id": "a", "aliases": ["b", "a"]}]}) == ["a", "b"]


def test_llama_cpp_timings_give_the_draft_counts():
    # A real reply's timings (llama.cpp's server with -md), as captured from a run.
    timings = {"predicted_n": 20, "predicted_ms": 5.8, "draft_n": 15, "draft_n_accepted": 12}
    assert engines.llama_cpp_counts(timings) == engines.DraftCounts(15, 12)
    assert engines.llama_cpp_counts({"predicted_n": 20}) is None  # no speculation reported


def test_a_local_server_serves_a_gguf_with_its_draft_and_stops_on_release(models, tmp_path):
    pytest.importorskip("xllamacpp", reason="llama.cpp's server comes from the xllamacpp package")
    binary = _server_binary(tmp_path)
    session = ChatSession()
    info = session.load(LoadSpec(target=str(models[0]), draft=str(models[0]), local_server=str(binary)))
    assert info.server is not None and info.server.url.startswith("http://127.0.0.1:")
    assert info.target == str(models[0])  # the file, not an address that dies with the session
    done = list(session.answer(HELLO, params=GenerationParams(max_new_tokens=8)))[-1]
    assert isinstance(done, DoneEvent) and done.stats.proposed > 0  # the draft was passed as -md
    process = session._local_server.process
    session.release()
    assert process is not None and process.poll() is not None


def test_a_local_server_stops_when_another_model_loads(models, plain, tmp_path):
    pytest.importorskip("xllamacpp", reason="llama.cpp's server comes from the xllamacpp package")
    session = ChatSession()
    session.load(LoadSpec(target=str(models[0]), local_server=str(_server_binary(tmp_path))))
    process = session._local_server.process
    session.load(LoadSpec(target=plain.url))
    assert process is not None and process.poll() is not None


def test_a_missing_server_binary_is_one_line(models, monkeypatch):
    monkeypatch.delenv("SPECDEC_LLAMA_SERVER", raising=False)
    with pytest.raises(ServerError, match="cannot start /nonexistent/llama-server"):
        ChatSession().load(LoadSpec(target=str(models[0]), local_server="/nonexistent/llama-server"))


def test_every_id_llama_cpp_streams_lands_on_its_token_and_only_held_back_tokens_lack_one(endless):
    # The same greedy answer, streamed and in one piece (whose reply lists every id): the
    # stream's ids sit at the same places; the only gaps are tokens the server held back
    # because their text ended inside a UTF-8 character (it streams no id for those).
    backend = ServedBackend.connect(endless.url)
    params = GenerationParams(max_new_tokens=64)
    tokens = [e for e in backend.complete("hello", params, None, speculation=True) if isinstance(e, TokenEvent)]
    whole = backend.client.post_json(
        "/completion",
        {"prompt": "hello", "n_predict": 64, "temperature": 0.0, "return_tokens": True, "stream": False},
    )
    assert len(tokens) == len(whole["tokens"]) == 64
    assert all(t.token_id in (-1, w) for t, w in zip(tokens, whole["tokens"], strict=True))
    held_back = [t for t in tokens if t.token_id == -1]
    assert 0 < len(held_back) < len(tokens) // 2  # the tiny byte-level vocabulary splits characters
    assert all(t.text == "" for t in held_back)  # its text comes with the next listed token
    assert all(t.token_id >= 0 for t in tokens if t.text)


def _server_binary(folder: Path) -> Path:
    binary = folder / "llama-server"  # tests/llama_server.py behind llama-server's flags
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{SERVER_SCRIPT}" "$@"\n')
    binary.chmod(0o755)
    return binary


def test_a_cancelled_local_server_start_leaves_no_process_behind(models, tmp_path, monkeypatch):
    pytest.importorskip("xllamacpp", reason="llama.cpp's server comes from the xllamacpp package")
    started: list[subprocess.Popen] = []
    popen = local_server.subprocess.Popen

    def record(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(local_server.subprocess, "Popen", record)
    cancel = threading.Event()
    cancel.set()  # closing the window while the server still loads its model
    with pytest.raises(Cancelled):
        ChatSession().load(
            LoadSpec(target=str(models[0]), local_server=str(_server_binary(tmp_path))), cancel=cancel
        )
    assert len(started) == 1 and started[0].poll() is not None


def test_a_local_server_wants_a_gguf_target(tmp_path):
    folder = tmp_path / "a-model-folder"
    folder.mkdir()
    with pytest.raises(ServerError, match=r"serves a \.gguf file, not .*a-model-folder"):
        ChatSession().load(LoadSpec(target=str(folder), local_server=str(_server_binary(tmp_path))))


def test_llama_cpps_list_of_speculation_types_is_named_without_its_none():
    from specdec_core.served.backend import speculation_named

    assert speculation_named("none,draft-simple") == "draft-simple"
    assert speculation_named("draft-simple") == "draft-simple"
    assert speculation_named("none") == "none" and speculation_named("") == "none"


def test_a_server_that_names_its_speculation_is_told_to_draft_with_its_draft_model(tmp_path):
    from specdec_core.served.local_server import SPEC_FLAGS, draft_flags

    naming, older = tmp_path / "naming", tmp_path / "older"
    naming.write_text("#!/bin/sh\necho '--spec-type none,draft-simple  types of speculative decoding'\n")
    older.write_text("#!/bin/sh\necho '-md, --model-draft FNAME  draft model'\n")
    for script in (naming, older):
        script.chmod(0o755)
    assert draft_flags(str(naming)) == SPEC_FLAGS
    assert draft_flags(str(older)) == ()  # it drafts with -md alone and knows no such flag
    assert draft_flags(str(tmp_path / "missing")) == ()
