"""llama.cpp's own tools, run on tiny models: its converter, llama-quantize, llama-perplexity.

The build is the one `scripts/build-llama-cpp` makes for this CPU model (its converter is in
the sources beside it), or the folder of binaries `SPECDEC_LLAMA_CPP_BIN` names, with the
converter in `SPECDEC_LLAMA_CPP_SRC` (default: two folders above the binaries, where a
CMake build of llama.cpp puts them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from specdec_core.tools.bench.llama_server import built_for_this_cpu

TOOLS = ("llama-perplexity", "llama-quantize")
CONVERTER = Path(__file__).with_name("llama_convert.py")
TIMEOUT_S = 300


class LlamaCpp:
    def __init__(self, bin_dir: Path, src_dir: Path) -> None:
        self.bin, self.src = bin_dir, src_dir

    def convert(self, jobs: list[tuple[Path, str, Path]]) -> None:
        """Each (HF folder, converter outtype, GGUF path), in one converter process."""
        args = [f"{folder}:{outtype}:{out}" for folder, outtype, out in jobs]
        _run([sys.executable, str(CONVERTER), str(self.src), *args])

    def quantize(self, source: Path, out: Path, ftype: str) -> None:
        _run([str(self.bin / "llama-quantize"), str(source), str(out), ftype, "1"])

    def save_logits(self, model: Path, text: Path, out: Path, n_ctx: int, chunks: int) -> None:
        """llama-perplexity's log-probabilities of `text` under `model`, for tests/llama_logits.py.
        Its KV cache in f32 and no flash attention: the cache's type is a runtime choice, not
        part of what the file means, and f16 would round every key and value."""
        _run([
            str(self.bin / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(n_ctx),
            "-b", str(n_ctx), "--chunks", str(chunks), "-t", "2", "-ctk", "f32", "-ctv", "f32",
            "-fa", "off", "--kl-divergence-base", str(out),
        ])  # fmt: skip


def find() -> LlamaCpp | str:
    """The llama.cpp to compare with, or why there is none (a skip reason)."""
    named = os.environ.get("SPECDEC_LLAMA_CPP_BIN")
    if named:
        bin_dir = Path(named).expanduser()
    else:
        server = built_for_this_cpu()
        if server is None:
            return "no llama.cpp built for this CPU (make test-parity builds it, or set SPECDEC_LLAMA_CPP_BIN)"
        bin_dir = server.parent
    src_dir = Path(os.environ.get("SPECDEC_LLAMA_CPP_SRC") or bin_dir.parent.parent).expanduser()
    missing = [t for t in TOOLS if not (bin_dir / t).is_file()]
    if missing:
        return f"{bin_dir} has no {', '.join(missing)}"
    if not (src_dir / "convert_hf_to_gguf.py").is_file():
        return f"{src_dir} has no convert_hf_to_gguf.py (set SPECDEC_LLAMA_CPP_SRC to llama.cpp's sources)"
    return LlamaCpp(bin_dir, src_dir)


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{Path(command[0]).name} failed ({done.returncode}): " + " | ".join(tail))
