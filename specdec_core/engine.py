"""The speculative decoding engine: draft k tokens, verify them in one target pass.

Contract: `generate()` takes token ids and yields `events.Event`s; it knows the
tokenizer only to turn committed tokens into text deltas. With temperature 0 the
committed tokens are exactly the target's greedy decoding, for every drafter;
with temperature > 0 they follow the target's processed distribution
(see `acceptance`). One step, after the prompt's prefill:

    k      = controller.choose_k()                 # 0 = plain target step
    draft  = drafter.propose(tokens, k)            # d_1..d_k
    logits = target([last committed] + draft)      # [k+1, V], one forward
    n, t   = accept(draft, logits)                 # keep d_1..d_n, then target's t
    commit d_1..d_n, t; crop both caches to the committed tokens

The target cache always holds every committed token but the last one, so the next
forward starts from the last committed token; rejected positions are cropped.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .acceptance import Verdict, accept_greedy, accept_sampled
from .adaptive import CostModel, DraftLengthController
from .detok import IncrementalDetokenizer
from .drafters import EMPTY_DRAFT, Draft, Drafter, LookupThenModelDrafter, ModelDrafter, NoDrafter
from .events import DoneEvent, Event, PrefillEvent, Source, StepEvent, TokenEvent
from .kvcache import CachedModel
from .sampling import SamplingParams
from .selfcheck import ExactnessReport
from .stats import GenerationStats
from .threads import default_governor


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    # Reproducible for a pinned draft_length; with adaptive k the number of random draws
    # follows measured timings, so the text may vary (its distribution never does).
    seed: int | None = None
    draft_length: int | None = None  # None = adaptive; an int pins k
    max_draft_length: int = 8

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)


@dataclass
class _Run:
    """Mutable bookkeeping of one generate() call."""

    prompt_len: int
    max_draft_length: int
    stop_reason: str = "max_tokens"  # | "eos" | "cancelled"
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_forwards: int = 0
    target_forwards: int = 0
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    # Time the consumer held the generator between events (a UI rendering, a test
    # pausing): not the engine's, so not in decode_seconds or the speedup.
    paused_seconds: float = 0.0
    k_histogram: Counter[int] = field(default_factory=Counter)  # drafted tokens per step
    position_hits: list[int] = field(default_factory=list)  # per draft position: accepted
    position_trials: list[int] = field(default_factory=list)  # per draft position: reached

    def __post_init__(self) -> None:
        self.position_hits = [0] * self.max_draft_length
        self.position_trials = [0] * self.max_draft_length


class SpeculativeEngine:
    def __init__(
        self,
        target: torch.nn.Module,
        tokenizer: Any,
        drafter: Drafter | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        self.target = CachedModel(target)
        self.tokenizer = tokenizer
        self.drafter: Drafter = drafter or NoDrafter()
        self.stop_token_ids = frozenset(stop_token_ids)
        self.vocab_size = int(target.config.get_text_config().vocab_size)
        # Costs persist across messages: timings learned once keep paying off.
        self.costs = CostModel()
        # Read at every step, so the UI's toggle applies to a running generation.
        self.speculation_enabled = True
        # Set by whoever ran the self-check (ChatSession.load, bench); read into the stats.
        self.exactness: ExactnessReport | None = None

    # -- public ---------------------------------------------------------------

    def set_drafter(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.costs.forget_draft()

    def calibrate(self, sizes: Sequence[int] = (1, 2, 4, 8), repeats: int = 3) -> CostModel:
        """Time target forwards of several sizes (and a draft forward) on a dummy context.

        Gives the controller and the speedup baseline real numbers before the first
        message; generation keeps refining them.
        """
        context = torch.randint(
            0, self.vocab_size, (32,), generator=torch.Generator().manual_seed(0)
        ).tolist()
        runners = [self.target]
        if isinstance(self.drafter, (ModelDrafter, LookupThenModelDrafter)):
            runners.append(self.drafter.runner)
        for runner in runners:  # the context is put through once; each timed forward is cropped off
            runner.reset()
            runner.forward(context, logits_to_keep=1)
        for _ in range(repeats):  # interleaved, so a burst of machine load hits all sizes alike
            for m in sizes:
                self.costs.observe_verify(m, _time_forward(self.target, context, m))
            if len(runners) > 1:
                self.costs.observe_draft(1, _time_forward(self.drafter.runner, context, 1))
        self.target.reset()
        self.drafter.reset()
        return self.costs

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: GenerationParams | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[Event]:
        params = params or GenerationParams()
        if not prompt_ids:
            raise ValueError("the prompt must hold at least one token")
        sampling = params.sampling
        generator = None
        if not sampling.greedy:
            generator = torch.Generator()
            generator.manual_seed(params.seed if params.seed is not None else int(time.time_ns() % 2**63))
        controller, lookup_controller = self._controllers(params)
        tokens = list(prompt_ids)
        run = _Run(prompt_len=len(tokens), max_draft_length=params.max_draft_length)
        yield self._prefill(tokens, run)

        detok = IncrementalDetokenizer(self.tokenizer)
        decode_start = time.perf_counter()
        while len(tokens) - run.prompt_len < params.max_new_tokens:
            if cancel is not None and cancel.is_set():
                run.stop_reason = "cancelled"
                break
            default_governor().maybe_adjust()  # threads follow the machine's load (threads.py)
            remaining = params.max_new_tokens - (len(tokens) - run.prompt_len)
            k, draft, used = self._draft(tokens, controller, lookup_controller, remaining, params, generator)
            verdict, target_probs, verify_seconds = self._verify(tokens, draft, sampling, generator)
            self._record_step(run, used, draft, verdict, verify_seconds)

            committed = 0
            for token_id, source, t_prob, d_prob in self._committed(draft, verdict, target_probs):
                tokens.append(token_id)
                committed += 1
                event = TokenEvent(token_id, detok.push(token_id), source, run.steps, t_prob, d_prob)
                yield from _emit(run, event)
                if token_id in self.stop_token_ids:
                    run.stop_reason = "eos"
                    break
                if len(tokens) - run.prompt_len >= params.max_new_tokens:
                    break
            # Both caches now drop everything past the committed tokens.
            self.target.crop(len(tokens) - 1)
            self.drafter.sync(tokens)
            run.decode_seconds = time.perf_counter() - decode_start - run.paused_seconds
            yield from _emit(run, self._step_event(run, k, draft, verdict, committed, verify_seconds, tokens))
            if run.stop_reason == "eos":
                break
        run.decode_seconds = time.perf_counter() - decode_start - run.paused_seconds
        stats = self._stats(run, tokens)
        new_ids = tuple(tokens[run.prompt_len :])
        yield DoneEvent(token_ids=new_ids, text=self._decode(new_ids), stats=stats)

    # -- steps ------------------------------------------------------------------

    def _prefill(self, tokens: list[int], run: _Run) -> PrefillEvent:
        """Put all prompt tokens but the last through the target, reusing a shared prefix."""
        start = time.perf_counter()
        reused = self.target.sync(tokens[:-1])
        if reused < len(tokens) - 1:
            self.target.forward(tokens[reused:-1], logits_to_keep=1)
            run.target_forwards += 1
        self.drafter.sync(tokens)
        run.prefill_seconds = time.perf_counter() - start
        return PrefillEvent(prompt_tokens=len(tokens), reused_tokens=reused, seconds=run.prefill_seconds)

    def _draft(
        self,
        tokens: list[int],
        controller: DraftLengthController,
        lookup_controller: DraftLengthController | None,
        remaining: int,
        params: GenerationParams,
        generator: torch.Generator | None,
    ) -> tuple[int, Draft, DraftLengthController]:
        """Choose k and draft: (k, the draft, the controller that chose it)."""
        if lookup_controller is not None and isinstance(self.drafter, LookupThenModelDrafter):
            k = self._choose_k(lookup_controller, remaining, params, is_model=False)
            found = self.drafter.lookup(tokens, k) if k > 0 else EMPTY_DRAFT
            if found.tokens:
                return k, found, lookup_controller
        k = self._choose_k(controller, remaining, params, is_model=self.drafter.is_model)
        draft = self.drafter.propose(tokens, k, params.sampling, generator) if k > 0 else EMPTY_DRAFT
        return k, draft, controller

    def _choose_k(
        self, controller: DraftLengthController, remaining: int, params: GenerationParams, is_model: bool
    ) -> int:
        if not self.speculation_enabled or isinstance(self.drafter, NoDrafter):
            return 0
        k = controller.choose_k(is_model)
        # The verify always adds one target token, so never draft past the budget.
        return max(0, min(k, remaining - 1, params.max_draft_length))

    def _verify(
        self, tokens: list[int], draft: Draft, sampling: SamplingParams, generator: torch.Generator | None
    ) -> tuple[Verdict, torch.Tensor, float]:
        start = time.perf_counter()
        pending = tokens[len(self.target.ids) :]  # normally just the last committed token
        logits = self.target.forward(pending + draft.tokens, logits_to_keep=len(draft.tokens) + 1)
        logits = logits[:, : self.vocab_size]
        target_probs = sampling.probs(logits)  # [k + 1, V]
        if sampling.greedy:
            verdict = accept_greedy(draft.tokens, logits)
        else:
            verdict = accept_sampled(draft.tokens, draft.probs, target_probs, generator)
        return verdict, target_probs, time.perf_counter() - start

    def _controllers(
        self, params: GenerationParams
    ) -> tuple[DraftLengthController, DraftLengthController | None]:
        """The draft-length controller, and a second one for free lookup drafts (own acceptance)."""

        def make() -> DraftLengthController:
            return DraftLengthController(
                max_k=params.max_draft_length, pinned=params.draft_length, costs=self.costs
            )

        return make(), make() if isinstance(self.drafter, LookupThenModelDrafter) else None

    def _committed(
        self, draft: Draft, verdict: Verdict, target_probs: torch.Tensor
    ) -> list[tuple[int, Source, float | None, float | None]]:
        """The step's new tokens with provenance and probabilities, in order."""
        out: list[tuple[int, Source, float | None, float | None]] = []
        for i in range(verdict.accepted):
            token = draft.tokens[i]
            q = float(draft.probs[i, token]) if draft.probs is not None else None
            out.append((token, Source.ACCEPTED, float(target_probs[i, token]), q))
        n = verdict.accepted
        if not draft.tokens:
            source = Source.TARGET
        elif n == len(draft.tokens):
            source = Source.BONUS
        else:
            source = Source.CORRECTED
        out.append((verdict.next_token, source, float(target_probs[n, verdict.next_token]), None))
        return out

    def _record_step(
        self,
        run: _Run,
        controller: DraftLengthController,
        draft: Draft,
        verdict: Verdict,
        verify_seconds: float,
    ) -> None:
        run.steps += 1
        run.proposed += len(draft.tokens)
        run.accepted += verdict.accepted
        run.draft_seconds += draft.seconds
        run.verify_seconds += verify_seconds
        run.draft_forwards += draft.forwards
        run.target_forwards += 1
        run.k_histogram[len(draft.tokens)] += 1
        # Position i was reached if all before it were accepted; accepted if i < n.
        for i in range(min(len(draft.tokens), run.max_draft_length, verdict.accepted + 1)):
            run.position_trials[i] += 1
            run.position_hits[i] += i < verdict.accepted
        controller.observe(len(draft.tokens), verdict.accepted)
        self.costs.observe_verify(len(draft.tokens) + 1, verify_seconds)
        self.costs.observe_draft(draft.forwards, draft.seconds)

    def _step_event(
        self,
        run: _Run,
        k: int,
        draft: Draft,
        verdict: Verdict,
        committed: int,
        verify_seconds: float,
        tokens: list[int],
    ) -> StepEvent:
        running = self._stats(run, tokens)  # the gauges are the final stats, so far
        return StepEvent(
            step=run.steps,
            k=k,
            proposed=len(draft.tokens),
            accepted=verdict.accepted,
            committed=committed,
            draft_seconds=draft.seconds,
            verify_seconds=verify_seconds,
            tokens_per_second=running.tokens_per_second,
            acceptance_rate=running.acceptance_rate,
            measured_speedup=running.measured_speedup,
            theoretical_speedup=running.theoretical_speedup,
        )

    def _stats(
        self,
        run: _Run,
        tokens: list[int],
    ) -> GenerationStats:
        pairs = zip(run.position_hits, run.position_trials, strict=True)
        per_position = tuple(h / t for h, t in pairs if t > 0)
        return GenerationStats(
            drafter=self.drafter.name if self.speculation_enabled else "none",
            prompt_tokens=run.prompt_len,
            new_tokens=len(tokens) - run.prompt_len,
            stop_reason=run.stop_reason,
            steps=run.steps,
            proposed=run.proposed,
            accepted=run.accepted,
            per_position_acceptance=per_position,
            k_histogram=dict(run.k_histogram),
            target_forwards=run.target_forwards,
            draft_forwards=run.draft_forwards,
            prefill_seconds=run.prefill_seconds,
            decode_seconds=run.decode_seconds,
            draft_seconds=run.draft_seconds,
            verify_seconds=run.verify_seconds,
            target_token_seconds=self.costs.verify_seconds(1) or 0.0,
            draft_token_seconds=self.costs.draft_token or 0.0,
            baseline_measured=1 in self.costs.verify,
        )

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _time_forward(runner: CachedModel, context: list[int], m: int) -> float:
    """Seconds of one forward of m tokens after the cached context (a verify of m - 1 drafts)."""
    runner.crop(len(context))
    start = time.perf_counter()
    runner.forward(context[:m], logits_to_keep=m)
    return time.perf_counter() - start


def _emit(run: _Run, event: Event) -> Iterator[Event]:
    """Yield one event, booking the time the consumer keeps us suspended as paused."""
    start = time.perf_counter()
    yield event
    run.paused_seconds += time.perf_counter() - start
