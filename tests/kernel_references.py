"""What the CUDA kernels compute, in plain torch: the references their tests compare with."""

from __future__ import annotations

import torch
from torch import nn

from specdec_core.kernels.batch_invariant import dequantize_bnb


def masked_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """The kernel's rule in plain torch, over the whole cache with a mask built on the device
    (no host sync) -> [1, R, H, D]. Its numbers depend on the capacity: a reference, not a step."""
    groups = query.shape[1] // key.shape[1]
    keys, values = (
        key.repeat_interleave(groups, dim=1).float(),
        value.repeat_interleave(groups, dim=1).float(),
    )
    scores = torch.matmul(query.float(), keys.transpose(2, 3)) * scale  # [1, H, R, capacity]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    slots = torch.arange(key.shape[2], device=key.device)
    seen = slots[None, :] <= positions[:, None]
    if sliding_window:
        seen &= slots[None, :] > positions[:, None] - sliding_window
    weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.matmul(weights, values).to(query.dtype).transpose(1, 2).contiguous()


def reference(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the nf4 row kernel computes, through bitsandbytes' own dequantization."""
    weight = dequantize_bnb(module).to(x.dtype)  # type: ignore[arg-type]
    return torch.nn.functional.linear(x.float(), weight.float()).to(x.dtype)
