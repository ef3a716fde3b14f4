"""Drafters: whatever proposes the next k tokens for the target to verify.

One small interface (after transformers' candidate generators):
- `propose(tokens, k, sampling, generator) -> Draft`: up to k tokens continuing `tokens`;
- `sync(tokens)`: the committed tokens after a verify; drop any state past them.

`NoDrafter` proposes nothing (speculation off, measured through the same engine),
`NgramDrafter` looks the recent suffix up in the text so far (prompt lookup),
`ModelDrafter` runs a small LM with its own KV cache,
`LookupThenModelDrafter` tries prompt lookup first (free) and the model otherwise;
the engine gives each of its two sources its own draft-length controller.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .kvcache import CachedModel
from .sampling import SamplingParams, sample


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    # [len(tokens), V] distributions the tokens were drawn from (after the same
    # processing as the target's), or None for a deterministic drafter.
    probs: torch.Tensor | None
    seconds: float
    forwards: int = 0


EMPTY_DRAFT = Draft(tokens=[], probs=None, seconds=0.0)


class Drafter(Protocol):
    name: str
    is_model: bool  # True when proposing costs a model forward per token

    def propose(
        self, tokens: Sequence[int], k: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Draft: ...

    def sync(self, tokens: Sequence[int]) -> None: ...

    def reset(self) -> None: ...


class NoDrafter:
    """Speculation off: every step is a plain target step."""

    name = "none"
    is_model = False

    def propose(
        self, tokens: Sequence[int], k: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        return EMPTY_DRAFT

    def sync(self, tokens: Sequence[int]) -> None:
        pass

    def reset(self) -> None:
        pass


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens and
    propose what followed it. Free to run; shines when the answer quotes the
    prompt (code edits, summaries, rewrites). Tries n = max_ngram down to min_ngram.
    """

    name = "ngram"
    is_model = False

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.reset()

    def reset(self) -> None:
        self._tokens: list[int] = []
        # n-gram -> position just after its latest occurrence (indexed incrementally).
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0

    def sync(self, tokens: Sequence[int]) -> None:
        if list(tokens[: len(self._tokens)]) != self._tokens:
            self.reset()  # a different conversation: start over
        self._tokens.extend(tokens[len(self._tokens) :])

    def propose(
        self, tokens: Sequence[int], k: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        start = time.perf_counter()
        self.sync(tokens)
        found = self._lookup(k) if k > 0 else []
        return Draft(tokens=found, probs=None, seconds=time.perf_counter() - start)

    def _lookup(self, k: int) -> list[int]:
        # Index every n-gram that ends before the last token, so a match is always an
        # *earlier* occurrence whose continuation exists.
        toks = self._tokens
        for end in range(max(self._indexed, 1), len(toks)):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n >= 0:
                    self._last_end[tuple(toks[end - n : end])] = end
        self._indexed = max(self._indexed, len(toks) - 1) if toks else 0
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(toks) < n:
                continue
            end = self._last_end.get(tuple(toks[-n:]))
            if end is not None:
                return list(toks[end : end + k])
        return []


class ModelDrafter:
    """A small LM with its own KV cache, proposing k tokens one forward each."""

    is_model = True

    def __init__(self, model: torch.nn.Module, name: str = "draft", vocab_size: int | None = None) -> None:
        self.name = name
        self.runner = CachedModel(model)
        # The target's vocabulary size: a draft with extra rows never proposes ids
        # the target cannot score, and its q is padded to the target's V.
        self.vocab_size = vocab_size

    def reset(self) -> None:
        self.runner.reset()

    def sync(self, tokens: Sequence[int]) -> None:
        self.runner.sync(tokens)

    def propose(
        self, tokens: Sequence[int], k: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        if k <= 0:
            return EMPTY_DRAFT
        start = time.perf_counter()
        forwards_before = self.runner.forwards
        # Keep at most all-but-the-last token: the first forward needs an input.
        cached = self.runner.sync(tokens[:-1])
        # Catch up on committed tokens the cache lacks (e.g. the last draft token and
        # the bonus token after an all-accepted step), then draft one token per forward.
        pending = list(tokens[cached:])
        drafted: list[int] = []
        dists: list[torch.Tensor] = []
        for _ in range(k):
            logits = self._fit_vocab(self.runner.forward(pending, logits_to_keep=1)[-1])
            probs = sampling.probs(logits)
            token = int(logits.argmax()) if sampling.greedy else sample(probs, generator)
            drafted.append(token)
            dists.append(probs)
            pending = [token]
        return Draft(
            tokens=drafted,
            probs=torch.stack(dists),
            seconds=time.perf_counter() - start,
            forwards=self.runner.forwards - forwards_before,
        )

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        v = self.vocab_size
        if v is None or logits.shape[-1] == v:
            return logits
        if logits.shape[-1] > v:
            return logits[:v]
        pad = torch.full((v - logits.shape[-1],), float("-inf"), dtype=logits.dtype, device=logits.device)
        return torch.cat([logits, pad])


class LookupThenModelDrafter:
    """Prompt lookup when the text so far has a match, the draft model otherwise.

    A lookup draft costs microseconds, a model draft one forward per token (on this
    CPU half a target step, see docs/performance.md), so a copied span — an edited
    function, a quoted passage, a repeated identifier — is drafted for free and the
    model covers the rest. The engine asks `lookup()` first, with a k chosen by a
    controller that knows lookup is free, and falls back to `propose()`.
    Lookup needs a match of at least 2 tokens: a 1-token match is mostly chance and
    would pre-empt the better model draft (measured, docs/performance.md).
    """

    is_model = True

    def __init__(self, model: ModelDrafter, lookup: NgramDrafter | None = None) -> None:
        self.model = model
        self.lookup_drafter = lookup or NgramDrafter(max_ngram=4, min_ngram=2)
        self.name = f"ngram+{model.name}"

    @property
    def runner(self) -> CachedModel:
        return self.model.runner

    def reset(self) -> None:
        self.model.reset()
        self.lookup_drafter.reset()

    def sync(self, tokens: Sequence[int]) -> None:
        self.model.sync(tokens)
        self.lookup_drafter.sync(tokens)

    def lookup(self, tokens: Sequence[int], k: int) -> Draft:
        """The free draft: up to k tokens copied from an earlier match, or none."""
        return self.lookup_drafter.propose(tokens, k, SamplingParams(), None)

    def propose(
        self, tokens: Sequence[int], k: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        return self.model.propose(tokens, k, sampling, generator)
