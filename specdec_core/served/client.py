"""HTTP to an OpenAI-compatible server: JSON calls and a server-sent-events stream (stdlib only).

Rules it keeps:
- only the scheme, host and port of the URL the user gave are contacted: no redirect is
  followed and no other address is derived, so nothing beyond 127.0.0.1 is reached
  unless the user typed that address;
- the API key comes from `SPECDEC_API_KEY` for the host `SPECDEC_API_HOST` names (without
  it, for 127.0.0.1 and localhost only), else from the system keyring when the `keyring`
  package is installed (service "specdec", user: the server's root URL, so a stored key
  is bound to its server). It is sent only in the Authorization header and never written
  anywhere. A key withheld, a key sent to another machine over plain http and a keyring
  that fails are each said in one line (`KeyChoice.notices`), never taken for "no key";
- every failure is one `ServerError` line that names the server and what to do.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import os
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import ServerError

API_KEY_ENV = "SPECDEC_API_KEY"
API_HOST_ENV = "SPECDEC_API_HOST"
KEYRING_SERVICE = "specdec"
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0  # a server may read a long prompt for minutes before its first token


def is_server_url(text: str) -> bool:
    """Whether a target names a served engine rather than a local model."""
    return text.strip().lower().startswith(("http://", "https://"))


@dataclass(frozen=True)
class ServerAddress:
    """Where a server listens: its root (scheme://host:port) and the API prefix ("/v1")."""

    scheme: str
    host: str
    port: int
    api_prefix: str

    @classmethod
    def parse(cls, url: str) -> ServerAddress:
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ServerError(f"{url!r} is not a server address: use http://HOST:PORT/v1")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise ServerError(f"{url!r} has no valid port: use http://HOST:PORT/v1") from None
        if parts.username or parts.password:
            raise ServerError(f"put no password in the server address: set {API_KEY_ENV} instead")
        prefix = parts.path.rstrip("/")
        return cls(parts.scheme, parts.hostname, port, prefix or "/v1")

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def root(self) -> str:
        return f"{self.scheme}://{self.netloc}"

    @property
    def is_loopback(self) -> bool:
        """127.0.0.0/8, ::1 or localhost: this machine, which nobody on the network sees."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def __str__(self) -> str:
        return f"{self.root}{self.api_prefix}"


@dataclass(frozen=True)
class KeyChoice:
    """The key to send to one server (None: none) and what the user should know about it."""

    key: str | None
    notices: tuple[str, ...] = ()


def api_key(address: ServerAddress) -> KeyChoice:
    """The key for `address`: $SPECDEC_API_KEY where it is meant for that host, else the keyring.

    $SPECDEC_API_KEY goes to the host (and port, when given) in $SPECDEC_API_HOST only;
    without that variable, to a server on this machine only. A keyring key is stored
    under its server's root URL, so it goes to that server alone."""
    notices: list[str] = []
    key = os.environ.get(API_KEY_ENV, "").strip()
    if key:
        withheld = _withheld(address)
        if not withheld:
            return KeyChoice(key, _plain_http(address))
        notices.append(withheld)
    stored, failure = _keyring_key(address)
    if failure:
        notices.append(failure)
    if stored:
        return KeyChoice(stored, (*notices, *_plain_http(address)))
    return KeyChoice(None, tuple(notices))


def _withheld(address: ServerAddress) -> str:
    """Why $SPECDEC_API_KEY is not for `address` ("" when it is)."""
    allowed = os.environ.get(API_HOST_ENV, "").strip()
    if not allowed:
        if address.is_loopback:
            return ""
        return (
            f"{API_KEY_ENV} was not sent to {address.netloc}: it goes to a server on this machine "
            f"unless {API_HOST_ENV} names its host (set {API_HOST_ENV}={address.netloc} to send it there)"
        )
    host, port = _api_host(allowed)
    if host == address.host and port in (None, address.port):
        return ""
    return f"{API_KEY_ENV} was not sent to {address.netloc}: it goes only to {allowed} ({API_HOST_ENV})"


def _api_host(text: str) -> tuple[str, int | None]:
    """$SPECDEC_API_HOST as (host, port or None for any port): host[:port], [v6]:port or a URL."""
    parts = urlsplit(text if "://" in text else f"//{text}")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if not parts.hostname or port == -1 or parts.path.strip("/") or parts.username:
        raise ServerError(f"{API_HOST_ENV}={text!r} is not a host: use HOST or HOST:PORT, e.g. gpu-box:8000")
    return parts.hostname, port


def _plain_http(address: ServerAddress) -> tuple[str, ...]:
    if address.scheme == "https" or address.is_loopback:
        return ()
    return (
        f"the API key goes to {address.netloc} over plain http, readable by anyone on the way: "
        "serve it over https",
    )


def _keyring_key(address: ServerAddress) -> tuple[str | None, str]:
    """(the keyring's key for `address`, "" or the keyring's failure in one line)."""
    try:
        import keyring  # optional: the system's own secret store
    except ImportError:
        return None, ""
    try:
        stored = keyring.get_password(KEYRING_SERVICE, address.root)
    except Exception as exc:  # any backend's failure, said as itself
        # A keyring with no backend at all holds no key, as without the package.
        if isinstance(exc, getattr(getattr(keyring, "errors", None), "NoKeyringError", ())):
            return None, ""
        return None, f"the system keyring could not be read for {address.root}: {_reason(exc)}"
    return stored or None, ""


class ServerClient:
    """JSON requests and SSE streams to one server; each call opens its own connection."""

    def __init__(
        self,
        address: ServerAddress,
        *,
        key: str | None = None,
        key_notices: tuple[str, ...] = (),
        connect_timeout: float = CONNECT_TIMEOUT_S,
        read_timeout: float = READ_TIMEOUT_S,
    ) -> None:
        self.address = address
        self._key = key
        self._key_notices = key_notices  # why no key was sent, for a server that wants one
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout

    # -- plain calls --------------------------------------------------------------------------
    def get_json(self, path: str) -> Any:
        return _json(self._call("GET", path, None), self.address, path)

    def get_text(self, path: str) -> str:
        return self._call("GET", path, None).decode("utf-8", "replace")

    def post_json(self, path: str, body: dict[str, Any]) -> Any:
        return _json(self._call("POST", path, body), self.address, path)

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> bytes:
        conn, response = self._open(method, path, body)
        try:
            return self._read(response.read, path)
        finally:
            conn.close()

    # -- streams -----------------------------------------------------------------------------
    def stream(
        self, path: str, body: dict[str, Any], cancel: threading.Event | None = None
    ) -> Iterator[dict[str, Any]]:
        """The `data:` events of a server-sent-events reply, parsed, until `[DONE]` or the end.

        A set `cancel` closes the connection (the server then stops generating) and the
        iteration ends quietly; a read that fails otherwise raises `ServerError`. A stream
        that simply ends is not judged here: only the caller knows if its answer was over.
        """
        conn, response = self._open("POST", path, {**body, "stream": True})
        finished = threading.Event()
        watcher = threading.Thread(
            target=_close_on_cancel, args=(conn, cancel, finished), name="specdec-stream-cancel", daemon=True
        )
        if cancel is not None:
            watcher.start()
        try:
            yield from self._events(response, path, cancel)
        finally:
            finished.set()
            conn.close()

    def _events(
        self, response: http.client.HTTPResponse, path: str, cancel: threading.Event | None
    ) -> Iterator[dict[str, Any]]:
        while True:
            try:
                line = self._read(response.readline, path)
            except ServerError:
                if cancel is not None and cancel.is_set():
                    return
                raise
            if not line:
                return  # the caller knows whether the answer had ended (llama.cpp sends no [DONE])
            text = line.decode("utf-8", "replace").strip()
            if not text.startswith("data:"):
                continue  # comments, event names and the blank lines between events
            data = text[5:].strip()
            if data == "[DONE]":
                return
            try:
                event = json.loads(data)
            except json.JSONDecodeError:
                raise ServerError(
                    f"the server at {self.address} sent a stream event that is not JSON"
                ) from None
            if isinstance(event, dict):
                yield event

    # -- connection ---------------------------------------------------------------------------
    def _open(
        self, method: str, path: str, body: dict[str, Any] | None
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        address = self.address
        conn: http.client.HTTPConnection
        if address.scheme == "https":
            conn = http.client.HTTPSConnection(
                address.host, address.port, timeout=self.connect_timeout, context=ssl.create_default_context()
            )
        else:
            conn = http.client.HTTPConnection(address.host, address.port, timeout=self.connect_timeout)
        headers = {"Accept": "application/json, text/event-stream"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        try:
            conn.request(method, path, body=data, headers=headers)
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise self._unreachable(exc) from None
        if conn.sock is not None:
            conn.sock.settimeout(self.read_timeout)
        try:
            response = self._wait(conn.getresponse, path)
        except ServerError:
            conn.close()
            raise
        if response.status >= 400:
            detail = _error_detail(response)
            conn.close()
            raise self._refused(response.status, path, detail)
        return conn, response

    def _read(self, read: Any, path: str) -> bytes:
        return bytes(self._wait(read, path))

    def _wait(self, call: Any, path: str) -> Any:
        """`call()`, with a silent server or a broken connection as one `ServerError` line."""
        try:
            return call()
        except TimeoutError:
            raise ServerError(
                f"the server at {self.address} sent nothing for {self.read_timeout:g} s while answering {path}"
            ) from None
        except (OSError, http.client.HTTPException) as exc:
            raise ServerError(f"the stream from {self.address} broke off: {_reason(exc)}") from None

    def _unreachable(self, exc: BaseException) -> ServerError:
        where = self.address
        if isinstance(exc, TimeoutError):
            return ServerError(f"the server at {where} did not answer within {self.connect_timeout:g} s")
        if isinstance(exc, ConnectionRefusedError):
            return ServerError(
                f"cannot reach the server at {where}: connection refused (is it running on that port?)"
            )
        if isinstance(exc, socket.gaierror):
            return ServerError(f"cannot reach the server at {where}: unknown host {where.host!r}")
        if isinstance(exc, ssl.SSLError):
            return ServerError(f"cannot reach the server at {where}: TLS failed ({_reason(exc)})")
        return ServerError(f"cannot reach the server at {where}: {_reason(exc)}")

    def _refused(self, status: int, path: str, detail: str) -> ServerError:
        where = self.address
        said = f": {detail}" if detail else ""
        if status in (401, 403):
            if self._key:
                hint = f"the key in {API_KEY_ENV} (or the keyring) was refused"
            elif self._key_notices:
                hint = f"it wants an API key, and {'; '.join(self._key_notices)}"
            else:
                hint = f"it wants an API key: set {API_KEY_ENV} (see docs/serving.md)"
            return ServerError(f"the server at {where} refused the request (HTTP {status}): {hint}")
        if status == 404:
            return ServerError(f"the server at {where} has no {path} (HTTP 404{said})")
        return ServerError(f"the server at {where} answered HTTP {status} to {path}{said}")


def _close_on_cancel(
    conn: http.client.HTTPConnection, cancel: threading.Event | None, finished: threading.Event
) -> None:
    """Close the connection once `cancel` is set, so a blocked read returns within a tick."""
    while cancel is not None and not finished.is_set():
        if cancel.wait(0.05):
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):  # already closed by the other side
                    sock.shutdown(socket.SHUT_RDWR)
            return


def _json(data: bytes, address: ServerAddress, path: str) -> Any:
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        raise ServerError(
            f"the server at {address} answered {path} with something that is not JSON"
        ) from None


def _error_detail(response: http.client.HTTPResponse) -> str:
    """The server's own message from an error reply ({"error": {"message": ...}} or text)."""
    try:
        raw = response.read(4096)
    except (OSError, http.client.HTTPException):
        return ""
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return " ".join(raw.decode("utf-8", "replace").split())[:200]
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    message = error.get("message", "") if isinstance(error, dict) else error
    return " ".join(str(message).split())[:200]


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
