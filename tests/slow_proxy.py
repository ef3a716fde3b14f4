#!/usr/bin/env python3
"""A server slow to answer: a TCP proxy on 127.0.0.1 that holds each reply back before passing it on.

    slow_proxy.py LISTEN_PORT UPSTREAM_PORT DELAY_S

Every connection is forwarded to 127.0.0.1:UPSTREAM_PORT; the first bytes of each reply
reach the client DELAY_S seconds late, the rest as they come. The window's tests put it
in front of llama.cpp's server to show that no request runs on the UI thread.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time


def pipe(source: socket.socket, sink: socket.socket, delay: float) -> None:
    first = True
    try:
        while data := source.recv(65536):
            if first and delay:
                time.sleep(delay)  # the server's slowness: this is the server, not a test
                first = False
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)


def serve(listen_port: int, upstream_port: int, delay: float) -> None:
    listener = socket.create_server(("127.0.0.1", listen_port))
    print(f"listening on 127.0.0.1:{listen_port}", flush=True)
    while True:
        client, _ = listener.accept()
        try:
            upstream = socket.create_connection(("127.0.0.1", upstream_port))
        except OSError:
            client.close()
            continue
        threading.Thread(target=pipe, args=(client, upstream, 0.0), daemon=True).start()
        threading.Thread(target=pipe, args=(upstream, client, delay), daemon=True).start()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
