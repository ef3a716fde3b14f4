"""Whom a served engine trusts: the local server's port, proxies and key, and where the user's
API key may go. The server tests run llama.cpp's server (tests/llama_server.py, xllamacpp)
and skip, with the reason, where xllamacpp cannot be imported."""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import psutil
import pytest
from test_gguf_convert import write_tiny_llama_gguf
from test_served import HELLO, Server, _free_port, _server_binary

from specdec_core import ChatSession, DoneEvent, GenerationParams, LoadSpec
from specdec_core.errors import ServerError
from specdec_core.served import local_server
from specdec_core.served.client import ServerAddress, api_key
from specdec_core.tools.cli import main

KEY_VARIABLES = ("SPECDEC_API_KEY", "SPECDEC_API_HOST")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("trust") / "tiny.gguf")


@pytest.fixture(scope="module")
def keyed(model) -> Iterator[Server]:
    """A server that wants the key "sesame"."""
    server = Server(model, "--api-key", "sesame")
    yield server
    server.stop()


@pytest.fixture
def no_user_key(monkeypatch):
    """No key from the environment and no keyring package: only what a test sets."""
    for name in KEY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "keyring", None)  # `import keyring` fails, as when not installed


def _binary(tmp_path: Path) -> str:
    pytest.importorskip("xllamacpp", reason="llama.cpp's server comes from the xllamacpp package")
    return str(_server_binary(tmp_path))


def _status_without_key(url: str, path: str = "/v1/models") -> int:
    address = ServerAddress.parse(url)
    conn = http.client.HTTPConnection(address.host, address.port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


# -- the local server: direct, its own port, its own key --------------------------------------------
def test_a_local_server_starts_and_answers_behind_a_proxy_set_in_the_environment(
    model, tmp_path, monkeypatch, no_user_key
):
    dead_proxy = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, dead_proxy)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    server = local_server.LocalLlamaServer(_binary(tmp_path), str(model))
    try:
        url = server.start(timeout=30)
        session = ChatSession()
        session._connect(LoadSpec(target=url), key=server.api_key)
        done = list(session.answer(HELLO, params=GenerationParams(max_new_tokens=4)))[-1]
        assert isinstance(done, DoneEvent) and done.stats.new_tokens == 4
    finally:
        server.stop()


