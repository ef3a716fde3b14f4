"""Tiny HF folders of each family the app offers, in the form llama.cpp's converter reads:
config, safetensors and a tokenizer it recognises (tests/test_llama_parity.py).

Every linear's rows are whole 256-weight blocks (hidden 256, feed-forward 512, 4 heads of
64), so llama-quantize's K-quants apply as they do to a real model. The SentencePiece
families (llama, mistral, gemma, phi3) carry a `tokenizer.model` trained here; the BPE
families (qwen2, qwen3) a byte-level BPE `tokenizer.json`, whose pre-tokenizer the
converter is told is Qwen2's (tests/llama_convert.py): its hash of the tokenization of a
fixed text names only the published vocabularies.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import torch
from archs import ARCHS

VOCAB = 512
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 4, 2, 64
WINDOW = 32
BOS, EOS = 1, 2
_SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=FFN,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    # Peaked logits: few near-ties for top-1 agreement to flip on.
    initializer_range=0.2,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=0,
)
# Gemma ties its head to the embeddings (the converter writes no output.weight for it).
_GEMMA: dict[str, Any] = dict(
    head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW, tie_word_embeddings=True,
    # The embedding scaled by sqrt(width) in the graph: a smaller init keeps the logits from a
    # one-hot distribution, on which no rounding or mistake would show.
    initializer_range=0.03,
)
_LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=64,
)  # fmt: skip
# Half the rotary frequencies scaled long, half short; the file's context beyond the original.
_LONGROPE = dict(
    rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64,
    long_factor=[1.0 + i / 8 for i in range(HEAD_DIM // 2)], short_factor=[1.0 + i / 64 for i in range(HEAD_DIM // 2)],
)  # fmt: skip

# name: (the family in tests/archs.py, its config beside the shape above, tokenizer kind)
FAMILIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("llama", {}, "spm"),
    "llama3-rope": ("llama", dict(rope_parameters=_LLAMA3_ROPE), "spm"),
    "qwen2": ("qwen2", {}, "bpe"),
    "qwen3": ("qwen3", dict(head_dim=HEAD_DIM), "bpe"),
    # A Mistral converts to llama.cpp's llama architecture, which has no sliding window: the
    # file means full attention, whatever the HF config said (transformers slides).
    "mistral": ("mistral", dict(sliding_window=WINDOW), "spm"),
    "gemma2": ("gemma2", dict(_GEMMA, attn_logit_softcapping=20.0, final_logit_softcapping=30.0), "spm"),
    # Six layers: Gemma 3's pattern of five sliding layers, then one full; the converter writes
    # no pattern, and llama.cpp takes that one.
    "gemma3": ("gemma3", dict(_GEMMA, num_hidden_layers=6), "spm"),
    "phi3": ("phi3", dict(rope_parameters=_LONGROPE), "spm"),
}

_SYLLABLES = ["ka", "lo", "mi", "re", "tu", "sa", "ne", "po", "vi", "da", "ri", "ko", "le", "ma", "su", "to", "be", "ni", "ra", "go"]


def text(words: int, seed: int = 0) -> str:
    """Words of a small invented language, with repeats for the model's attention to find."""
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 3))) for _ in range(300)]
    phrases = [" ".join(rng.choices(vocabulary, k=rng.randint(3, 8))) for _ in range(40)]
    return ". ".join(rng.choice(phrases) for _ in range(words // 5)) + ".\n"


def write_folder(family: str, folder: Path) -> Path:
    """The tiny HF folder of `family`, random weights (seeded), its tokenizer beside them."""
    arch, extra, tokenizer = FAMILIES[family]
    config_cls, model_cls, _ = ARCHS[arch]
    config = config_cls(**{**_SHAPE, **extra})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if tokenizer == "spm":
        _write_sentencepiece(folder)
    else:
        _write_byte_level_bpe(folder)
    return folder


def _write_sentencepiece(folder: Path) -> None:
    import sentencepiece as spm

    model = io.BytesIO()
    # <|endoftext|> beside <unk>, <s>, </s>: llama.cpp marks all four in a Phi-3's vocabulary.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text(4000, seed=1).split(". ")), model_writer=model, vocab_size=VOCAB,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=BOS, eos_id=EOS,
        pad_id=-1, minloglevel=2, user_defined_symbols=["<|endoftext|>"],
    )  # fmt: skip
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    # BOS before each text: llama-perplexity then starts every chunk with it. The class is
    # what the Phi-3 converter reads to tell a SentencePiece vocabulary from Phi-4's BPE.
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False}
    ))


def _write_byte_level_bpe(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    backend.train_from_iterator(text(4000, seed=1).split(". "), trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(folder)
