"""`specdec eval`: how far a precision is from the model's own weights, on any text.

The reference is the same model at fp32: for a GGUF, its blocks de-quantized (the
weights the file holds, bit for bit); for a bf16/fp16 folder, its weights widened.
The measured model is the one `specdec generate` would run at `--precision`. With
`--llama-perplexity BIN`, llama.cpp is measured the same way on the same GGUF and text
and reported beside ours (docs/models.md#fidelity): its perplexity, and, where
`llama-quantize` lies beside BIN, its KL against the file's weights in fp32 (an F32 GGUF
that llama-quantize writes, run by llama.cpp itself as the base).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from ..errors import InvalidInput, InvalidParameter, ModelLoadError
from ..progress import TerminalProgress

LLAMA_TIMEOUT_S = 3600
_FINAL_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+)")
# llama-perplexity's summary lines in --kl-divergence mode, and the names we report them by.
_KL_LINES = {
    "perplexity": r"Mean PPL\(Q\)\s*:\s*([0-9.]+)",
    "reference_perplexity": r"Mean PPL\(base\)\s*:\s*([0-9.]+)",
    "kl_mean": r"Mean\s+KLD:\s*([0-9.]+)",
    "kl_p99": r"99\.0%\s+KLD:\s*([0-9.]+)",
    "top1_agreement": r"Same top p:\s*([0-9.]+)",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval", help="perplexity and KL divergence of a precision against the model's own weights in fp32"
    )
    parser.add_argument("--target", required=True, help="model: HF folder, .gguf, catalog name, hub id")
    parser.add_argument(
        "--precision", default="auto", help="the precision measured (default: what auto picks)"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--text", required=True, type=Path, help="a UTF-8 text file, scored as one document")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity's -c)")
    parser.add_argument("--chunks", type=int, default=0, help="score at most this many chunks (0: all)")
    parser.add_argument(
        "--llama-perplexity", metavar="BIN", help="also run llama.cpp's llama-perplexity on the GGUF"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.set_defaults(func=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    from ..engine.fidelity import document_ids, measure
    from ..kernels.batch_invariant import plain_linears
    from ..models.loading import load_model

    text = _read_text(args.text)
    if args.ctx < 4 or args.chunks < 0:
        raise InvalidParameter("--ctx must be at least 4 and --chunks at least 0")
    progress = TerminalProgress()
    measured = load_model(args.target, device=args.device, precision=args.precision, progress=progress)
    reference = load_model(args.target, device=args.device, precision="fp32", progress=progress)
    plain_linears(reference.model)  # a reference is never verified against steps: whole matmuls
    progress.close()
    bos = bos_of(args.target, measured.path, measured.tokenizer)
    ids = document_ids(measured.tokenizer, text, bos)
    if args.chunks:
        ids = ids[: args.chunks * args.ctx]
    try:
        fidelity = measure(measured.model, reference.model, ids, ctx=args.ctx, bos=bos)
    except ValueError as exc:
        raise InvalidInput(f"{args.text}: {exc}") from None
    doc: dict[str, Any] = {
        "target": args.target,
        "precision": measured.precision,
        "reference": "fp32",
        "text": str(args.text),
        "fidelity": fidelity.as_dict(),
    }
    if args.llama_perplexity:
        gguf = _gguf_of(args.target, measured.path)
        doc["llama_cpp"] = llama_cpp_fidelity(args.llama_perplexity, gguf, args.text, args)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"{args.target} at {measured.precision} against fp32: {fidelity.summary()}")
        if "llama_cpp" in doc:
            print(_llama_summary(doc["llama_cpp"], fidelity.reference_perplexity))
    return 0


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"cannot read {path}: {exc}") from None


def bos_of(target: str, resolved: Path, tokenizer: Any) -> int | None:
    """The BOS id each chunk starts with, or None where the vocabulary adds none: for a GGUF
    as llama.cpp decides it from the header (llama-perplexity's BOS), else as the tokenizer does."""
    from ..engine.fidelity import tokenizer_bos
    from ..models.gguf_file import read_gguf
    from ..models.gguf_to_hf import llama_adds_bos

    gguf = _gguf_file(target, resolved)
    if gguf is None:
        return tokenizer_bos(tokenizer)
    file = read_gguf(gguf)
    if not llama_adds_bos(file):
        return None
    bos = file.fields.get("tokenizer.ggml.bos_token_id", tokenizer.bos_token_id)
    return None if bos is None else int(bos)


def _gguf_of(target: str, resolved: Path) -> Path:
    gguf = _gguf_file(target, resolved)
    if gguf is None:
        raise InvalidParameter("--llama-perplexity needs a GGUF target (a .gguf file or a catalog GGUF)")
    return gguf


def _gguf_file(target: str, resolved: Path) -> Path | None:
    """The GGUF a target is or was converted from, where there is one."""
    for candidate in (Path(target).expanduser(), resolved):
        if candidate.suffix == ".gguf" and candidate.is_file():
            return candidate
    return _converted_source(resolved)


def _converted_source(folder: Path) -> Path | None:
    """The GGUF a converted folder was made from, when it is still where it was."""
    from ..models.gguf_convert import read_marker

    marker = read_marker(folder)
    source = Path(marker["source"]) if marker and "source" in marker else None
    return source if source is not None and source.is_file() else None


def llama_cpp_fidelity(binary: str, gguf: Path, text: Path, args: argparse.Namespace) -> dict[str, Any]:
    """llama.cpp on `gguf` and `text`, with the same chunking: its perplexity, and its KL
    against the file's weights in fp32 where llama-quantize lies beside `binary`."""
    quantize = Path(binary).with_name("llama-quantize")
    if not quantize.is_file():
        return {
            "perplexity": llama_perplexity(binary, gguf, text, args),
            "kl": f"no {quantize.name} beside {binary}",
        }
    from ..disk_cache import cache_dir

    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".llama-kl-", dir=cache_dir()) as tmp:
        f32, base = Path(tmp) / "f32.gguf", Path(tmp) / "base.kld"
        _run_llama([str(quantize), "--allow-requantize", str(gguf), str(f32), "F32"], "llama-quantize")
        _run_llama([binary, "-m", str(f32), *_chunking(text, args), "--kl-divergence-base", str(base)],
                   "llama-perplexity")  # fmt: skip
        output = _run_llama(
            [
                binary,
                "-m",
                str(gguf),
                *_chunking(text, args),
                "--kl-divergence-base",
                str(base),
                "--kl-divergence",
            ],
            "llama-perplexity",
        )
    values = parse_llama_kl(output)
    if values is None:
        raise ModelLoadError(f"llama-perplexity --kl-divergence gave no statistics: {_last_line(output)}")
    return values


