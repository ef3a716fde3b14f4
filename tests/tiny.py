"""Tiny models and a tokenizer built inside the tests (no network, seconds to make)."""

from __future__ import annotations

import copy
from functools import cache

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. Größe, naïve café, 東京 and 🚀 rockets.",
    "Speculative decoding drafts tokens with a small model and verifies them with a big one.",
    "for i in range(10):\n    print(i * i)\n",
    "Ünïcödé текст ελληνικά 中文字符 emoji 😀🎉 mixed with ascii words.",
]


@cache
def tiny_tokenizer(vocab_size: int = 320, extra: str = "") -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few sentences, with ChatML special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*CORPUS, extra] * 3, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHATML
    return fast


def tiny_model(vocab_size: int, seed: int = 0, layers: int = 2, hidden: int = 64) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        # Larger than the usual 0.02 so logits are peaked: fewer near-ties, text with structure.
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def perturbed(model: Qwen2ForCausalLM, scale: float, seed: int = 1) -> Qwen2ForCausalLM:
    """A copy of `model` with noise on every weight: agrees with it part of the time."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return other


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: list[int] | None = None) -> list[int]:
    """The reference: transformers' own greedy decoding."""
    out = model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()