class _Impostor:
    """Another program on the port: answers /health with 200 and records what it is sent."""

    def __init__(self, port: int, *, share: bool) -> None:
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                seen.append((self.path, self.headers.get("Authorization")))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_POST = do_GET

        class Server(HTTPServer):
            def server_bind(self):
                if share:  # a listener that lets another join its port
                    self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                super().server_bind()

        self.server = Server(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("share", [False, True], ids=["taken", "shared"])
def test_a_port_another_process_listens_on_fails_in_one_line_and_gets_no_prompt_or_key(
    model, tmp_path, monkeypatch, share
):
    # The port picked free is taken before llama-server binds it, by a program that answers
    # /health (alone, or one that lets another listener join the port).
    from specdec_core.served import loopback

    port = _free_port()
    impostor = _Impostor(port, share=share)
    monkeypatch.setattr(loopback, "free_port", lambda: port)
    started: list[subprocess.Popen] = []
    popen = local_server.subprocess.Popen

    def record(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(local_server.subprocess, "Popen", record)
    binary = _binary(tmp_path)
    try:
        with pytest.raises(ServerError) as caught:
            ChatSession().load(LoadSpec(target=str(model), local_server=binary))
    finally:
        impostor.close()
    message = str(caught.value)
    assert "\n" not in message
    assert f"listens on 127.0.0.1:{port}, not the llama-server started here" in message
    assert all(path == "/health" and auth is None for path, auth in impostor.seen)
    assert len(started) == 1 and started[0].poll() is not None  # ours was stopped


def test_the_listener_check_accepts_the_server_and_names_a_stranger(tmp_path):
    # The rule itself, on two plain listeners: one is the child we started, one is not.
    script = "import socket,sys,time\ns=socket.socket()\ns.bind(('127.0.0.1',int(sys.argv[1])))\ns.listen()\n"
    script += "print('up',flush=True)\ntime.sleep(60)\n"
    from specdec_core.served import loopback

    port = _free_port()
    child = subprocess.Popen([sys.executable, "-c", script, str(port)], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        loopback.check_listener(child, port, "server")  # ours: no error
        with socket.socket() as stranger:
            stranger.bind(("127.0.0.1", 0))
            stranger.listen()
            other = stranger.getsockname()[1]
            with pytest.raises(
                ServerError, match=rf"pid {psutil.Process().pid}\) listens on 127.0.0.1:{other}"
            ):
                loopback.check_listener(child, other, "server")
    finally:
        child.kill()
        child.wait()


def test_the_local_server_refuses_a_request_without_its_own_fresh_key(model, tmp_path, no_user_key):
    binary = _binary(tmp_path)
    session = ChatSession()
    try:
        info = session.load(LoadSpec(target=str(model), local_server=binary))
        assert info.server is not None
        assert _status_without_key(info.server.url) == 401
        assert _status_without_key(info.server.url, "/health") == 200  # health is public
        done = list(session.answer(HELLO, params=GenerationParams(max_new_tokens=4)))[-1]
        assert isinstance(done, DoneEvent) and done.stats.new_tokens == 4  # our client sends its key
        first = session._local_server
        assert first is not None and first.api_key and first.process is not None
        assert not any(first.api_key in word for word in psutil.Process(first.process.pid).cmdline())
        session.load(LoadSpec(target=str(model), local_server=binary))  # a restart: a new key
        assert session._local_server is not None and session._local_server.api_key != first.api_key
    finally:
        session.release()


def test_a_local_server_that_died_is_sent_nothing_more_even_with_its_port_taken(model, tmp_path, no_user_key):
    session = ChatSession()
    session.load(LoadSpec(target=str(model), local_server=_binary(tmp_path)))
    server = session._local_server
    assert server is not None and server.process is not None
    server.process.kill()
    server.process.wait()
    impostor = _Impostor(server.port, share=False)  # another program takes the freed port
    try:
        with pytest.raises(ServerError, match=r"^llama-server was killed by SIGKILL"):
            list(session.answer(HELLO, params=GenerationParams(max_new_tokens=4)))
    finally:
        impostor.close()
        session.release()
    assert impostor.seen == []


# -- the user's key: only to the host it is for -----------------------------------------------------
def test_the_environment_key_goes_to_this_machine_only_unless_a_host_is_named(monkeypatch, no_user_key):
    monkeypatch.setenv("SPECDEC_API_KEY", "sesame")
    local = api_key(ServerAddress.parse("http://127.0.0.1:8080/v1"))
    assert local.key == "sesame" and local.notices == ()
    remote = api_key(ServerAddress.parse("http://gpu-box:8000/v1"))
    assert remote.key is None
    (notice,) = remote.notices
    assert "not sent to gpu-box:8000" in notice and "SPECDEC_API_HOST=gpu-box:8000" in notice


def test_a_named_host_gets_the_key_on_its_port_with_a_warning_over_plain_http(monkeypatch, no_user_key):
    monkeypatch.setenv("SPECDEC_API_KEY", "sesame")
    monkeypatch.setenv("SPECDEC_API_HOST", "GPU-box:8000")
    plain = api_key(ServerAddress.parse("http://gpu-box:8000/v1"))
    assert plain.key == "sesame" and len(plain.notices) == 1 and "over plain http" in plain.notices[0]
    assert api_key(ServerAddress.parse("https://gpu-box:8000/v1")).notices == ()
    for elsewhere in ("http://gpu-box:9000/v1", "http://other-box:8000/v1", "http://127.0.0.1:8000/v1"):
        choice = api_key(ServerAddress.parse(elsewhere))
        assert choice.key is None and "it goes only to GPU-box:8000" in choice.notices[0]
    monkeypatch.setenv("SPECDEC_API_HOST", "gpu-box")  # no port: any port of that host
    assert api_key(ServerAddress.parse("https://gpu-box:9000/v1")).key == "sesame"
    monkeypatch.setenv("SPECDEC_API_HOST", "gpu-box:port")
    with pytest.raises(ServerError, match=r"^SPECDEC_API_HOST='gpu-box:port' is not a host: use HOST"):
        api_key(ServerAddress.parse("https://gpu-box:9000/v1"))


def test_a_key_meant_for_another_host_is_not_sent_and_the_refusal_says_why(keyed, monkeypatch, no_user_key):
    monkeypatch.setenv("SPECDEC_API_KEY", "sesame")
    monkeypatch.setenv("SPECDEC_API_HOST", "gpu-box:8000")
    with pytest.raises(
        ServerError, match=r"HTTP 401.*SPECDEC_API_KEY was not sent to 127\.0\.0\.1.*gpu-box:8000"
    ):
        ChatSession().load(LoadSpec(target=keyed.url))
    monkeypatch.setenv("SPECDEC_API_HOST", f"127.0.0.1:{ServerAddress.parse(keyed.url).port}")
    info = ChatSession().load(LoadSpec(target=keyed.url))
    assert "SPECDEC_API_KEY" not in info.warning


def test_the_session_and_the_cli_say_in_one_line_that_the_key_was_withheld(
    model, monkeypatch, capsys, no_user_key
):
    server = Server(model)
    try:
        monkeypatch.setenv("SPECDEC_API_KEY", "sesame")
        monkeypatch.setenv("SPECDEC_API_HOST", "gpu-box")
        withheld = f"SPECDEC_API_KEY was not sent to 127.0.0.1:{server.port}: it goes only to gpu-box"
        info = ChatSession().load(LoadSpec(target=server.url))
        assert info.warning.startswith(withheld)  # the window shows the session's warning
        argv = [
            "generate",
            "--server",
            server.url,
            "--prompt",
            "hi",
            "--max-new-tokens",
            "2",
            "--no-calibrate",
        ]
        assert main(argv) == 0
        warnings = [
            line for line in capsys.readouterr().err.splitlines() if line.startswith("specdec: warning:")
        ]
        assert len(warnings) == 1 and warnings[0].startswith(f"specdec: warning: {withheld}")
    finally:
        server.stop()


# -- the keyring ------------------------------------------------------------------------------------
class _NoKeyringError(RuntimeError):
    pass


def _keyring(failure: Exception) -> types.ModuleType:
    module = types.ModuleType("keyring")
    module.errors = types.SimpleNamespace(NoKeyringError=_NoKeyringError)  # type: ignore[attr-defined]

    def get_password(service: str, user: str) -> str:
        raise failure

    module.get_password = get_password  # type: ignore[attr-defined]
    return module


def test_a_failing_keyring_is_reported_as_itself_not_as_a_missing_key(keyed, monkeypatch, no_user_key):
    monkeypatch.setitem(sys.modules, "keyring", _keyring(OSError("the collection is locked")))
    with pytest.raises(ServerError) as caught:
        ChatSession().load(LoadSpec(target=keyed.url))
    message = str(caught.value)
    assert "HTTP 401" in message and "\n" not in message
    assert "the system keyring could not be read for http://127.0.0.1:" in message
    assert "OSError: the collection is locked" in message and "set SPECDEC_API_KEY" not in message


def test_a_keyring_without_a_backend_is_no_keyring(monkeypatch, no_user_key):
    monkeypatch.setitem(sys.modules, "keyring", _keyring(_NoKeyringError("no backend")))
    choice = api_key(ServerAddress.parse("http://127.0.0.1:8080/v1"))
    assert (choice.key, choice.notices) == (None, ())
