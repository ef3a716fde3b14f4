"""The interface every device's runner keeps: a model plus the KV cache of one token sequence.

The engine, drafters, self-check and timings see only `Runner`; which one a model gets
is `dispatch.runner_for`'s choice (the CPU's `cpu.runner.CachedModel`, or on CUDA the
fixed-shape step, `cuda.static_step.StaticRunner`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..errors import NumericalError


class Runner:
    """A model plus the cache of one token sequence, with rollback by cropping."""

    model: torch.nn.Module
    ids: list[int]
    forwards: int
    row_invariant = False  # True where a row's logits never depend on how tokens were grouped

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def crop(self, length: int) -> None:
        raise NotImplementedError

    def forward(self, new_ids: Sequence[int], logits_to_keep: int) -> torch.Tensor:
        raise NotImplementedError

    def sync(self, tokens: Sequence[int]) -> int:
        """Crop to the longest cached prefix of `tokens`; return its length."""
        n = shared_prefix(self.ids, tokens)
        self.crop(n)
        return n

    def synchronize(self) -> None:
        """Wait for the device's queued work, so a clock read after it times the forward itself."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time_forward(self, context: Sequence[int], m: int) -> float:
        """Seconds of one forward of m tokens after the cached `context` (a verify of m - 1
        drafts); the cache is cropped back to the context first."""
        self.crop(len(context))
        self.synchronize()  # CUDA runs kernels asynchronously: time the forward, not its launch
        start = time.perf_counter()
        self.forward(context[:m], logits_to_keep=m)
        self.synchronize()
        return time.perf_counter() - start


def shared_prefix(cached: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading tokens `cached` and `tokens` share."""
    n = 0
    limit = min(len(cached), len(tokens))
    while n < limit and cached[n] == tokens[n]:
        n += 1
    return n


def is_finite(logits: torch.Tensor) -> bool:
    # max() propagates NaN and +inf: one reduction guards the whole tensor.
    return bool(torch.isfinite(logits.max()))


def overflow_error(model: torch.nn.Module) -> NumericalError:
    """The one-line error for a forward whose logits hold inf/NaN."""
    return NumericalError(
        f"{getattr(model.config, 'name_or_path', '') or 'the model'} produced inf/NaN logits "
        f"at {str(model.dtype).removeprefix('torch.')} (fp16 overflows on some models); "
        "load it at bf16 or fp32"
    )
