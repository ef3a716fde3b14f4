"""transformers' own decoding on the same weights: what a user gets without specdec.

Each path's decode cost is taken from two greedy `generate` calls on one prompt, of 1 and
of 1 + n new tokens (end-of-sequence off, so both run to length): the difference over n
is milliseconds per generated token with the prompt's reading taken out, as the step
costs it is set against leave it out.

- eager: `generate` as a model loads, dynamic cache, eager forward;
- compiled: `cache_implementation="static"` with the forward under
  `torch.compile(mode="reduce-overhead")` (transformers' documented fastest plain path);
- assisted: `generate(assistant_model=draft)`. With random weights its draft is rarely
  accepted, so this figure is its cost at acceptance near zero, not its speed on text.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from .timing import synchronize


def _generate_seconds(model: Any, prompt: torch.Tensor, new_tokens: int, **extra: Any) -> float:
    config = GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        eos_token_id=None, pad_token_id=0, **{k: v for k, v in extra.items() if k != "assistant_model"},
    )  # fmt: skip
    assistant = extra.get("assistant_model")
    synchronize(prompt.device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(prompt, generation_config=config, assistant_model=assistant)
    synchronize(prompt.device)
    return time.perf_counter() - start


def decode_ms_per_token(model: Any, prompt_ids: Sequence[int], new_tokens: int, **extra: Any) -> float:
    """Milliseconds per generated token of `model.generate` past the prompt (module doc).

    A warm-up pair runs first (compilation, allocator, first-use costs), then the timed pair."""
    prompt = torch.tensor([list(prompt_ids)], device=model.device)
    for _ in range(2):
        one = _generate_seconds(model, prompt, 1, **extra)
        many = _generate_seconds(model, prompt, 1 + new_tokens, **extra)
    return max(many - one, 0.0) / new_tokens * 1e3


def compile_forward(model: Any) -> None:
    """transformers' fastest plain path: the forward compiled to CUDA graphs (reduce-overhead)."""
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
