"""Fewer, bigger matmuls: q/k/v as one linear, gate/up as one, exactly (int8 and int4).

Every decoder layer multiplies the same input by q, k and v (and by gate and up in the
MLP). With our per-token int8 linears (quant_cpu) each of those calls also normalises
the input again (abs, amax, divide, round): five normalisations and five kernel
calls where two of each do. Fusing is exact, not approximate: weights are quantised per
output channel, so stacking the rows of q, k and v stacks their int8 values and scales
unchanged; the activation scale is per token and the same input gives the same scale;
and each output column is an integer dot product scaled by its own channel's scale, so
it does not depend on which other columns are computed with it (tests/test_fused_int8.py
checks the logits bitwise).

Attention keeps transformers' forward: `q_proj`, `k_proj` and `v_proj` become views of
one fused call (the first computes it, the others take their columns of the same
result). The MLP's forward is three lines, so it is replaced whole.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from .int4_cpu import K_SCALES, LANES, Int4Linear
from .quant_cpu import PerTokenInt8Linear

ENV_VAR = "SPECDEC_FUSE"  # "0" loads without fusing (for measuring what fusion gains)

# MLPs whose forward is exactly down(act(gate(x)) * up(x)); others keep their own forward.
GATED_MLPS = frozenset({"Qwen2MLP", "Qwen3MLP", "LlamaMLP", "MistralMLP"})


Stackable = PerTokenInt8Linear | Int4Linear


def _same_kind(parts: Sequence[object]) -> bool:
    """All our int8 linears, or all our 4-bit ones of one layout: the kinds whose rows stack
    exactly (a repacked GGUF layout only in whole blocks of outputs, `Int4Linear.stack`)."""
    if all(isinstance(p, Int4Linear) for p in parts):
        linears = cast(Sequence[Int4Linear], parts)
        whole = all(p.out_features % LANES == 0 for p in linears[:-1])
        return len({p.bits for p in linears}) == 1 and (whole or not linears[0].bits & K_SCALES)
    return all(isinstance(p, PerTokenInt8Linear) for p in parts)


def fuse_rows(parts: Sequence[Stackable]) -> Stackable:
    """One linear whose output is the parts' outputs side by side (same input)."""
    if len({p.in_features for p in parts}) != 1:
        raise ValueError("fused linears must share their input size")
    bias = _stacked_bias(parts)
    if all(isinstance(p, Int4Linear) for p in parts):
        return Int4Linear.stack(cast(Sequence[Int4Linear], parts), bias)
    return _fuse_int8(cast(Sequence[PerTokenInt8Linear], parts), bias)


def _stacked_bias(parts: Sequence[Stackable]) -> torch.Tensor | None:
    """The parts' biases side by side (zeros for a part without one), or None if none has one."""
    if all(p.bias is None for p in parts):
        return None
    return torch.cat([p.bias.detach() if p.bias is not None else torch.zeros(p.out_features) for p in parts])


def _fuse_int8(parts: Sequence[PerTokenInt8Linear], bias: torch.Tensor | None) -> PerTokenInt8Linear:
    weights = [p.int8_weight() for p in parts]
    return PerTokenInt8Linear.from_int8(
        torch.cat([w[0] for w in weights]), torch.cat([w[1] for w in weights]), bias, parts[0].kernel.name
    )


class _SharedCall:
    """Runs a fused linear once per input tensor; the projections take their columns."""

    def __init__(self, linear: Stackable, parts: int) -> None:
        self.linear = linear
        self.parts = parts
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._served = 0

    def columns(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        # Identity, not equality: the projections of one forward get the very same tensor.
        if x is not self._input or self._output is None:
            self._input, self._output, self._served = x, self.linear(x), 0
        out = self._output[..., start:end]
        self._served += 1
        if self._served == self.parts:  # every projection served: do not keep the tensors alive
            self._input = self._output = None
        return out


class FusedProjection(nn.Module):
    """Stands in for one of q_proj/k_proj/v_proj: its columns of the shared fused call."""

    def __init__(self, shared: _SharedCall, start: int, end: int) -> None:
        super().__init__()
        self.shared = shared
        self.fused = shared.linear  # registered, so the weights show up in modules()
        self.start, self.end = start, end
        self.out_features = end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.columns(x, self.start, self.end)


class FusedGateUpMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up as one linear."""

    def __init__(self, gate_up: Stackable, down: nn.Module, act_fn: nn.Module, intermediate: int):
        super().__init__()
        self.gate_up, self.down_proj, self.act_fn = gate_up, down, act_fn
        self.intermediate = intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)  # [..., 2 * intermediate]
        gate, up = gate_up[..., : self.intermediate], gate_up[..., self.intermediate :]
        return self.down_proj(self.act_fn(gate) * up)


def fuse_int8_projections(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up wherever all of them are our int8 (or all our 4-bit) linears;
    returns how many groups."""
    fused = 0
    # Names, not modules: a list of the modules would keep every replaced part alive until
    # the last layer is fused, so the old and the fused weights would all be held at once.
    for path in [name for name, _ in model.named_modules()]:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue  # a part of an MLP fused away above
        names = ("q_proj", "k_proj", "v_proj")
        parts = [getattr(module, n, None) for n in names]
        if _same_kind(parts):
            shared = _SharedCall(fuse_rows(parts), len(parts))  # type: ignore[arg-type]
            start = 0
            for name, part in zip(names, parts, strict=True):
                setattr(module, name, FusedProjection(shared, start, start + part.out_features))  # type: ignore[union-attr]
                start += part.out_features  # type: ignore[union-attr]
            fused += 1
        if type(module).__name__ not in GATED_MLPS:
            continue
        gate, up, down = (getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
        if _same_kind([gate, up]) and down is not None:
            gate_up = cast(list[Stackable], [gate, up])
            parent, child = _parent_of(model, module)
            mlp = FusedGateUpMLP(
                fuse_rows(gate_up), down, cast(nn.Module, module.act_fn), gate_up[0].out_features
            )
            setattr(parent, child, mlp)
            fused += 1
    return fused


def _parent_of(model: nn.Module, target: nn.Module) -> tuple[nn.Module, str]:
    for name, module in model.named_modules():
        if module is target:
            parent_name, _, child = name.rpartition(".")
            return (model.get_submodule(parent_name) if parent_name else model), child
    raise ValueError("module not in model")


def apply_fusion(model: nn.Module) -> int:
    """What loading calls: fuse unless `SPECDEC_FUSE=0`; returns how many groups were fused."""
    if os.environ.get(ENV_VAR, "1").strip() == "0":
        return 0
    return fuse_int8_projections(model)
