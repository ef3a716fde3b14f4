"""A draft head that scores only the ids a conversation is likely to need.

The draft's output head is a large share of what a draft step reads (Qwen2.5 0.5B at
4 bits: 151,936 rows x 896, 85 of 308 MB), and every model draft token reads it in
full. `RankedHead` stores the rows in order of usefulness, so a step can score just a
prefix of them: the kernel's layout keeps each block of 16 rows contiguous, and a
prefix of rows is a prefix of the bytes. A draft that scores fewer rows never proposes
the others, and the output is untouched: the target verifies every token, and the
ids left out get draft probability 0 (logit -inf), so rejection sampling still gives
the target's distribution.

Which rows come first: the stop tokens (so a draft can end an answer), then every
conversation's wrapping (special tokens, turn markers, role names: `chat.template_token_ids`;
counted outside a tier, these few ids alone kept short chats from every tier), then the
rest by id. Byte-level BPE vocabularies number tokens in merge order, so low ids are the
common merges: in this repo's docs and code, and in the bench prompts, no token of
Qwen2.5's vocabulary at or above id 100,000 appears outside the chat template's own
tokens. Other scripts live higher up (Chinese, Korean, Russian text: 30-45% of tokens
at or above 100,000), so `VocabTiers` picks the prefix per draft from the ids the
conversation itself uses, and scores every row when a prefix would miss too many.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch

from ..kernels.cpu.int4_cpu import Int4Linear, output_head, pack, unpack

TIERS = (65_536, 100_000)  # row counts a draft may score, fewest first
MAX_MISS = 1 / 200  # a tier serves a conversation if at most this share of its ids lie outside


def rank_order(vocab_size: int, first: Iterable[int] = ()) -> torch.Tensor:
    """Ids by rank: `first` (e.g. stop tokens, in the given order), then the others by id."""
    leading = list(dict.fromkeys(i for i in first if 0 <= i < vocab_size))
    rest = torch.ones(vocab_size, dtype=torch.bool)
    rest[leading] = False
    return torch.cat([torch.tensor(leading, dtype=torch.long), rest.nonzero().flatten()])


class RankedHead(Int4Linear):
    """An LM head with its rows stored by rank; scores the first `limit` ranks.

    Its output is in id order over all `out_features` ids, as any head's: the unscored
    ids hold -inf. `limit` is the draft's to set (`scoring`); it is every row otherwise.
    `tiers`: the row counts a draft may choose to score (`VocabTiers`), fewest first.
    """

    order: torch.Tensor  # rank -> id
    rank: torch.Tensor  # id -> rank

    def __init__(self, head: Int4Linear, order: torch.Tensor, tiers: Sequence[int] = TIERS) -> None:
        q, scale, minimum = (part[order] for part in unpack(head.packed, head.out_features))
        bias = None if head.bias is None else head.bias.detach()[order]
        super().__init__(pack(q, scale, minimum, head.bits), head.out_features, bias)
        self.register_buffer("order", order.clone())
        self.register_buffer("rank", torch.empty_like(order).index_copy_(0, order, torch.arange(len(order))))
        self.limit = head.out_features
        self.tiers = sorted(t for t in tiers if t < head.out_features)

    @contextlib.contextmanager
    def scoring(self, limit: int) -> Iterator[None]:
        """Score only the first `limit` ranks inside the block."""
        previous, self.limit = self.limit, max(1, min(limit, self.out_features))
        try:
            yield
        finally:
            self.limit = previous

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        ranked = self.matmul(rows, self.limit)  # [rows, limit], rank order
        out = torch.full((rows.shape[0], self.out_features), float("-inf"))
        out.index_copy_(1, self.order[: self.limit], ranked)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)


def rank_head(model: torch.nn.Module, first: Iterable[int]) -> RankedHead | None:
    """Replace a 4-bit LM head with its ranked form (stop tokens `first`); None if it is not one."""
    head = output_head(model)
    if isinstance(head, RankedHead) or not isinstance(head, Int4Linear) or head.out_features <= min(TIERS):
        return None
    ranked = RankedHead(head, rank_order(head.out_features, first))
    model.set_output_embeddings(ranked)  # type: ignore[operator]
    return ranked


class VocabTiers:
    """Which prefix of a ranked head to score, from the ids of the conversation so far.

    Counts, incrementally, the conversation's ids outside each tier. A tier serves when
    at most `MAX_MISS` of them lie outside it: an id the draft cannot propose ends its
    run early, so a tier that misses often costs more than its smaller read saves.
    """

    def __init__(self, head: RankedHead) -> None:
        self.head = head
        self.tiers = head.tiers
        self._counted = 0  # how many of the conversation's ids are counted
        self._last = -1  # the last of them: another conversation differs there (or is shorter)
        self._outside = [0] * len(self.tiers)

    def limit(self, tokens: Sequence[int]) -> int:
        self._count(tokens)
        n = self._counted
        for tier, outside in zip(self.tiers, self._outside, strict=True):
            if n and outside <= MAX_MISS * n:
                return tier
        return self.head.out_features

    def _count(self, tokens: Sequence[int]) -> None:
        done = self._counted
        if done > len(tokens) or (done and tokens[done - 1] != self._last):
            self._outside, done = [0] * len(self.tiers), 0  # another conversation
        new = [t for t in tokens[done:] if 0 <= t < self.head.out_features]
        self._counted = len(tokens)
        self._last = tokens[-1] if tokens else -1
        if not new or not self.tiers:
            return
        ranks = self.head.rank[torch.tensor(new, dtype=torch.long)]
        for i, tier in enumerate(self.tiers):
            self._outside[i] += int((ranks >= tier).sum())
