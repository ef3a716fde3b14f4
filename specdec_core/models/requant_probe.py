"""What a re-quantization at load costs, measured once per source and precision, and shown.

`int4` and `int8` on the CPU round a target's weights again at every load (a GGUF's
blocks, a folder's bf16 values); on CUDA so does every precision whose label says
`re-quantized` (nf4 or int8 through bitsandbytes, bf16 from fp32, a GGUF's converted copy). The first such load of a source measures the rounded
model against the source's weights in fp32 on the probe text
(`hf_blocks.measure_on_probe`, as the llama.cpp-block copies are measured) and keeps the
figures in the cache (`probes/<source key[:16]>-<precision>.json`). Every load's fidelity
label then carries them: `re-quantized: int4 from Q4_K_M (KL 0.0330 on the probe)`.

The figures are the code's as much as the source's: each file records `code_key()`, a hash of
the sources that measure (the fidelity code, the probe text) and that compute (the kernels and
their wrappers, torch's and transformers' versions), and one written by other code is measured
again. A hash rather than a version number: no change can forget to bump it.

The fp32 reference holds the model's weights in fp32 for the measurement: where that is
more than half the memory available, nothing is measured and the label says so (the guard
hf_blocks' own probe keeps too: `hf_blocks.reference_fits`). A draft
is never measured: its numbers never reach the answer.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from torch import nn

from ..disk_cache import cache_dir
from ..progress import Progress, ProgressCallback
from .hf_blocks import NOT_MEASURED, PROBE_TEXT, measure_on_probe, reference_fits

MEASURED = ("int4", "int8")  # the CPU precisions that round a source's weights again at load
_PACKAGE = Path(__file__).resolve().parent.parent
# The code a probe's figures depend on, below specdec_core/: what measures and what computes
# (every kernel source and wrapper, and the preparation that picks them).
MEASURING_CODE = (
    "engine/fidelity.py", "models/hf_blocks.py", "models/requant_probe.py", "models/cpu_backend.py",
    "models/gguf_native.py", "models/loading.py", "kernels",
)  # fmt: skip
_CODE_SUFFIXES = (".py", ".c", ".h")


def applies(device: str, precision: str, label: str) -> bool:
    """Whether a target's load at `precision` on `device`, labelled `label`, is measured."""
    if device == "cpu":
        return precision in MEASURED
    return device == "cuda" and label.startswith("re-quantized")


def probes_dir() -> Path:
    return cache_dir() / "probes"


def probe_path(source_key: str, precision: str) -> Path:
    return probes_dir() / f"{source_key[:16]}-{precision}.json"


def labelled(
    label: str, source_key: str, precision: str, model: nn.Module, tokenizer: Any, *,
    reference: Callable[[], nn.Module], parameters: int, progress: ProgressCallback | None = None,
) -> str:  # fmt: skip
    """`label` with the probe's KL of `model` against `reference()`: remembered, or measured now."""
    path = probe_path(source_key, precision)
    figures = _read(path)
    if figures is None:
        if not reference_fits(parameters):
            return f"{label} ({NOT_MEASURED})"
        if progress is not None:
            progress(Progress(f"Measuring {precision} against the source's weights (once)", 0, 0))
        figures = _measure(model, reference(), tokenizer)
        _write(path, figures)
    return f"{label} (KL {figures['kl_mean']:.4f} on the probe)"


@functools.cache
def code_key() -> str:
    """A hash of the code a probe's figures depend on (MEASURING_CODE, the probe text, torch's
    and transformers' versions): cached figures with another key are measured again."""
    import torch
    import transformers

    digest = hashlib.sha256(f"torch {torch.__version__} transformers {transformers.__version__}".encode())
    for file in _code_files():
        digest.update(file.relative_to(_PACKAGE).as_posix().encode() + b"\0" + _content(file))
    digest.update(resources.files("specdec_resources").joinpath(PROBE_TEXT).read_bytes())
    return digest.hexdigest()


def _code_files() -> list[Path]:
    files = []
    for name in MEASURING_CODE:
        path = _PACKAGE / name
        found = path.rglob("*") if path.is_dir() else [path]
        files += [f for f in found if f.suffix in _CODE_SUFFIXES and f.is_file()]
    return sorted(files)


def _content(file: Path) -> bytes:
    try:
        return file.read_bytes()
    except OSError:  # a bundle without sources: its files change only with the bundle
        return b""


def _measure(model: nn.Module, reference: nn.Module, tokenizer: Any) -> dict[str, Any]:
    result = measure_on_probe(model, reference, tokenizer)
    return {
        "kl_mean": result.kl_mean, "kl_p99": result.kl_p99, "top1_agreement": result.top1_agreement,
        "positions": result.scored, "code": code_key(),
    }  # fmt: skip


def _read(path: Path) -> dict[str, Any] | None:
    """The figures at `path`, where they were measured by this code."""
    try:
        figures = json.loads(path.read_text(encoding="utf-8"))
        usable = isinstance(figures.get("kl_mean"), float) and figures.get("code") == code_key()
        return figures if usable else None
    except (OSError, ValueError, AttributeError):
        return None


def _write(path: Path, figures: dict[str, Any]) -> None:
    """Written whole or not at all (a temporary file renamed): a killed process leaves no half file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(figures, indent=1), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass  # a read-only or full cache: measured again next time, the load goes on
