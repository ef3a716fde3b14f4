#!/usr/bin/env python3
"""llama.cpp's server from the `xllamacpp` package, started with llama-server's flags.

The served-engine tests (and `specdec`'s local-server path, given this file as the binary)
run it as a real HTTP server on 127.0.0.1: `xllamacpp.Server` is llama.cpp's own server
code, listening on the port it is given. Flags: -m, -md, --host, --port, -c, --api-key,
--draft-max, -t; the API key may come from $LLAMA_API_KEY, as llama-server reads it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("-md", "--model-draft", default="")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("-c", "--ctx-size", type=int, default=0)
    parser.add_argument("--api-key", default=os.environ.get("LLAMA_API_KEY", ""))
    parser.add_argument("--draft-max", type=int, default=4)
    parser.add_argument("-t", "--threads", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    import xllamacpp

    args = parse(argv)
    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.hostnames = [args.host]
    params.port = args.port
    params.n_ctx = args.ctx_size
    params.n_parallel = 1
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.endpoint_metrics = True
    if args.api_key:
        params.api_keys = [args.api_key]
    if args.model_draft:
        params.speculative.draft.mparams.path = args.model_draft
        params.speculative.types = [xllamacpp.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE]
        params.speculative.draft.n_max = args.draft_max
        params.speculative.draft.n_min = 0
    server = xllamacpp.Server(params)  # listens once the model is loaded
    print(f"listening on {server.listening_address}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()


if __name__ == "__main__":
    main(sys.argv[1:])
