"""4-bit linears side by side: our nf4 path against torchao's int4 weight-only.

The linears of one decoder layer of the nf4 model (attention and MLP projections) are
timed at 1 and 16 rows: once as the model runs them after the fixed-shape step took it
over (the nf4 row kernel, `kernels/cuda/nf4_rows.py`, where it covers them; else bitsandbytes'
weight dequantized whole, then the matmul), once re-quantized from their dequantized
weights with torchao's `Int4WeightOnlyConfig(group_size=128)` (the tinygemm kernel).
Each set is captured as one CUDA graph and replayed, so launch costs are alike. Times
are per layer; the layer count and the nf4 linears' class are recorded beside them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from .report import Skip

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def layer_linears(model: Any) -> list[Any]:
    """The first decoder layer's attention and MLP projections, as the model holds them."""
    layer = model.model.layers[0]
    found = dict(layer.named_modules())
    return [
        found[f"{part}.{name}"]
        for part in ("self_attn", "mlp")
        for name in PROJECTIONS
        if f"{part}.{name}" in found
    ]


def dequantized(linear: Any) -> torch.nn.Linear:
    """A bf16 linear holding a bitsandbytes 4-bit linear's weight (dequantized) and bias."""
    import bitsandbytes.functional as bnbf

    weight = bnbf.dequantize_4bit(linear.weight.data, linear.weight.quant_state).to(torch.bfloat16)
    bias = linear.bias is not None
    plain = torch.nn.Linear(
        weight.shape[1], weight.shape[0], bias=bias, device=weight.device, dtype=torch.bfloat16
    )
    plain.weight.data.copy_(weight)
    if bias:
        plain.bias.data.copy_(linear.bias.data)
    return plain


def _replay_ms(linears: list[Any], rows: int, repeats: int = 20) -> float:
    """Median ms of all `linears` applied once each to `rows` rows, as one CUDA graph."""
    inputs = [torch.randn(rows, m.in_features, device="cuda", dtype=torch.bfloat16) for m in linears]

    def run() -> None:
        for module, x in zip(linears, inputs, strict=True):
            module(x)

    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _tinygemm_config(config: Any) -> Any:
    """Int4 weight-only in tinygemm's packing (a kernel in torch itself); older torchao has
    no packing argument and packs so by default."""
    try:
        return config(group_size=128, int4_packing_format="tile_packed_to_4d")
    except TypeError:
        return config(group_size=128)


def side_by_side(model: Any) -> dict[str, Any]:
    """Per-layer linear times at 1 and 16 rows, bitsandbytes nf4 vs torchao int4 (module doc)."""
    try:
        from torchao.quantization import Int4WeightOnlyConfig, quantize_
    except ImportError as exc:
        raise Skip(f"torchao does not import here: {exc}") from exc
    layers = int(model.config.num_hidden_layers)
    nf4 = layer_linears(model)
    int4 = torch.nn.ModuleList(dequantized(m) for m in nf4)
    quantize_(int4, _tinygemm_config(Int4WeightOnlyConfig))
    found: dict[str, Any] = {
        "layers": layers,
        "linears_per_layer": len(nf4),
        "nf4_class": type(nf4[0]).__name__,
    }
    for rows in (1, 16):
        found[f"nf4_layer_ms_rows{rows}"] = _replay_ms(nf4, rows)
        found[f"torchao_int4_layer_ms_rows{rows}"] = _replay_ms(list(int4), rows)
    return found
