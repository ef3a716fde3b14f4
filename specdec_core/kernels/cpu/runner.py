"""The CPU's runner: a model plus transformers' KV cache of one token sequence, with rollback by cropping.

`ids` mirrors what the cache holds, so syncing to a new token list is "keep the
common prefix, crop the rest" — the same operation rolls back rejected draft
tokens and reuses a previous chat turn's prompt.

Two things make that rollback exact on every architecture:
- Sliding-window layers (Mistral, Phi-3, Gemma 2/3, Qwen2 with a window) keep
  every past state (`RollbackSlidingWindowLayer`): transformers' own sliding layer
  keeps only the window and cannot be cropped once it is full. The model still sees
  exactly the keys its own sliding layer would hand it, so the window applies unchanged.
- A forward that fails half-way (out of memory, an interrupt) has already written
  some layers; the cache is then reset, so the next forward re-feeds the sequence
  instead of reading half-written states. So is a forward whose logits hold inf/NaN
  (fp16 overflow), which raises a one-line `NumericalError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..runner import Runner, is_finite, overflow_error
from . import layers_cpu
from .kv_inplace import BufferLayer

# Tests turn this on (tests/conftest.py): every forward then checks that each cache
# layer holds exactly len(ids) positions.
CHECK_INVARIANT = False


class RollbackSlidingWindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer that keeps all its past states, so `crop` works at any depth.

    `update` returns the same keys/values transformers' sliding layer would (the last
    `window - 1` cached positions plus the new ones) and `get_mask_sizes` is inherited,
    so attention computes exactly what it computes with the stock cache. Memory is
    that of a full-attention layer.
    """

    _layer_type = None  # never register this class in transformers' layer mappings
    is_croppable = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        visible = min(self.cumulative_length, self.sliding_window - 1) + key_states.shape[-2]
        self.cumulative_length += key_states.shape[-2]
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        # The stock layer returns a fresh contiguous tensor; so do we (same kernels downstream).
        return self.keys[:, :, -visible:].contiguous(), self.values[:, :, -visible:].contiguous()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of positions to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        assert self.keys is not None and self.values is not None
        self.keys = self.keys[..., :tokens_to_remove, :]
        self.values = self.values[..., :tokens_to_remove, :]
        self.cumulative_length = self.keys.shape[-2]


def new_cache(config: Any, buffered: bool = False) -> DynamicCache:
    """transformers' per-layer cache for `config`, with sliding layers that can roll back, and
    full-attention layers written in place when `buffered` (models with one-call layers)."""
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:
            cache.layers[i] = RollbackSlidingWindowLayer(sliding_window=layer.sliding_window)
        elif type(layer) is DynamicLayer and buffered:
            cache.layers[i] = BufferLayer()
    return cache


def layer_lengths(cache: DynamicCache) -> list[int]:
    """Cached positions of each attention layer (recurrent and empty shared layers skipped)."""
    return [
        layer.get_seq_length()
        for layer in cache.layers
        if isinstance(layer, DynamicLayer) and layer.is_initialized
    ]


class CachedModel(Runner):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.buffered = layers_cpu.writes_cache_in_place(model)
        self.cache = new_cache(model.config, self.buffered)
        # Every layer in one call: the model's forward as one call too (layers_cpu.OneCallStack).
        self.stack = layers_cpu.OneCallStack(model) if layers_cpu.OneCallStack.fits(model) else None
        self.ids: list[int] = []
        self.forwards = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reset(self) -> None:
        self.cache = new_cache(self.model.config, self.buffered)
        self.ids = []

    def crop(self, length: int) -> None:
        """Keep the first `length` cached positions."""
        if length >= len(self.ids):
            return
        if not self.cache.is_croppable:
            # Recurrent (linear-attention) states cannot be rolled back: start over, the
            # next forward re-feeds the kept tokens. Exact, and slow only for such models.
            self.reset()
            return
        self.cache.crop(length - len(self.ids))  # transformers 5: negative = positions to remove
        del self.ids[length:]

    @torch.inference_mode()
    def forward(self, new_ids: Sequence[int], logits_to_keep: int) -> torch.Tensor:
        """Append `new_ids` to the cache; return logits [logits_to_keep, V] (fp32)."""
        input_ids = torch.tensor([list(new_ids)], dtype=torch.long, device=self.device)
        try:
            raw = self.stack.forward(self.cache, input_ids, logits_to_keep) if self.stack else None
            if raw is None:
                out = self.model(
                    input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=logits_to_keep
                )
                self.cache = out.cache if getattr(out, "cache", None) is not None else self.cache
                raw = out.logits
        except BaseException:
            # Some layers may already hold the new positions: the cache no longer matches ids.
            self.reset()
            raise
        self.ids.extend(new_ids)
        self.forwards += 1
        if CHECK_INVARIANT:
            lengths = layer_lengths(self.cache)
            assert all(n == len(self.ids) for n in lengths), f"cache holds {lengths} for {len(self.ids)} ids"
        # Logits upcast to fp32 before comparing/sampling (as transformers does).
        logits = raw[0].float()
        if not is_finite(logits):
            self.reset()
            raise overflow_error(self.model)
        return logits
