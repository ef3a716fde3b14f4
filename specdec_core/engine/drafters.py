"""Draft strategies: whatever proposes the next tokens for the target to verify.

One small interface (after transformers' candidate generators), `DraftStrategy`:
- `start(plan)`: a generation begins (its max/pinned k and the engine's measured costs);
- `draft(tokens, budget, sampling, generator) -> Draft`: the strategy's own
  controller(s) choose how many tokens (0 = a plain target step) and which source;
- `observe(draft, accepted, committed, greedy)`: the verdict, for its controllers;
- `sync(tokens)`: the committed tokens after a verify; drop any state past them;
- `runners()`: the draft models it runs, so calibration can time them;
- `caches_for(tokens)`: each draft cache and what it should hold to have read `tokens`
  (the start of a prompt still being written, `SpeculativeEngine.read_ahead`);
- `seconds_per_token()`: what drafting one token costs it, as measured.

`NoDrafter` proposes nothing (speculation off, measured through the same engine),
`NgramDrafter` looks the recent suffix up in the text so far (prompt lookup),
`ModelDrafter` runs a small LM with its own KV cache,
`LookupThenModelDrafter` (policy.py) picks per step between copies (`NgramDrafter` or
`suffix_drafter.SuffixDrafter`, any `Lookup`) and the model, by expected
tokens per second; with `cascade`, greedy copies are checked by the model first. The engine never looks inside a strategy. (Just over 400 lines:
the four strategies share one interface and read best side by side.)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from ..kernels.cpu.int4_cpu import output_head
from ..kernels.dispatch import runner_for
from ..kernels.runner import Runner
from .adaptive import ConfidenceCalibration, CostModel, DraftLengthController
from .draft_vocab import RankedHead, VocabTiers
from .policy import PLAIN, Choice, SourcePolicy
from .sampling import SamplingParams, sample

# Draft specs that need no model (the DraftSpec parser and the UI use these names).
NGRAM = "ngram"
SUFFIX = "suffix"
NONE = "none"
MODEL_FREE_DRAFTS = (NGRAM, SUFFIX, NONE)


class DraftSource(str, Enum):
    NONE = "none"  # nothing drafted: a plain target step
    LOOKUP = "lookup"  # copied from an earlier occurrence in the text
    MODEL = "model"  # drafted by the draft model
    LOOKUP_MODEL = "lookup+model"  # a lookup run extended by the draft model
    MODEL_LOOKUP = "model+lookup"  # model tokens after which copying resumed (maybe copies first too)
    CASCADE = "cascade"  # copies the draft model checked, then its own tokens (`LookupThenModelDrafter`)


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    # [len(tokens), V] distributions the tokens were drawn from (after the same
    # processing as the target's), or None for a deterministic drafter. Copied
    # tokens in a mixed draft have one-hot rows (q = 1 for the copied token).
    probs: torch.Tensor | None
    seconds: float
    forwards: int = 0
    source: DraftSource = DraftSource.NONE
    requested: int = 0  # the k the strategy's controller asked for
    copied: int = 0  # leading tokens that came from lookup (no draft probability)
    resumed: int = 0  # trailing tokens copied after the model's (no draft probability)

    def is_copy(self, i: int) -> bool:
        """Whether token i was copied rather than drawn from a draft distribution."""
        return i < self.copied or i >= len(self.tokens) - self.resumed


EMPTY_DRAFT = Draft(tokens=[], probs=None, seconds=0.0)


@dataclass(frozen=True)
class DraftPlan:
    """What a strategy needs to know for one generation."""

    costs: CostModel
    max_k: int = 8
    pinned: int | None = None  # a fixed k, or None to choose per step
    # Copies cost nothing to draft, only the verify's width: a copied draft may run this
    # long (0: max_k) where its tokens keep being accepted.
    max_copy: int = 0

    @property
    def copy_limit(self) -> int:
        """The longest copied draft; none where drafting is off (max_k 0)."""
        return max(self.max_k, self.max_copy) if self.max_k > 0 else 0


class DraftStrategy(Protocol):
    name: str

    def start(self, plan: DraftPlan) -> None: ...

    def draft(
        self, tokens: Sequence[int], budget: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Draft: ...

    def observe(self, draft: Draft, accepted: int, committed: Sequence[int], greedy: bool) -> None: ...

    def sync(self, tokens: Sequence[int]) -> None: ...

    def reset(self) -> None: ...

    def runners(self) -> tuple[Runner, ...]: ...

    def caches_for(self, tokens: Sequence[int]) -> list[tuple[Runner, Sequence[int]]]: ...

    def seconds_per_token(self) -> float: ...


Drafter = DraftStrategy  # the name the rest of the code base has used


class Lookup(Protocol):
    """A model-free source of copies from the text so far (`NgramDrafter`, `SuffixDrafter`)."""

    name: str

    def match(self, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens to copy after `tokens`, and the key their acceptance is kept under
        (the length of the match they came from)."""
        ...

    def match_after(self, tokens: Sequence[int], extra: Sequence[int], k: int) -> tuple[list[int], int]:
        """`match` for `tokens` then `extra`, draft tokens that are matched, never indexed."""
        ...

    def sync(self, tokens: Sequence[int]) -> None: ...

    def reset(self) -> None: ...


