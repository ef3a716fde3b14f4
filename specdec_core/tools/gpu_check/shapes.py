"""Random-weight checkpoints of real model shapes, and random prompts for them.

Nothing is downloaded: a shape is the architecture part of a real config (Qwen2.5's),
the weights are drawn at random with a fixed seed and saved as bf16 safetensors with a
word-level tokenizer covering the vocabulary, so specdec's own loader reads them as it
reads any folder. Random weights give near-uniform logits, full of near-ties: any
difference between a verify row and a plain step shows up as a changed token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
QWEN_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
QWEN_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)  # fmt: skip
# The smoke run's stand-ins: the same family, shapes small enough for a CPU in seconds.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)  # fmt: skip
# Untied and with more embedding rows than the draft, as the 7B is against the 0.5B.
TINY_BIG = dict(TINY, hidden_size=128, intermediate_size=256, tie_word_embeddings=False, vocab_size=576)

REAL = {"qwen2.5-0.5b": QWEN_05B, "qwen2.5-1.5b": QWEN_15B, "qwen2.5-7b": QWEN_7B}
SMOKE = {"qwen2.5-0.5b": TINY, "qwen2.5-1.5b": TINY, "qwen2.5-7b": TINY_BIG}
# Ids the word-level tokenizer leaves free for special tokens a loader may add.
SPARE_IDS = 8


def save_random(folder: Path, shape: dict[str, Any], device: str, seed: int = 0) -> Path:
    """A random Qwen2 checkpoint of `shape` (bf16 safetensors) plus a tokenizer, in `folder`."""
    config = Qwen2Config(
        **shape, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, pad_token_id=0
    )
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # drawn in bf16: a 7B never exists in fp32
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(folder)
    del model
    vocab = {f"w{i}": i for i in range(shape["vocab_size"] - SPARE_IDS)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")))
    tokenizer.save_pretrained(folder)
    return folder


def random_prompts(vocab_size: int, count: int, length: int, seed: int = 1) -> list[list[int]]:
    """`count` prompts of `length` ids drawn uniformly (never id 0, the pad, nor the spare ids)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size - SPARE_IDS, (length,), generator=gen).tolist() for _ in range(count)]


def repeating_prompt(vocab_size: int, length: int, period: int = 12, seed: int = 2) -> list[int]:
    """A prompt that repeats a `period`-id pattern: the n-gram drafter finds drafts in it."""
    pattern = random_prompts(vocab_size, 1, period, seed)[0]
    return (pattern * (length // period + 1))[:length]
