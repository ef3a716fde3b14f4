"""Tiny random models of each architecture family the engine must handle exactly.

Two layers, hidden 64, a 16-token sliding window where the family has one: tests run
contexts well past the window in well under a second per model.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

WINDOW = 16
_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    # Peaked logits (fewer near-ties) and text with structure, as tests/tiny.py.
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
)
_GEMMA: dict[str, Any] = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW)

ARCHS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    # Layer 0 full, layer 1 sliding: a hybrid cache.
    "qwen2-swa": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    # `sliding_window` alone, no layer_types: every layer slides.
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=WINDOW)),
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        dict(_GEMMA, attn_logit_softcapping=20.0, final_logit_softcapping=30.0),
    ),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(_GEMMA, sliding_window_pattern=2)),
    "phi3": (Phi3Config, Phi3ForCausalLM, dict(sliding_window=WINDOW)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16)),
}


def arch_model(arch: str, vocab_size: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(vocab_size=vocab_size, **{**_SHAPE, **extra})
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    return model
