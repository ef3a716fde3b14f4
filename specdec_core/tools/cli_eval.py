"""`specdec eval`: how far a precision is from the model's own weights, on any text.

The reference is the same model at fp32: for a GGUF, its blocks de-quantized (the
weights the file holds, bit for bit); for a bf16/fp16 folder, its weights widened.
The measured model is the one `specdec generate` would run at `--precision`. With
`--llama-perplexity BIN`, llama.cpp's own perplexity on the same GGUF and text is
reported beside ours (docs/models.md#fidelity).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path
from typing import Any

from ..errors import InvalidInput, InvalidParameter, ModelLoadError
from ..progress import TerminalProgress

LLAMA_TIMEOUT_S = 3600
_FINAL_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval", help="perplexity and KL divergence of a precision against the model's own weights in fp32"
    )
    parser.add_argument("--target", required=True, help="model: HF folder, .gguf, catalog name, hub id")
    parser.add_argument("--precision", default="auto", help="the precision measured (default: what auto picks)")
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
    from ..engine.fidelity import measure
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
    ids = measured.tokenizer(text, add_special_tokens=False)["input_ids"]
    if args.chunks:
        ids = ids[: args.chunks * args.ctx]
    try:
        fidelity = measure(measured.model, reference.model, ids, ctx=args.ctx)
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
        doc["llama_cpp"] = {"perplexity": llama_perplexity(args.llama_perplexity, gguf, args.text, args)}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"{args.target} at {measured.precision} against fp32: {fidelity.summary()}")
        if "llama_cpp" in doc:
            ppl = doc["llama_cpp"]["perplexity"]
            change = ppl / fidelity.reference_perplexity - 1.0
            print(f"llama.cpp on the same file: perplexity {ppl:.4f} ({change:+.2%} against our fp32 reference)")
    return 0


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"cannot read {path}: {exc}") from None


def _gguf_of(target: str, resolved: Path) -> Path:
    for candidate in (Path(target).expanduser(), resolved):
        if candidate.suffix == ".gguf" and candidate.is_file():
            return candidate
    source = _converted_source(resolved)
    if source is None:
        raise InvalidParameter("--llama-perplexity needs a GGUF target (a .gguf file or a catalog GGUF)")
    return source


def _converted_source(folder: Path) -> Path | None:
    """The GGUF a converted folder was made from, when it is still where it was."""
    from ..models.gguf_convert import read_marker

    marker = read_marker(folder)
    source = Path(marker["source"]) if marker and "source" in marker else None
    return source if source is not None and source.is_file() else None


def llama_perplexity(binary: str, gguf: Path, text: Path, args: argparse.Namespace) -> float:
    """llama.cpp's perplexity of `gguf` on `text`, with the same chunking."""
    command = [binary, "-m", str(gguf), "-f", str(text), "-c", str(args.ctx)]
    if args.chunks:
        command += ["--chunks", str(args.chunks)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=LLAMA_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(f"llama-perplexity did not run: {exc}") from None
    value = parse_llama_perplexity(done.stdout + done.stderr)
    if value is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelLoadError(f"llama-perplexity gave no estimate (exit {done.returncode}): {tail[0]}")
    return value


def parse_llama_perplexity(output: str) -> float | None:
    """The 'Final estimate: PPL = X' of llama-perplexity's output."""
    match = _FINAL_PPL.search(output)
    return float(match.group(1)) if match else None

