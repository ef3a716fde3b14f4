"""Which runner a model gets: the fixed-shape step on CUDA where it fits, else the CPU's
`CachedModel` (its kernels are row-wise already; docs/engine.md)."""

from __future__ import annotations

import os

import torch

from .cpu.runner import CachedModel
from .cuda.static_step import TARGET_ROWS, StaticRunner, static_refusal


def runner_for(model: torch.nn.Module, draft: bool = False) -> CachedModel | StaticRunner:
    """The runner the engine uses for `model`: the fixed-shape step on CUDA where it fits,
    else `CachedModel` (the CPU's kernels are row-wise already; docs/engine.md)."""
    device = next(model.parameters()).device
    if device.type != "cuda" or os.environ.get("SPECDEC_STATIC_STEP") == "0" or static_refusal(model):
        return CachedModel(model)
    runner = StaticRunner(model, rows=(1, TARGET_ROWS) if draft else (TARGET_ROWS,))
    runner.warm_up()
    return runner


def step_label(runner: object) -> str:
    """How a runner's forwards run, for the session's info: "" for the CPU's own runner."""
    if isinstance(runner, StaticRunner):
        how = "CUDA graphs" if runner.graphs else f"eager: {runner.graphs_off}"
        nf4 = f", {runner.nf4_row_kernels} nf4 linears read as stored" if runner.nf4_row_kernels else ""
        return f"fixed-shape step ({runner.rows[-1]} rows, {how}{nf4})"
    if isinstance(runner, CachedModel) and runner.device.type == "cuda":
        why = static_refusal(runner.model) or "turned off (SPECDEC_STATIC_STEP=0)"
        return f"transformers' forward (no fixed-shape step: {why})"
    return ""
