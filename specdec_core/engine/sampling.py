"""Turning logits into a distribution and drawing from it.

The same `SamplingParams.probs()` is applied to draft and target logits, which
is what speculative sampling needs for the output to follow the target's
(processed) distribution exactly. Order follows transformers' warpers:
temperature, then top-k, then top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The candidates a top-p cut looks at first (the nucleus at usual settings is smaller).
_FIRST_CANDIDATES = 64


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [..., V] (any dtype) -> probabilities [..., V] in fp32."""
        logits = logits.float()
        if self.greedy:
            return torch.softmax(logits, dim=-1)
        logits = logits / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            logits = _top_p_mask(logits, self.top_p)
        return torch.softmax(logits, dim=-1)


def _top_p_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    # As transformers' TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p, always
    # keeping the most likely token. A token is dropped exactly when the mass ranked above it
    # is >= top_p, so only the head of the ranking is needed: the most likely few candidates,
    # four times as many until their mass reaches top_p (a partial selection, not a sort of
    # the whole vocabulary).
    probs = logits.softmax(dim=-1)
    vocab = probs.shape[-1]
    n = min(_FIRST_CANDIDATES, vocab)
    while True:
        top, index = probs.topk(n, dim=-1)
        mass = top.cumsum(dim=-1)
        if n == vocab or bool((mass[..., -1] >= top_p).all()):
            break
        n = min(4 * n, vocab)
    keep_sorted = (mass - top) < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, index, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """probs: [V] -> one token id, drawn on the generator's device.

    One uniform draw against the cumulative distribution (the inverse CDF): one random
    number per token, where `torch.multinomial` draws one per vocabulary entry.

    The engine seeds one CPU generator for a run whatever the models' device, so a
    seed gives the same draws on CPU and CUDA; the probabilities (a few hundred KB)
    go to it rather than the generator to them (torch refuses a CPU generator for
    CUDA tensors).
    """
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    cumulative = probs.double().cumsum(dim=-1)
    u = float(torch.rand(1, generator=generator, device=probs.device)) * float(cumulative[-1])
    index = int(torch.searchsorted(cumulative, torch.tensor([u], dtype=torch.float64, device=probs.device), right=True))
    # u < total, so index < V; a zero-probability entry spans no width and is never drawn.
    return min(index, probs.shape[-1] - 1)


def uniforms(n: int, generator: torch.Generator | None) -> list[float]:
    """n uniform draws in [0, 1) from the generator (on its device)."""
    device = generator.device if generator is not None else None
    return torch.rand(n, generator=generator, device=device).tolist() if n else []
