"""A server process we started on 127.0.0.1: reached directly, and proved to be the one listening.

    port = free_port()
    process = subprocess.Popen([..., "--host", "127.0.0.1", "--port", str(port)])
    wait_until_serving(process, port, name="llama-server", timeout=120.0)
    status, body = request(port, "POST", "/completion", {"prompt": "Hi"}, timeout=60.0)

Rules it keeps:
- every request goes straight to 127.0.0.1:port over `http.client`: no proxy named in the
  environment (`http_proxy` would carry it elsewhere) and no redirect is followed;
- the port is the server's only while the process we started runs (checked before and
  after each health poll) and every socket that listens where a connection to
  127.0.0.1:port lands belongs to that process or one it started. A port picked free is
  closed again before the server binds it, so another program can take it meanwhile and
  answer /health in the server's place, or listen beside it where the sockets allow
  sharing a port (SO_REUSEPORT).
  A port held by another process fails in one line, and nothing is sent to it.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import psutil

from ..errors import Cancelled, ServerError

HOST = "127.0.0.1"
HEALTH_TIMEOUT_S = 2.0
POLL_S = 0.1
# Local addresses whose listener a connection to 127.0.0.1 can reach.
_REACHES_LOOPBACK = frozenset({HOST, "0.0.0.0", "::", "::ffff:127.0.0.1", "::ffff:0.0.0.0"})


def free_port() -> int:
    """A port free on 127.0.0.1 now; `wait_until_serving` proves who holds it later."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def request(
    port: int,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    *,
    key: str | None = None,
    timeout: float,
) -> tuple[int, bytes]:
    """(status, body) of one request to 127.0.0.1:port; raises OSError or HTTPException."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, path, body=data, headers=headers)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def wait_until_serving(
    process: subprocess.Popen[bytes],
    port: int,
    *,
    name: str,
    timeout: float,
    cancel: threading.Event | None = None,
    log_tail: Callable[[], str] = lambda: "",
) -> None:
    """Poll /health until `process` answers it on 127.0.0.1:port and holds the port alone.

    Raises `ServerError` (it exited, it did not answer in time, another process holds the
    port) or `Cancelled` once `cancel` is set; the caller stops the process then."""
    deadline = time.monotonic() + timeout
    while True:
        check_running(process, name, log_tail)
        status = _health(port)
        check_running(process, name, log_tail)  # an answer from a port whose server had died
        if status == 200:
            check_listener(process, port, name)
            return
        if cancel is not None and cancel.is_set():
            raise Cancelled(f"starting {name} was cancelled")
        if time.monotonic() > deadline:
            raise ServerError(f"{name} did not answer on {HOST}:{port} within {timeout:g} s")
        if cancel is not None:
            cancel.wait(POLL_S)
        else:
            with suppress(subprocess.TimeoutExpired):
                process.wait(POLL_S)


def check_running(
    process: subprocess.Popen[bytes], name: str, log_tail: Callable[[], str] = lambda: ""
) -> None:
    """Raise `ServerError` with how it ended (and its last log line) once `process` has exited."""
    code = process.poll()
    if code is None:
        return
    tail = log_tail()
    raise ServerError(f"{name} {exit_reason(code)}{': ' + tail if tail else ''}")


def check_listener(process: subprocess.Popen[bytes], port: int, name: str) -> None:
    """Raise `ServerError` unless every listener 127.0.0.1:port reaches is `process` or its child."""
    ours = _process_tree(process.pid)
    holders = _listeners(port)
    if holders is None:  # this user may not read the system's socket table: our own sockets only
        holders = [pid for pid in ours if _listens(pid, port)]
    strangers = [pid for pid in holders if pid not in ours]
    if strangers or not holders:
        raise ServerError(
            f"{_who(strangers[0] if strangers else None)} listens on {HOST}:{port}, not the {name} "
            "started here: nothing was sent to it; start the server again"
        )


def exit_reason(returncode: int) -> str:
    """How a process ended, in words: a build made for another CPU dies of SIGILL at its
    first instruction this CPU lacks, which its own log never says."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if name == "SIGILL":
        return "was killed by SIGILL (an instruction this CPU lacks: a build for another CPU, e.g. AVX-512)"
    return f"was killed by {name}"


def _health(port: int) -> int | None:
    try:
        return request(port, "GET", "/health", timeout=HEALTH_TIMEOUT_S)[0]
    except (OSError, http.client.HTTPException):
        return None  # not listening yet


def _process_tree(pid: int) -> set[int]:
    """`pid` and every process it started (a wrapper script may start the server as its child)."""
    try:
        parent = psutil.Process(pid)
        return {pid, *(child.pid for child in parent.children(recursive=True))}
    except psutil.Error:
        return {pid}


def _listeners(port: int) -> list[int | None] | None:
    """The processes listening where 127.0.0.1:port lands (None: another user's), or None
    where the system's table is closed to this user."""
    try:
        sockets = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return None
    return [
        s.pid
        for s in sockets
        if s.status == psutil.CONN_LISTEN
        and s.laddr
        and s.laddr.port == port
        and s.laddr.ip in _REACHES_LOOPBACK
    ]


def _listens(pid: int, port: int) -> bool:
    try:
        process = psutil.Process(pid)
        listing = getattr(process, "net_connections", None) or process.connections  # psutil < 6
        sockets = listing(kind="tcp")
    except psutil.Error:
        return False
    return any(s.status == psutil.CONN_LISTEN and s.laddr and s.laddr.port == port for s in sockets)


def _who(pid: int | None) -> str:
    if pid is None:
        return "a process this user cannot see"
    try:
        return f"another process ({psutil.Process(pid).name()}, pid {pid})"
    except psutil.Error:
        return f"another process (pid {pid})"
