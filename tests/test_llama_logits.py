"""The reader of llama-perplexity's logits file (tests/llama_logits.py), on a file written
here in llama.cpp's layout, so that it is checked where no llama.cpp is built."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from llama_logits import compare, evaluated, read_base, scored

N_CTX, N_VOCAB, N_CHUNK = 8, 5, 2


def write_like_llama_cpp(path: Path, tokens: np.ndarray, logits: np.ndarray) -> None:
    """`perplexity.cpp`'s stream: header, tokens, then per scored row (scale, min_log_prob) and
    uint16 codes, as its `log_softmax` writes them (16 nats below the top kept)."""
    n_scored = N_CTX - 1 - N_CTX // 2
    width = 2 * ((N_VOCAB + 1) // 2) + 4
    out = bytearray(b"_logits_" + struct.pack("<3i", N_CTX, N_VOCAB, N_CHUNK) + tokens.astype(np.int32).tobytes())
    for chunk in range(N_CHUNK):
        for row in logits[chunk, N_CTX // 2 : N_CTX // 2 + n_scored]:
            top, low = row.max(), max(row.min(), row.max() - 16)
            log_sum = np.log(np.exp(row - top).sum())
            scale = (top - low) / 65535
            codes = np.zeros(width - 4, np.uint16)
            codes[:N_VOCAB] = np.where(row > low, np.rint((row - low) / scale), 0)
            out += struct.pack("<2f", scale, low - top - log_sum) + codes.tobytes()
    path.write_bytes(bytes(out))


@pytest.fixture
def written(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, N_VOCAB, (N_CHUNK, N_CTX))
    tokens[0, 0] = 1  # the text began with BOS
    logits = rng.normal(0, 3, (N_CHUNK, N_CTX, N_VOCAB)).astype(np.float32)
    write_like_llama_cpp(tmp_path / "base.logits", tokens, logits)
    return tokens, torch.from_numpy(logits)


def test_the_reader_returns_the_tokens_and_the_log_probabilities_within_a_step(written, tmp_path):
    tokens, logits = written
    base = read_base(tmp_path / "base.logits")
    assert np.array_equal(base.tokens, tokens)
    expected = scored(base, list(logits))
    assert base.log_probs.shape == expected.shape == (N_CHUNK, N_CTX - 1 - N_CTX // 2, N_VOCAB)
    assert np.all(np.abs(base.log_probs - expected) <= base.steps[..., None])


def test_every_chunk_starts_with_bos_when_the_text_did(written, tmp_path):
    base = read_base(tmp_path / "base.logits")
    assert evaluated(base, bos=1)[:, 0].tolist() == [1] * N_CHUNK
    assert np.array_equal(evaluated(base, bos=2), base.tokens)  # the text did not begin with BOS 2


def test_the_same_logits_agree_and_other_logits_do_not(written, tmp_path):
    _, logits = written
    base = read_base(tmp_path / "base.logits")
    same = compare(base, scored(base, list(logits)))
    assert same.top1 == 1.0 and abs(same.kl_mean) < 1e-4  # the codes' rounding only
    other = compare(base, scored(base, list(logits.flip(-1))))
    assert other.top1 < 1.0 and other.kl_mean > 0.1


def test_a_file_longer_than_its_layout_is_refused(written, tmp_path):
    path = tmp_path / "base.logits"
    path.write_bytes(path.read_bytes() + b"\0\0")
    with pytest.raises(ValueError, match="beyond the layout"):
        read_base(path)