class NoDrafter:
    """Speculation off: every step is a plain target step."""

    name = NONE

    def start(self, plan: DraftPlan) -> None:
        pass

    def draft(
        self, tokens: Sequence[int], budget: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        return EMPTY_DRAFT

    def observe(self, draft: Draft, accepted: int, committed: Sequence[int], greedy: bool) -> None:
        pass

    def sync(self, tokens: Sequence[int]) -> None:
        pass

    def reset(self) -> None:
        pass

    def runners(self) -> tuple[Runner, ...]:
        return ()

    def caches_for(self, tokens: Sequence[int]) -> list[tuple[Runner, Sequence[int]]]:
        return []

    def seconds_per_token(self) -> float:
        return 0.0


class LookupDrafter:
    """A model-free drafter: copies what followed an earlier match of the latest tokens, free
    to run; its real cost is the longer verify, which is measured. A subclass says where the
    copies come from (`match`) and keeps its text (`sync`, `reset`)."""

    def __init__(self) -> None:
        self.controller = DraftLengthController()

    def max_k(self, plan: DraftPlan) -> int:
        """The longest draft this drafter proposes under `plan`."""
        return plan.max_k

    def start(self, plan: DraftPlan) -> None:
        previous = self.controller
        self.controller = DraftLengthController(max_k=self.max_k(plan), pinned=plan.pinned, costs=plan.costs)
        self.controller.carry_from(previous)

    def draft(
        self, tokens: Sequence[int], budget: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        k = self.controller.choose_k(drafter_is_model=False, limit=budget)
        if k <= 0:
            return Draft(tokens=[], probs=None, seconds=0.0)
        start = time.perf_counter()
        found, _ = self.match(tokens, k)
        source = DraftSource.LOOKUP if found else DraftSource.NONE
        return Draft(found, None, time.perf_counter() - start, source=source, requested=k, copied=len(found))

    def observe(self, draft: Draft, accepted: int, committed: Sequence[int], greedy: bool) -> None:
        self.controller.observe(len(draft.tokens), accepted)

    def match(self, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the latest earlier match, and the match's length."""
        raise NotImplementedError

    def runners(self) -> tuple[Runner, ...]:
        return ()

    def caches_for(self, tokens: Sequence[int]) -> list[tuple[Runner, Sequence[int]]]:
        return []

    def seconds_per_token(self) -> float:
        return 0.0  # microseconds


class NgramDrafter(LookupDrafter):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens and
    propose what followed it. Free to run; shines when the answer quotes the
    prompt (code edits, summaries, rewrites). Tries n = max_ngram down to min_ngram.
    """

    name = NGRAM

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        super().__init__()
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

    def match(self, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the latest earlier match, and the match's length n."""
        return self.match_after(tokens, (), k)

    def match_after(self, tokens: Sequence[int], extra: Sequence[int], k: int) -> tuple[list[int], int]:
        """`match` for `tokens` followed by `extra`, draft tokens not yet committed.

        `extra` is matched but never indexed, so the copies always come from committed
        text and a rejected draft leaves the index as it was.
        """
        self.sync(tokens)
        if k <= 0:
            return [], 0
        self._index()
        tail = [*self._tokens[-self.max_ngram :], *extra]
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tail) < n:
                continue
            found = self._last_end.get(tuple(tail[-n:]))
            if found is not None:
                return list(self._tokens[found : found + k]), n
        return [], 0

    def _index(self) -> None:
        """Index every n-gram that ends before the last token, so a match is always an
        *earlier* occurrence whose continuation exists."""
        toks = self._tokens
        for end in range(max(self._indexed, 1), len(toks)):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n >= 0:
                    self._last_end[tuple(toks[end - n : end])] = end
        self._indexed = max(self._indexed, len(toks) - 1) if toks else 0


MAX_CATCH_UP = 512  # the most new tokens a model draft reads at once (ModelDrafter._window)
WINDOW = 256  # how many of the latest tokens it reads instead


class ModelDrafter:
    """A small LM with its own KV cache, proposing tokens one forward each.

    Unless k is pinned, a draft stops early when the next token looks unlikely to
    be accepted: its (calibrated) confidence times the chance of reaching it is
    worth less than the draft forward and the longer verify it costs. The target
    verifies every token, so this only changes speed, never the output.
    """

    def __init__(self, model: torch.nn.Module, name: str = "draft", vocab_size: int | None = None) -> None:
        self.name = name
        self.runner = runner_for(model, draft=True)
        # The target's vocabulary size: a draft with extra rows never proposes ids
        # the target cannot score, and its q is padded to the target's V.
        self.vocab_size = vocab_size
        head = output_head(model)
        # A ranked head scores only the ids this conversation is likely to need (draft_vocab.py).
        self.tiers = VocabTiers(head) if isinstance(head, RankedHead) else None
        self.costs = CostModel()
        self.controller = DraftLengthController()
        self.calibration = ConfidenceCalibration()
        self.early_stop = True
        # A draft reads a long prompt's last `window` tokens only (`_window`): its first draft
        # would otherwise wait for the whole prompt to be read, a cost per token
        # (docs/engine.md#a-window-on-long-prompts-modeldrafter_window).
        self.max_catch_up = MAX_CATCH_UP
        self.window = WINDOW
        self.window_start = 0  # the draft's cache holds tokens[window_start:]
        self._confidences: list[float] = []
        self._forward_times: list[tuple[int, float]] = []  # (tokens read, seconds) per forward of the last draft

    def start(self, plan: DraftPlan) -> None:
        self.costs = plan.costs
        previous = self.controller
        self.controller = DraftLengthController(max_k=plan.max_k, pinned=plan.pinned, costs=plan.costs)
        self.controller.carry_from(previous)
        self.early_stop = plan.pinned is None

    def reset(self) -> None:
        self.runner.reset()
        self.window_start = 0

    def sync(self, tokens: Sequence[int]) -> None:
        self.runner.sync(self._view(tokens))

    def _view(self, tokens: Sequence[int]) -> Sequence[int]:
        """`tokens` from where the draft's cache starts (`window_start`)."""
        if self.window_start >= len(tokens):
            self.reset()  # a shorter conversation than the one the window was cut from
        return tokens[self.window_start :]

    def _window(self, tokens: Sequence[int]) -> tuple[Sequence[int], int]:
        """The part of `tokens` the draft reads, and how many of them its cache holds (at most
        all but the last: a forward needs an input). That is all of `tokens`, unless it would
        mean reading more than `max_catch_up` new tokens at once (a long pasted prompt); then
        only the last `window` of them, as if the conversation began there. The draft's
        numbers only choose what the target checks, so a shorter context costs acceptance,
        never exactness."""
        seen = self._view(tokens)
        cached = self.runner.sync(seen[:-1])
        if len(seen) - cached <= self.max_catch_up:
            return seen, cached
        self.runner.reset()
        self.window_start = max(0, len(tokens) - self.window)
        return tokens[self.window_start :], 0

    def runners(self) -> tuple[Runner, ...]:
        return (self.runner,)

    def caches_for(self, tokens: Sequence[int]) -> list[tuple[Runner, Sequence[int]]]:
        """The whole of `tokens` for the one cache: read ahead, a long prompt needs no window."""
        if self.window_start:
            self.reset()
        return [(self.runner, tokens)]

    def seconds_per_token(self) -> float:
        return self.costs.draft_token or 0.0

    def draft(
        self, tokens: Sequence[int], budget: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        k = self.controller.choose_k(drafter_is_model=True, limit=budget)
        return self.propose(tokens, self.run_limit(k, budget), sampling, generator)

    def run_limit(self, planned: int, room: int) -> int:
        """The most tokens to draft where `planned` were chosen and `room` fit: the plan when
        k is pinned (or nothing is drafted), else all the room, up to max_k.

        Where a run ends is then the early stop's call, token by token, from each token's
        calibrated confidence. The planned k rests on acceptance by position, averaged over
        steps, which cannot tell a sure run from a doubtful one: on edits the model drafts
        well, it plans short runs of which nearly every token is accepted
        (docs/engine.md#drafters).
        """
        if planned <= 0 or not self.early_stop:
            return planned
        return max(planned, min(room, self.controller.max_k))

    def observe(self, draft: Draft, accepted: int, committed: Sequence[int], greedy: bool) -> None:
        self.controller.observe(len(draft.tokens), accepted)
        self.observe_model_tokens(draft, accepted)

    def observe_model_tokens(self, draft: Draft, accepted: int) -> None:
        """Feed the confidence calibration and the draft cost from a (possibly mixed) draft."""
        for i, confidence in enumerate(self._confidences):
            position = draft.copied + i
            if position > accepted:
                break  # never reached
            self.calibration.observe(confidence, position < accepted)
        self._confidences = []
        if self._forward_times:
            self.costs.observe_draft_first(*self._forward_times[0])
        one_token = [seconds for m, seconds in self._forward_times if m == 1]
        self.costs.observe_draft(len(one_token), sum(one_token))
        self._forward_times = []

    def propose(
        self,
        tokens: Sequence[int],
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        reach: float = 1.0,
        handoff: Callable[[Sequence[int]], bool] | None = None,
        after: torch.Tensor | None = None,
    ) -> Draft:
        """Up to k tokens continuing `tokens`; `reach` is the chance the first is even checked.

        `handoff(drafted)`, asked after each token, ends the draft where it returns True
        (something cheaper takes over from there), before the next forward is paid.
        `after`: the logits that follow `tokens`, all of which the cache then holds (from
        `check`), so the first token costs no forward."""
        self._confidences = []
        if after is None:
            self._forward_times = []  # else they hold the check's forward
        if k <= 0:
            return Draft(tokens=[], probs=None, seconds=0.0)
        start = time.perf_counter()
        forwards_before = self.runner.forwards
        pending: list[int] = []
        if after is None:
            # Catch up on committed tokens the cache lacks (e.g. the last draft token and
            # the bonus token after an all-accepted step), then draft one token per forward.
            seen, cached = self._window(tokens)
            pending = list(seen[cached:])
        with self._scoring(tokens):
            drafted, dists = self._draft_tokens(pending, k, sampling, generator, reach, handoff, after)
        return Draft(
            tokens=drafted,
            probs=torch.stack(dists),
            seconds=time.perf_counter() - start,
            forwards=self.runner.forwards - forwards_before,
            source=DraftSource.MODEL,
            requested=k,
        )

    def check(self, tokens: Sequence[int], proposal: Sequence[int]) -> tuple[int, torch.Tensor]:
        """Read `proposal` after `tokens` in one forward: how many of its leading tokens are
        the draft's own greedy choice, and the logits that follow those (staged speculative
        decoding, Spector & Re 2023: the draft checks the copies it must read anyway).

        The cache then holds `tokens` and the agreed tokens, so `propose(..., after=logits)`
        drafts on from the first disagreement with the draft's own token."""
        self._confidences = []
        self._forward_times = []
        seen, cached = self._window(tokens)
        pending = [*seen[cached:], *proposal]
        start = time.perf_counter()
        with self._scoring(tokens):
            logits = self._fit_vocab(self.runner.forward(pending, logits_to_keep=len(proposal) + 1))
        guesses = logits.argmax(-1).tolist()  # [len(proposal) + 1]
        self._forward_times.append((len(pending), time.perf_counter() - start))
        kept = 0
        while kept < len(proposal) and guesses[kept] == proposal[kept]:
            kept += 1
        self.runner.crop(len(seen) + kept)
        return kept, logits[kept]

    def _scoring(self, tokens: Sequence[int]) -> contextlib.AbstractContextManager[None]:
        if self.tiers is None:
            return contextlib.nullcontext()
        return self.tiers.head.scoring(self.tiers.limit(tokens))

    def _draft_tokens(
        self,
        pending: list[int],
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        reach: float,
        handoff: Callable[[Sequence[int]], bool] | None,
        after: torch.Tensor | None = None,
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Tokens and their draft distributions, one forward each from `pending` (the tokens
        the cache lacks; none where `after` holds the first token's logits), until k or an
        early stop."""
        drafted: list[int] = []
        dists: list[torch.Tensor] = []
        for _ in range(k):
            forward_start = time.perf_counter()
            if after is None:
                logits = self._fit_vocab(self.runner.forward(pending, logits_to_keep=1)[-1])
            else:
                logits, after = after, None
            probs = sampling.probs(logits)
            # One pass for both: a separate argmax over a whole vocabulary costs a noticeable
            # share of a draft's forward on a CPU. Softmax keeps the logits' order (bar
            # ties from rounding, which could change only the draft's guess, never the output).
            top, top_index = probs.max(-1)
            confidence = float(top)  # reading it waits for an accelerator's kernels
            if pending:
                self._forward_times.append((len(pending), time.perf_counter() - forward_start))
            chance = self.calibration.accept_chance(confidence)
            # Its forward is paid; the token is still not worth the verify's extra position.
            if drafted and self.early_stop and reach * chance < self._break_even(forward=False):
                break
            reach *= chance
            token = int(top_index) if sampling.greedy else sample(probs, generator)
            drafted.append(token)
            dists.append(probs)
            self._confidences.append(confidence)
            pending = [token]
            if handoff is not None and len(drafted) < k and handoff(drafted):
                break
            # The next token, about as likely as this one, would not pay for its forward.
            if self.early_stop and reach * chance < self._break_even(forward=True):
                break
        return drafted, dists

    def _break_even(self, forward: bool) -> float:
        """The chance of acceptance below which one more draft token costs more than it
        brings: the verify's extra position (and a draft forward, if not yet paid),
        against one target step per token. With a token drafted the verify has at least
        two, so its extra position costs the slope beyond two."""
        t_step = self.costs.verify_seconds(1)
        if not t_step:
            return 0.0
        draft_forward = (self.costs.draft_token or 0.0) if forward else 0.0
        return (draft_forward + self.costs.verify_slope()) / t_step

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] over the target's vocabulary."""
        v = self.vocab_size
        if v is None or logits.shape[-1] == v:
            return logits
        if logits.shape[-1] > v:
            return logits[..., :v]
        shape = (*logits.shape[:-1], v - logits.shape[-1])
        pad = torch.full(shape, float("-inf"), dtype=logits.dtype, device=logits.device)
        return torch.cat([logits, pad], dim=-1)


@dataclass
class _Step:
    """What `LookupThenModelDrafter` drafted this step, for scoring its verdict."""

    choice: Choice
    match_n: int  # the length of the match the step's first copies came from
    found: list[int]  # the tokens that match offered
    resumed: list[int] = field(default_factory=list)  # copies drafted after the model's tokens
    resume_n: int = 0  # the length of the match they came from


def one_hot_rows(tokens: Sequence[int], vocab_size: int) -> torch.Tensor:
    """q for copied tokens: all mass on the copied token ([len(tokens), V])."""
    rows = torch.zeros(len(tokens), vocab_size)
    if tokens:
        rows[torch.arange(len(tokens)), torch.tensor(list(tokens))] = 1.0
    return rows


class LookupThenModelDrafter:
    """Copies (prompt lookup or the suffix index) and a draft model, chosen per step by
    expected tokens per second.

    A lookup draft costs microseconds, a model draft one forward per token (on this
    CPU half a target step, see docs/performance.md). `policy.SourcePolicy` weighs
    the match (its length, the tokens found), each source's measured acceptance and
    cost, and drafts copies, model tokens, or a short copied run extended by the model.
    Lookup needs a match of at least 2 tokens: a 1-token match is mostly chance.

    `cascade`: under greedy decoding a step the policy gives copies is a cascade (`_cascade`):
    the model reads every copy found in one forward, keeps them up to its first
    disagreement and drafts on from there with its own token.
    """

    def __init__(self, model: ModelDrafter, lookup: Lookup | None = None, cascade: bool = False) -> None:
        self.model = model
        self.lookup_drafter: Lookup = lookup or NgramDrafter(max_ngram=4, min_ngram=2)
        self.cascade = cascade
        self.name = f"{self.lookup_drafter.name}+{model.name}"
        self.policy = SourcePolicy(CostModel())
        self._step = _Step(PLAIN, 0, [])

    @property
    def runner(self) -> Runner:
        return self.model.runner

    def start(self, plan: DraftPlan) -> None:
        self.model.start(plan)
        policy = SourcePolicy(plan.costs, max_k=plan.max_k, pinned=plan.pinned, max_copy=plan.copy_limit)
        policy.carry_from(self.policy)
        self.policy = policy

    def reset(self) -> None:
        self.model.reset()
        self.lookup_drafter.reset()

    def sync(self, tokens: Sequence[int]) -> None:
        self.model.sync(tokens)
        self.lookup_drafter.sync(tokens)

    def runners(self) -> tuple[Runner, ...]:
        return self.model.runners()

    def caches_for(self, tokens: Sequence[int]) -> list[tuple[Runner, Sequence[int]]]:
        return self.model.caches_for(tokens)

    def seconds_per_token(self) -> float:
        return self.model.seconds_per_token()

    def draft(
        self, tokens: Sequence[int], budget: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        start = time.perf_counter()
        found, n = self.lookup_drafter.match(tokens, budget)
        choice = self.policy.choose(budget, n, len(found), self.model.seconds_per_token(), sampling.greedy)
        self._step = _Step(choice, n, found)
        if self.cascade and sampling.greedy and choice.lookup_tokens:
            return self._cascade(tokens, budget, sampling, generator, start)
        copied = found[: choice.lookup_tokens]
        if not choice.model_tokens:
            source = DraftSource.LOOKUP if copied else DraftSource.NONE
            seconds = time.perf_counter() - start
            return Draft(copied, None, seconds, source=source, requested=choice.total, copied=len(copied))
        reach = self.policy.lookup_survival(n, len(copied))
        context = [*tokens, *copied]

        def resume(drafted: Sequence[int]) -> bool:
            return self._resume(context, drafted, budget)

        limit = self.model.run_limit(choice.model_tokens, budget - len(copied))
        extension = self.model.propose(context, limit, sampling, generator, reach, resume)
        resumed = self._step.resumed  # set only where the handoff ended the draft
        probs = extension.probs
        if probs is not None:
            vocab = probs.shape[-1]
            probs = torch.cat(
                [one_hot_rows(copied, vocab).to(probs), probs, one_hot_rows(resumed, vocab).to(probs)]
            )
        source = (
            DraftSource.MODEL_LOOKUP if resumed else DraftSource.LOOKUP_MODEL if copied else DraftSource.MODEL
        )
        return Draft(
            tokens=copied + extension.tokens + resumed,
            probs=probs,
            seconds=time.perf_counter() - start,
            forwards=extension.forwards,
            source=source,
            requested=choice.total,
            copied=len(copied),
            resumed=len(resumed),
        )

    def _cascade(
        self,
        tokens: Sequence[int],
        budget: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        start: float,
    ) -> Draft:
        """Every copy found, checked by the model in one forward (`ModelDrafter.check`): the
        copies it agrees with, then its own tokens from the first disagreement on.

        Greedy only: a copy the draft's argmax rejects is most likely rejected by the target
        too, and the draft's token at that position is free (the check computed it). So
        the copies run as long as the match offers, and a copy that breaks early costs no
        verify rows past the break. The target verifies every token, so exactness holds."""
        step = self._step
        if self.policy.pinned is not None:  # a pinned k holds for the whole draft
            budget = step.choice.total
        kept, after = self.model.check(tokens, step.found[:budget])
        copied = step.found[:kept]
        step.choice = Choice(kept, max(step.choice.model_tokens, 1))
        context = [*tokens, *copied]

        def resume(drafted: Sequence[int]) -> bool:
            return self._resume(context, drafted, budget)

        reach = self.policy.lookup_survival(step.match_n, kept)
        limit = min(self.model.run_limit(step.choice.model_tokens, budget - kept), budget - kept)
        extension = self.model.propose(context, limit, sampling, generator, reach, resume, after=after)
        resumed = step.resumed
        source = DraftSource.MODEL_LOOKUP if resumed else DraftSource.CASCADE
        return Draft(
            tokens=copied + extension.tokens + resumed,
            probs=None,  # greedy: the verdict compares tokens only
            seconds=time.perf_counter() - start,
            forwards=extension.forwards + 1,
            source=source if extension.tokens or kept else DraftSource.NONE,
            requested=step.choice.total,
            copied=kept,
            resumed=len(resumed),
        )

    def _resume(self, context: Sequence[int], drafted: Sequence[int], budget: int) -> bool:
        """After each model token: copy from here instead, if the text matches again and
        the policy rates the copies above the model's remaining tokens (copies are free)."""
        step = self._step
        room = budget - step.choice.lookup_tokens - len(drafted)
        found, n = self.lookup_drafter.match_after(context, drafted, room)
        count = self.policy.resume_copies(
            step.choice, step.match_n, len(drafted), n, len(found), budget, self.model.seconds_per_token()
        )
        step.resumed, step.resume_n = found[:count], n
        return count > 0

    def observe(self, draft: Draft, accepted: int, committed: Sequence[int], greedy: bool) -> None:
        step = self._step
        choice, n, found = step.choice, step.match_n, step.found
        proposed_model = len(draft.tokens) - draft.copied - draft.resumed
        self.policy.observe(choice, n, proposed_model, accepted, step.resume_n, draft.resumed)
        if proposed_model:
            self.model.observe_model_tokens(draft, accepted)
        if greedy and found and not choice.lookup_tokens:
            self.policy.observe_unused_lookup(n, found, committed)
