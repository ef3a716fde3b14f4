"""What one forward costs: the verify-cost curve, the bytes a step reads, the memory's speed.

Decoding one token must read every weight once, so on a CPU the step time is bounded
below by bytes-per-step / memory bandwidth (the roofline). `measure_cost_curve` times
forwards of m tokens after a cached context (a verify of m - 1 draft tokens);
`step_bytes` counts what one step reads from the loaded tensors; `measure_bandwidth`
times a streaming read, the limit those bytes are judged against.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...kernels.cpu import huge_pages
from ...kernels.cpu.draft_int4 import Int4Weights
from ...kernels.cpu.gguf_blocks import GGUFLinear
from ...kernels.cpu.quant_cpu import PerTokenInt8Linear
from ...kernels.cpu.runner import CachedModel
from ...kernels.cpu.threads import default_governor
from ...kernels.dispatch import runner_for
from ...kernels.runner import Runner

COST_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one forward of m tokens after a cached context: t_verify(m) for the
    target (a verify of m - 1 draft tokens), t_draft for the draft's 1-token step."""

    context_tokens: int
    repeats: int
    target_min: dict[int, float]
    target_median: dict[int, float]
    draft_min: float | None
    draft_median: float | None


def time_forward(runner: Runner, context: Sequence[int], m: int) -> float:
    """Seconds of one forward of m tokens after the cached context (`Runner.time_forward`), at
    the thread count the engine would use now: at 2 threads beside a busy process every op
    waits for a descheduled thread, and the curve would time the machine, not the model."""
    default_governor().maybe_adjust()
    return runner.time_forward(context, m)


def measure_cost_curve(
    target_model: Any,
    draft_model: Any = None,
    sizes: Sequence[int] = COST_SIZES,
    repeats: int = 9,
    context_tokens: int = 200,
) -> CostCurve:
    """Interleaved repeats (all sizes, then again) so a burst of load hits every size alike."""
    vocab = int(target_model.config.get_text_config().vocab_size)
    context = torch.randint(0, vocab, (context_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    # The runners the engine would use: on CUDA the fixed-shape step (static_step.runner_for).
    runners = [runner_for(target_model)] + (
        [runner_for(draft_model, draft=True)] if draft_model is not None else []
    )
    for runner in runners:
        runner.forward(context, logits_to_keep=1)
    timings: dict[int, list[float]] = {m: [] for m in sizes}
    draft: list[float] = []
    for _ in range(repeats):
        for m in sizes:
            timings[m].append(time_forward(runners[0], context, m))
        if len(runners) > 1:
            draft.append(time_forward(runners[1], context, 1))
    return CostCurve(
        context_tokens=context_tokens,
        repeats=repeats,
        target_min={m: min(t) for m, t in timings.items()},
        target_median={m: statistics.median(t) for m, t in timings.items()},
        draft_min=min(draft) if draft else None,
        draft_median=statistics.median(draft) if draft else None,
    )


# -- the roofline ----------------------------------------------------------------------


@dataclass(frozen=True)
class StepBytes:
    """Bytes one decoding step reads: the weights it multiplies by, and the KV cache."""

    weights: int
    kv_cache: int  # at `context_tokens` cached positions
    context_tokens: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache


def step_bytes(model: Any, context_tokens: int = 200) -> StepBytes:
    """Counted from the loaded tensors, each once (tied weights are one tensor).

    The input embedding contributes one row per token, not its table — unless the
    same tensor is also the LM head, which reads all of it. Our int8 linears keep
    their weights packed outside `parameters()`: counted from their shapes (int8
    values, fp32 per-channel scales). A GGUF's linears hold their blocks (or their
    repacked copy, which a step reads instead) outside them too, and its embedding
    de-quantizes the rows it reads from the file's blocks (no `weight`).
    """
    embedding = getattr(model.get_input_embeddings(), "weight", None)
    head = model.get_output_embeddings()
    head_weight = getattr(head, "weight", None)
    seen: set[int] = set()
    weights = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        if tensor is embedding and head_weight is not embedding:
            continue
        weights += tensor.numel() * tensor.element_size()
    for module in model.modules():
        if isinstance(module, PerTokenInt8Linear) and isinstance(module.few_rows, Int4Weights):
            weights += module.few_rows.nbytes  # a step takes the 4-bit path (draft_int4)
        elif isinstance(module, PerTokenInt8Linear):
            weights += module.out_features * module.in_features + 4 * module.out_features
        elif isinstance(module, GGUFLinear):
            weights += (module.packed if module.packed is not None else module.blocks).nbytes
    return StepBytes(weights, _kv_bytes(model, context_tokens), context_tokens)


def _kv_bytes(model: Any, context_tokens: int) -> int:
    config = model.config.get_text_config()
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    element = 2 if model.dtype in (torch.float16, torch.bfloat16) else 4
    return int(config.num_hidden_layers) * 2 * heads * head_dim * context_tokens * element


def measure_bandwidth(gib: float = 0.25, repeats: int = 5, threads: int | None = None) -> float:
    """Bytes per second of a streaming read (a sum over `gib` GiB of fp32, far beyond any
    cache) at `threads` threads (None: as many as now), best of `repeats`. The data sits in
    2 MB pages where the OS grants them, as the 4-bit weights do (huge_pages.py)."""
    count = int(gib * 2**30) // 4
    try:
        data = huge_pages.buffer(count * 4).view(torch.float32) if huge_pages.available() else torch.empty(count)
    except OSError:
        data = torch.empty(count)
    data.fill_(1.0)
    saved = torch.get_num_threads()
    best = float("inf")
    try:
        torch.set_num_threads(threads or saved)
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(saved)
    return data.numel() * 4 / best


@dataclass(frozen=True)
class FusionGain:
    """Min seconds of an m-token forward with separate and with fused q/k/v, gate/up linears."""

    sizes: tuple[int, ...]
    separate_min: dict[int, float]
    fused_min: dict[int, float]


def measure_fusion_gain(
    model: Any, sizes: Sequence[int] = (1, 5), repeats: int = 9, context_tokens: int = 200
) -> FusionGain | None:
    """Interleaved A/B of an unfused int8 model and a fused copy; None if nothing fuses."""
    from ...kernels.cpu.fused_int8 import fuse_int8_projections

    fused_model = copy.deepcopy(model)
    if fuse_int8_projections(fused_model) == 0:
        return None
    vocab = int(model.config.get_text_config().vocab_size)
    context = torch.randint(0, vocab, (context_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    runners = [CachedModel(model), CachedModel(fused_model)]
    for runner in runners:
        runner.forward(context, logits_to_keep=1)
    timings: list[dict[int, list[float]]] = [{m: [] for m in sizes} for _ in runners]
    for _ in range(repeats):
        for m in sizes:
            for runner, times in zip(runners, timings, strict=True):
                times[m].append(time_forward(runner, context, m))
    return FusionGain(
        sizes=tuple(sizes),
        separate_min={m: min(t) for m, t in timings[0].items()},
        fused_min={m: min(t) for m, t in timings[1].items()},
    )
