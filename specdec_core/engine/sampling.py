"""Turning logits into a distribution and drawing from it.

The same `SamplingParams.probs()` is applied to draft and target logits, which
is what speculative sampling needs for the output to follow the target's
(processed) distribution exactly. Order follows transformers' warpers:
temperature, then top-k, then top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    # As transformers' TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p,
    # always keeping at least the most likely token.
    sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """probs: [V] -> one token id, drawn on the generator's device.

    The engine seeds one CPU generator for a run whatever the models' device, so a
    seed gives the same draws on CPU and CUDA; the probabilities (a few hundred KB)
    go to it rather than the generator to them (torch refuses a CPU generator for
    CUDA tensors).
    """
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def uniforms(n: int, generator: torch.Generator | None) -> list[float]:
    """n uniform draws in [0, 1) from the generator (on its device)."""
    device = generator.device if generator is not None else None
    return torch.rand(n, generator=generator, device=device).tolist() if n else []
