"""llama.cpp's server started on 127.0.0.1 for this machine, with a draft, and stopped again.

    server = LocalLlamaServer(binary, model="target.gguf", draft="draft.gguf")
    url = server.start()          # waits for /health; the URL to load as a served target
    ...
    server.stop()                 # also at interpreter exit, should the caller forget

The binary is llama.cpp's `llama-server` (or anything with its flags: -m, -md, --host,
--port): the caller's setting, else `SPECDEC_LLAMA_SERVER`. It listens on 127.0.0.1 only.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO

from ..errors import Cancelled, ServerError

BINARY_ENV = "SPECDEC_LLAMA_SERVER"
START_TIMEOUT_S = 120.0  # a large model takes a while to map before /health answers


def llama_server_binary(configured: str = "") -> str:
    """The llama-server to start: `configured`, else $SPECDEC_LLAMA_SERVER, else llama-server on PATH."""
    for candidate in (configured, os.environ.get(BINARY_ENV, ""), shutil.which("llama-server") or ""):
        if candidate:
            return candidate
    raise ServerError(
        f"no llama.cpp server binary: set {BINARY_ENV} to llama-server's path (see docs/serving.md)"
    )


class LocalLlamaServer:
    """One llama-server process on 127.0.0.1, owned by whoever started it."""

    def __init__(self, binary: str, model: str, draft: str = "", *, extra: tuple[str, ...] = ()) -> None:
        self.binary, self.model, self.draft, self.extra = binary, model, draft, extra
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = START_TIMEOUT_S, cancel: threading.Event | None = None) -> str:
        """Run the server and wait until it answers; a set `cancel` stops it and raises `Cancelled`."""
        if not (self.model.endswith(".gguf") and Path(self.model).is_file()):
            raise ServerError(
                f"llama.cpp's server serves a .gguf file, not {self.model!r}: open a GGUF file as the target"
            )
        self.port = _free_port()
        command = [
            self.binary,
            "-m",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.extra,
        ]
        if self.draft:
            command += ["-md", self.draft]
        # Its log goes to a file: a pipe nobody reads would fill and stall the server.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (open while the server runs; closed in stop)
        try:
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self._log)
        except OSError as exc:
            raise ServerError(f"cannot start {self.binary}: {exc.strerror or exc}") from None
        atexit.register(self.stop)
        self._wait_until_healthy(timeout, cancel)
        return self.url

    def _wait_until_healthy(self, timeout: float, cancel: threading.Event | None) -> None:
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if cancel is not None and cancel.is_set():
                self.stop()
                raise Cancelled("starting llama.cpp's server was cancelled")
            code = self.process.poll() if self.process else None
            if code is not None:
                raise ServerError(f"{Path(self.binary).name} exited with code {code}: {self._last_error()}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"{Path(self.binary).name} did not answer on 127.0.0.1 within {timeout:g} s"
                )
            if cancel is not None:
                cancel.wait(0.1)
            else:
                time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def _last_error(self) -> str:
        if self._log is None:
            return "no output"
        self._log.seek(0)
        lines = self._log.read().decode("utf-8", "replace").strip().splitlines()
        return lines[-1] if lines else "no output"

    def stop(self) -> None:
        """Terminate the server (kill it if it lingers); safe to call twice."""
        process, self.process = self.process, None
        log, self._log = self._log, None
        if log is not None:
            log.close()
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
