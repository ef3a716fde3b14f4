"""A model plus the KV cache of one token sequence, with rollback by cropping.

`ids` mirrors what the cache holds, so syncing to a new token list is "keep the
common prefix, crop the rest" — the same operation rolls back rejected draft
tokens and reuses a previous chat turn's prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache


class CachedModel:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.ids: list[int] = []
        self.forwards = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.ids = []

    def crop(self, length: int) -> None:
        """Keep the first `length` cached positions."""
        if length < len(self.ids):
            self.cache.crop(length - len(self.ids))  # transformers 5: negative = tokens to remove
            del self.ids[length:]

    def sync(self, tokens: Sequence[int]) -> int:
        """Crop to the longest cached prefix of `tokens`; return its length."""
        n = 0
        limit = min(len(self.ids), len(tokens))
        while n < limit and self.ids[n] == tokens[n]:
            n += 1
        self.crop(n)
        return n

    @torch.inference_mode()
    def forward(self, new_ids: Sequence[int], logits_to_keep: int) -> torch.Tensor:
        """Append `new_ids` to the cache; return logits [logits_to_keep, V] (fp32)."""
        input_ids = torch.tensor([list(new_ids)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=logits_to_keep)
        self.cache = out.cache if getattr(out, "cache", None) is not None else self.cache
        self.ids.extend(new_ids)
        self.forwards += 1
        # Logits upcast to fp32 before comparing/sampling (as transformers does).
        return out.logits[0].float()
