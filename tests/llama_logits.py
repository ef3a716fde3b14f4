"""The file `llama-perplexity --kl-divergence-base FILE` writes, read back, and our model's
log-probabilities compared with it (tests/test_llama_parity.py).

The layout is llama.cpp's (tools/perplexity/perplexity.cpp, `perplexity` and the
`process_logits` that writes a stream): "_logits_", then int32 n_ctx, n_vocab, n_chunk,
then the n_chunk * n_ctx token ids it read (as tokenized: llama.cpp puts BOS in place of
each chunk's first token when it evaluates, when its vocabulary adds BOS), then for each
chunk the n_ctx - 1 - n_ctx/2 positions it scores (the second half, but the last), one row
each of `2 * ((n_vocab + 1) // 2) + 4` uint16: two float32 (scale, min_log_prob), then one
uint16 q per token, whose log-probability is `scale * q + min_log_prob`. Tokens more than
16 below the top logit are stored as that floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC = b"_logits_"
# llama.cpp's KL leaves out the tokens at its floor (p < e^-16), as `log_softmax` in
# perplexity.cpp does when it reads the file back.
FLOOR = -16.0


@dataclass(frozen=True)
class BaseLogits:
    n_ctx: int
    tokens: np.ndarray  # [n_chunk, n_ctx] int32, as tokenized
    log_probs: np.ndarray  # [n_chunk, n_scored, n_vocab] float32
    steps: np.ndarray  # [n_chunk, n_scored] float32: each row's quantization step (scale)

    @property
    def first(self) -> int:
        """The first scored position of a chunk: its logits predict the token after it."""
        return self.n_ctx // 2


def read_base(path: Path) -> BaseLogits:
    data = path.read_bytes()
    if data[:8] != MAGIC:
        raise ValueError(f"{path.name}: not a llama-perplexity logits file")
    n_ctx, n_vocab, n_chunk = np.frombuffer(data, np.int32, 3, 8)
    offset = 8 + 12
    tokens = np.frombuffer(data, np.int32, n_chunk * n_ctx, offset).reshape(n_chunk, n_ctx)
    offset += tokens.nbytes
    n_scored, width = n_ctx - 1 - n_ctx // 2, 2 * ((n_vocab + 1) // 2) + 4
    rows = np.frombuffer(data, np.uint16, n_chunk * n_scored * width, offset).reshape(n_chunk, n_scored, width)
    if offset + rows.nbytes != len(data):
        raise ValueError(f"{path.name}: {len(data) - offset - rows.nbytes} bytes beyond the layout")
    head = np.ascontiguousarray(rows[..., :4]).view(np.float32)  # [n_chunk, n_scored, 2]
    scale, minimum = head[..., :1], head[..., 1:2]
    log_probs = scale * rows[..., 4 : 4 + n_vocab].astype(np.float32) + minimum
    return BaseLogits(int(n_ctx), tokens.copy(), log_probs, head[..., 0].copy())


def evaluated(base: BaseLogits, bos: int | None) -> np.ndarray:
    """The ids llama.cpp ran per chunk: BOS in place of each chunk's first token when its
    tokenization began the text with BOS (the vocabulary adds it)."""
    chunks = base.tokens.copy()
    if bos is not None and chunks[0, 0] == bos:
        chunks[:, 0] = bos
    return chunks


@dataclass(frozen=True)
class Agreement:
    positions: int
    kl_mean: float
    kl_max: float
    top1: float  # the share of positions whose top token agrees


def scored(base: BaseLogits, logits: list[torch.Tensor]) -> np.ndarray:
    """Log-probabilities [n_chunk, n_scored, n_vocab] at the positions llama.cpp scored, from
    our [n_ctx, n_vocab] logits of each chunk."""
    rows = [chunk[base.first : base.first + base.log_probs.shape[1]].double() for chunk in logits]
    return torch.log_softmax(torch.stack(rows), dim=-1).numpy()


def compare(base: BaseLogits, log_probs: np.ndarray) -> Agreement:
    """KL(base || log_probs) and top-1 agreement over the scored positions. The top token of
    `log_probs` agrees when the base's log-probability of it is within one of the base file's
    quantization steps of its best: closer than that, the file cannot tell the two apart."""
    theirs, mine = base.log_probs.astype(np.float64), log_probs.astype(np.float64)
    if theirs.shape != mine.shape:
        raise ValueError(f"log-probabilities {mine.shape} for a base of {theirs.shape}")
    kl = np.where(theirs > FLOOR, np.exp(theirs) * (theirs - mine), 0.0).sum(-1).reshape(-1)
    top = np.take_along_axis(theirs, mine.argmax(-1)[..., None], -1)[..., 0]
    same = (top >= theirs.max(-1) - base.steps).reshape(-1)
    return Agreement(len(kl), float(kl.mean()), float(kl.max()), float(same.mean()))
