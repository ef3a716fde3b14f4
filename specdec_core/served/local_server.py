"""llama.cpp's server started on 127.0.0.1 for this machine, with a draft, and stopped again.

    server = LocalLlamaServer(binary, model="target.gguf", draft="draft.gguf")
    url = server.start()          # waits for /health; the URL to load as a served target
    ...
    server.stop()                 # also at interpreter exit, should the caller forget

The binary is llama.cpp's `llama-server` (or anything with its flags: -m, -md, --host,
--port, and its API key from `LLAMA_API_KEY`): the caller's setting, else
`SPECDEC_LLAMA_SERVER`. It listens on 127.0.0.1 only, and `start` proves that the process
it started is the one answering there (`loopback`). Each start gets a fresh random API key
(`api_key`, for the client): the server refuses every request without it but its health
check, so another local program cannot use it. The key goes in the child's environment,
not its command line, which any user of the machine may read.
"""

from __future__ import annotations

import atexit
import functools
import http.client
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import IO

from ..errors import ServerError
from . import loopback

BINARY_ENV = "SPECDEC_LLAMA_SERVER"
KEY_ENV = "LLAMA_API_KEY"  # llama-server's --api-key, read from its environment
START_TIMEOUT_S = 120.0  # a large model takes a while to map before /health answers


def llama_server_binary(configured: str = "") -> str:
    """The llama-server to start: `configured`, else $SPECDEC_LLAMA_SERVER, else llama-server on PATH."""
    for candidate in (configured, os.environ.get(BINARY_ENV, ""), shutil.which("llama-server") or ""):
        if candidate:
            return candidate
    raise ServerError(
        f"no llama.cpp server binary: set {BINARY_ENV} to llama-server's path (see docs/serving.md)"
    )


# llama.cpp's servers that name their speculation (`--spec-type`, default none) only draft
# with the draft model when told to; older ones draft whenever -md is given, and know no such flag.
SPEC_FLAGS = ("--spec-type", "draft-simple")


@functools.cache
def draft_flags(binary: str) -> tuple[str, ...]:
    """What makes `binary` draft with its -md model: SPEC_FLAGS where its help names them."""
    try:
        done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return SPEC_FLAGS if SPEC_FLAGS[0] in done.stdout + done.stderr else ()


class LocalLlamaServer:
    """One llama-server process on 127.0.0.1, owned by whoever started it."""

    def __init__(self, binary: str, model: str, draft: str = "", *, extra: tuple[str, ...] = ()) -> None:
        self.binary, self.model, self.draft, self.extra = binary, model, draft, extra
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.port = 0
        self.api_key = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = START_TIMEOUT_S, cancel: threading.Event | None = None) -> str:
        """Run the server and wait until it answers; a set `cancel` stops it and raises `Cancelled`."""
        if not (self.model.endswith(".gguf") and Path(self.model).is_file()):
            raise ServerError(
                f"llama.cpp's server serves a .gguf file, not {self.model!r}: open a GGUF file as the target"
            )
        self.port = loopback.free_port()
        self.api_key = secrets.token_urlsafe(32)
        command = [
            self.binary,
            "-m",
            self.model,
            "--host",
            loopback.HOST,
            "--port",
            str(self.port),
            *self.extra,
        ]
        if self.draft:
            command += ["-md", self.draft, *draft_flags(self.binary)]
        # Its log goes to a file: a pipe nobody reads would fill and stall the server.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (open while the server runs; closed in stop)
        try:
            self.process = subprocess.Popen(
                command,
                stdout=subprocess.DEVNULL,
                stderr=self._log,
                env={**os.environ, KEY_ENV: self.api_key},
            )
        except OSError as exc:
            raise ServerError(f"cannot start {self.binary}: {exc.strerror or exc}") from None
        atexit.register(self.stop)
        try:
            loopback.wait_until_serving(
                self.process,
                self.port,
                name=Path(self.binary).name,
                timeout=timeout,
                cancel=cancel,
                log_tail=self._last_error,
            )
            self._check_key_required()
        except BaseException:
            self.stop()
            raise
        return self.url

    def check_running(self) -> None:
        """Raise `ServerError` once the server has ended: its port is then anyone's to take,
        so nothing more (no prompt, no key) may be sent there."""
        if self.process is None:
            raise ServerError(f"{Path(self.binary).name} was stopped: load the model again to restart it")
        loopback.check_running(self.process, Path(self.binary).name, self._last_error)

    def _check_key_required(self) -> None:
        """A server that answers without its key would serve any local program: refuse it."""
        try:
            status, _ = loopback.request(self.port, "GET", "/v1/models", timeout=loopback.HEALTH_TIMEOUT_S)
        except (OSError, http.client.HTTPException) as exc:
            raise ServerError(f"{Path(self.binary).name} stopped answering on {self.url}: {exc}") from None
        if status not in (401, 403):
            raise ServerError(
                f"{Path(self.binary).name} answers without the API key it was given in {KEY_ENV} "
                f"(HTTP {status} to a request without it): use a llama-server that reads {KEY_ENV}"
            )

    def _last_error(self) -> str:
        if self._log is None:
            return "no output"
        self._log.seek(0)
        lines = self._log.read().decode("utf-8", "replace").strip().splitlines()
        return lines[-1].strip() if lines else "no output"

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
