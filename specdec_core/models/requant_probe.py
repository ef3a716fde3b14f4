"""What a re-quantization at load costs, measured once per source and precision, and shown.

`int4` and `int8` on the CPU round a target's weights again at every load (a GGUF's
blocks, a folder's bf16 values); on CUDA so does every precision whose label says
`re-quantized` (nf4 or int8 through bitsandbytes, bf16 from fp32, a GGUF's converted copy). The first such load of a source measures the rounded
model against the source's weights in fp32 on the probe text
(`hf_blocks.measure_on_probe`, as the llama.cpp-block copies are measured) and keeps the
figures in the cache (`probes/<source key[:16]>-<precision>.json`). Every load's fidelity
label then carries them: `re-quantized: int4 from Q4_K_M (KL 0.0330 on the probe)`.

The fp32 reference holds the model's weights in fp32 for the measurement: where that is
more than half the memory available, nothing is measured and the label says so (the guard
hf_blocks' own probe keeps too: `hf_blocks.reference_fits`). A draft
is never measured: its numbers never reach the answer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from ..disk_cache import cache_dir
from ..progress import Progress, ProgressCallback
from .hf_blocks import NOT_MEASURED, measure_on_probe, reference_fits

MEASURED = ("int4", "int8")  # the CPU precisions that round a source's weights again at load


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


def _measure(model: nn.Module, reference: nn.Module, tokenizer: Any) -> dict[str, float]:
    result = measure_on_probe(model, reference, tokenizer)
    return {
        "kl_mean": result.kl_mean, "kl_p99": result.kl_p99, "top1_agreement": result.top1_agreement,
        "positions": result.scored,
    }  # fmt: skip


def _read(path: Path) -> dict[str, float] | None:
    try:
        figures = json.loads(path.read_text(encoding="utf-8"))
        return figures if isinstance(figures.get("kl_mean"), float) else None
    except (OSError, ValueError, AttributeError):
        return None


def _write(path: Path, figures: dict[str, float]) -> None:
    """Written whole or not at all (a temporary file renamed): a killed process leaves no half file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(figures, indent=1), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass  # a read-only or full cache: measured again next time, the load goes on