def llama_perplexity(binary: str, gguf: Path, text: Path, args: argparse.Namespace) -> float:
    """llama.cpp's perplexity of `gguf` on `text`, with the same chunking."""
    output = _run_llama([binary, "-m", str(gguf), *_chunking(text, args)], "llama-perplexity")
    value = parse_llama_perplexity(output)
    if value is None:
        raise ModelLoadError(f"llama-perplexity gave no estimate: {_last_line(output)}")
    return value


def _chunking(text: Path, args: argparse.Namespace) -> list[str]:
    return ["-f", str(text), "-c", str(args.ctx), *(["--chunks", str(args.chunks)] if args.chunks else [])]


def _run_llama(command: list[str], name: str) -> str:
    """A llama.cpp tool's stdout and stderr together; one line if it fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=LLAMA_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(f"{name} did not run: {exc}") from None
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise ModelLoadError(f"{name} failed (exit {done.returncode}): {_last_line(output)}")
    return output


def _last_line(output: str) -> str:
    return (output.strip().splitlines() or ["no output"])[-1]


def _llama_summary(llama: dict[str, Any], reference_perplexity: float) -> str:
    ppl = llama["perplexity"]
    line = f"llama.cpp on the same file: perplexity {ppl:.4f} ({ppl / reference_perplexity - 1:+.2%} against our fp32 reference)"
    if "kl_mean" in llama:
        line += (
            f"; against its own fp32 run: perplexity {ppl / llama['reference_perplexity'] - 1:+.2%}, "
            f"KL mean {llama['kl_mean']:.4f} p99 {llama['kl_p99']:.4f}, top-1 agrees {llama['top1_agreement']:.1%}"
        )
    else:
        line += f" (KL not measured: {llama['kl']})"
    return line


def parse_llama_kl(output: str) -> dict[str, float] | None:
    """The summary of `llama-perplexity --kl-divergence`, by the names `Fidelity` uses."""
    values: dict[str, float] = {}
    for name, pattern in _KL_LINES.items():
        match = re.search(pattern, output)
        if match is None:
            return None
        values[name] = float(match.group(1))
    values["top1_agreement"] /= 100.0
    values["perplexity_change"] = values["perplexity"] / values["reference_perplexity"] - 1.0
    return values


def parse_llama_perplexity(output: str) -> float | None:
    """The 'Final estimate: PPL = X' of llama-perplexity's output."""
    match = _FINAL_PPL.search(output)
    return float(match.group(1)) if match else None
