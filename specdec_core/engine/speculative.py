"""The speculative decoding engine: draft k tokens, verify them in one target pass.

Contract: `generate()` takes token ids and yields `events.Event`s; it knows the
tokenizer only to turn committed tokens into text deltas. With temperature 0 the
committed tokens are exactly the target's greedy decoding, for every drafter;
with temperature > 0 they follow the target's processed distribution
(see `acceptance`). One step, after the prompt's prefill:

    draft  = strategy.draft(tokens, budget)        # d_1..d_k, k chosen by the strategy (0 = plain step)
    logits = target([last committed] + draft)      # [k+1, V], one forward
    n, t   = accept(draft, logits)                 # keep d_1..d_n, then target's t
    commit d_1..d_n, t; strategy.observe(n); crop both caches to the committed tokens

The engine knows nothing of what a strategy is (lookup, a model, both): the
strategy chooses its k and source, learns from the verdicts and says its cost.

The target cache always holds every committed token but the last one, so the next
forward starts from the last committed token; rejected positions are cropped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..kernels.cpu.threads import default_governor
from ..kernels.dispatch import runner_for
from ..kernels.runner import Runner
from .acceptance import Verdict, accept_greedy, accept_sampled, at_tokens
from .adaptive import CostModel
from .detok import IncrementalDetokenizer
from .drafters import EMPTY_DRAFT, NONE, Draft, DraftPlan, DraftStrategy, NoDrafter
from .events import (
    DoneEvent,
    Event,
    PrefillEvent,
    ReadAheadEvent,
    ReadingEvent,
    Source,
    StepEvent,
    TokenEvent,
)
from .sampling import SamplingParams
from .stats import GenerationStats, StatsAccumulator

# Prompt tokens per target forward while reading a long prompt. Between chunks the engine
# reports progress and honours a stop, so a chunk bounds how long Stop waits; a chunk's
# rows also stay in the core's cache while each block of weights passes over them.
PREFILL_CHUNK = 128
# The longest draft one verify may carry (`GenerationParams.max_draft_length`): the
# self-check compares a verify at least MAX_DRAFT_LENGTH + 1 rows wide with plain steps,
# so no verify the engine issues is wider than what it checked (check_params refuses more).
# 15: a verify then fills the fixed-shape step's 16 rows on CUDA (static_step.TARGET_ROWS).
MAX_DRAFT_LENGTH = 15


class Exactness(Protocol):
    """What the engine reads of a self-check's verdict (selfcheck.ExactnessReport)."""

    @property
    def label(self) -> str: ...

    @property
    def max_logit_diff(self) -> float: ...

    @property
    def bitwise(self) -> bool: ...


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
    # Copied drafts cost nothing to draft, only the verify's width: they may run this long
    # (the longer of the two; 0 drafting off still means plain steps).
    max_copy_length: int = MAX_DRAFT_LENGTH

    @property
    def widest_draft(self) -> int:
        """The most draft tokens one verify may carry."""
        return max(self.max_draft_length, self.max_copy_length) if self.max_draft_length > 0 else 0

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)


class SpeculativeEngine:
    def __init__(
        self,
        target: torch.nn.Module,
        tokenizer: Any,
        drafter: DraftStrategy | None = None,
        stop_token_ids: Iterable[int] = (),
        runner: Runner | None = None,
    ) -> None:
        # On CUDA the fixed-shape step (static_step.py); `runner` overrides, over `target`.
        self.target: Runner = runner or runner_for(target)
        self.tokenizer = tokenizer
        self.drafter: DraftStrategy = drafter or NoDrafter()
        self.stop_token_ids = frozenset(stop_token_ids)
        config: Any = target.config  # a transformers PreTrainedConfig
        self.vocab_size = int(config.get_text_config().vocab_size)
        # Costs persist across messages: timings learned once keep paying off.
        self.costs = CostModel()
        # Read at every step, so the UI's toggle applies to a running generation.
        self.speculation_enabled = True
        # Set by whoever ran the self-check (ChatSession.load, bench); read into the stats.
        self.exactness: Exactness | None = None
        self.prefill_chunk = PREFILL_CHUNK

    # -- public ---------------------------------------------------------------

    def set_drafter(self, drafter: DraftStrategy) -> None:
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
        drafts = self.drafter.runners()
        for runner in (self.target, *drafts):  # the context goes through once; timed forwards are cropped
            runner.reset()
            runner.forward(context, logits_to_keep=1)
        for _ in range(repeats):  # interleaved, so a burst of machine load hits all sizes alike
            for m in sizes:
                self.costs.observe_verify(m, self.target.time_forward(context, m))
            for runner in drafts:
                self.costs.observe_draft(1, runner.time_forward(context, 1))
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
        self.drafter.start(
            DraftPlan(
                costs=self.costs,
                max_k=params.max_draft_length,
                pinned=params.draft_length,
                max_copy=params.max_copy_length,
            )
        )
        tokens = list(prompt_ids)
        exactness = self.exactness
        run = StatsAccumulator(
            prompt_tokens=len(tokens),
            max_draft_length=params.widest_draft,
            exactness=exactness.label if exactness is not None else "unchecked",
            max_logit_diff=exactness.max_logit_diff if exactness is not None else None,
        )
        read = yield from self._prefill(tokens, run, cancel)

        detok = IncrementalDetokenizer(self.tokenizer)
        decode_start = time.perf_counter()
        while read and run.new_tokens < params.max_new_tokens:
            if cancel is not None and cancel.is_set():
                run.stop_reason = "cancelled"
                break
            default_governor().maybe_adjust()  # threads follow the machine's load (threads.py)
            remaining = params.max_new_tokens - run.new_tokens
            draft = self._draft(tokens, remaining, params, generator)
            verdict, target_probs, verify_seconds = self._verify(tokens, draft, sampling, generator)
            step_tokens = self._committed(draft, verdict, target_probs)
            self._learn(run, draft, verdict, verify_seconds, [t[0] for t in step_tokens], sampling)

            committed = yield from self._commit(run, tokens, step_tokens, detok, params.max_new_tokens)
            # Both caches now drop everything past the committed tokens.
            self.target.crop(len(tokens) - 1)
            self.drafter.sync(tokens)
            run.decode_seconds = time.perf_counter() - decode_start - run.paused_seconds
            yield from _emit(run, self._step_event(run, draft, verdict, committed, verify_seconds))
            if run.stop_reason == "eos":
                break
        run.decode_seconds = time.perf_counter() - decode_start - run.paused_seconds
        new_ids = tuple(tokens[run.prompt_tokens :])
        shown = new_ids[:-1] if new_ids and new_ids[-1] in self.stop_token_ids else new_ids
        yield DoneEvent(token_ids=new_ids, text=self._decode(shown), stats=self._stats(run))

    def read_ahead(self, tokens: Sequence[int], stop: threading.Event | None = None) -> Iterator[ReadAheadEvent]:
        """Read `tokens`, the start of a prompt still being written, into the target's cache and
        then the draft's, a chunk at a time, so that `generate` finds them cached.

        A set `stop` ends the read at the next chunk boundary; what was read stays cached.
        The caches keep only the prefix they share with `tokens`, and `generate` keeps only
        the prefix they share with its prompt, so a read ahead of text that was then edited
        or of another conversation changes what is reused, never the answer. It reads only
        where chunks give the numbers of one forward (`_prefill_chunk`): elsewhere a prompt
        read in two parts could differ from one read whole, so nothing is read ahead."""
        chunk = self._prefill_chunk()
        if chunk is None or not tokens:
            return
        cached = self.target.sync(tokens)
        yield ReadAheadEvent(cached=cached, total=len(tokens))
        for _ in _read_in_chunks(self.target, tokens, chunk, stop):
            yield ReadAheadEvent(cached=len(self.target.ids), total=len(tokens))
        if stop is not None and stop.is_set():
            return
        for runner, view in self.drafter.caches_for(tokens):
            for _ in _read_in_chunks(runner, view, chunk, stop):
                pass

    # -- steps ------------------------------------------------------------------

    def _prefill(
        self, tokens: list[int], run: StatsAccumulator, cancel: threading.Event | None
    ) -> Generator[ReadingEvent | PrefillEvent, None, bool]:
        """Put all prompt tokens but the last through the target, reusing a shared prefix.

        A long prompt goes in chunks, each announced by a `ReadingEvent`; a stop between
        them ends the answer before its first token (False), and the chunks read stay
        cached for a resend to reuse."""
        start = time.perf_counter()
        reused = self.target.sync(tokens[:-1])
        pending = tokens[reused:-1]
        chunk = self._prefill_chunk() or max(1, len(pending))
        for first in range(0, len(pending), chunk):
            if chunk < len(pending):
                yield ReadingEvent(read=first, total=len(pending))
                if cancel is not None and cancel.is_set():
                    run.stop_reason = "cancelled"
                    run.prefill_seconds = time.perf_counter() - start
                    return False
            # Every read follows the load: a short prompt's one forward (load that came while
            # the user read the last answer) as much as each chunk of a minute-long one.
            default_governor().maybe_adjust()
            self.target.forward(pending[first : first + chunk], logits_to_keep=1)
            run.target_forwards += 1
        self.drafter.sync(tokens)
        run.prefill_seconds = time.perf_counter() - start
        yield PrefillEvent(prompt_tokens=len(tokens), reused_tokens=reused, seconds=run.prefill_seconds)
        return True

    def _prefill_chunk(self) -> int | None:
        """Prompt tokens per forward, or None for the whole prompt in one.

        Chunks give the numbers of one forward only where no row depends on the others:
        in the fixed-shape step (static_step.py) by construction; on the CPU, whose kernels
        are row-wise, once the self-check has measured a verify bitwise equal to plain
        steps. Elsewhere a GPU's kernels choose their tiling by row count."""
        if self.target.row_invariant:
            return self.prefill_chunk
        report = self.exactness
        if report is None or not report.bitwise or self.target.device.type != "cpu":
            return None
        return self.prefill_chunk

    def _draft(
        self, tokens: list[int], remaining: int, params: GenerationParams, generator: torch.Generator | None
    ) -> Draft:
        """The strategy's draft for this step, or none when speculation is off."""
        # The verify always adds one target token, so never draft past the budget.
        budget = min(remaining - 1, params.widest_draft)
        if not self.speculation_enabled or budget <= 0:
            return EMPTY_DRAFT
        return self.drafter.draft(tokens, budget, params.sampling, generator)

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
        self.target.synchronize()  # on CUDA the clock must wait for the kernels
        return verdict, target_probs, time.perf_counter() - start

    def _commit(
        self,
        run: StatsAccumulator,
        tokens: list[int],
        step_tokens: list[tuple[int, Source, float | None, float | None]],
        detok: IncrementalDetokenizer,
        max_new_tokens: int,
    ) -> Generator[Event, None, int]:
        """Append the step's tokens, one TokenEvent each, up to a stop token or the budget.

        Returns how many were committed. A stop token is counted, flagged, and adds no text.
        """
        committed = 0
        for token_id, source, t_prob, d_prob in step_tokens:
            tokens.append(token_id)
            run.new_tokens += 1
            committed += 1
            is_stop = token_id in self.stop_token_ids
            text = "" if is_stop else detok.push(token_id)
            event = TokenEvent(token_id, text, source, run.steps, t_prob, d_prob, is_stop=is_stop)
            yield from _emit(run, event)
            if is_stop:
                run.stop_reason = "eos"
                break
            if run.new_tokens >= max_new_tokens:
                break
        return committed

    def _committed(
        self, draft: Draft, verdict: Verdict, target_probs: torch.Tensor
    ) -> list[tuple[int, Source, float | None, float | None]]:
        """The step's new tokens with provenance and probabilities, in order."""
        out: list[tuple[int, Source, float | None, float | None]] = []
        n = verdict.accepted
        kept = draft.tokens[:n]
        ps = at_tokens(target_probs, [*kept, verdict.next_token])  # one read from the device
        qs = at_tokens(draft.probs, kept) if draft.probs is not None else [None] * n
        for i, token in enumerate(kept):
            # A copied token has no draft probability.
            out.append((token, Source.ACCEPTED, ps[i], None if draft.is_copy(i) else qs[i]))
        if not draft.tokens:
            source = Source.TARGET
        elif n == len(draft.tokens):
            source = Source.BONUS
        else:
            source = Source.CORRECTED
        out.append((verdict.next_token, source, ps[n], None))
        return out

    def _learn(
        self,
        run: StatsAccumulator,
        draft: Draft,
        verdict: Verdict,
        verify_seconds: float,
        committed: list[int],
        sampling: SamplingParams,
    ) -> None:
        """Book the step: the run's figures, the strategy's verdict, the verify's cost."""
        run.record_step(len(draft.tokens), verdict.accepted, draft.seconds, draft.forwards, verify_seconds)
        if draft is not EMPTY_DRAFT:
            self.drafter.observe(draft, verdict.accepted, committed, sampling.greedy)
        self.costs.observe_verify(len(draft.tokens) + 1, verify_seconds)

    def _step_event(
        self, run: StatsAccumulator, draft: Draft, verdict: Verdict, committed: int, verify_seconds: float
    ) -> StepEvent:
        running = self._stats(run)  # the gauges are the final stats, so far
        return StepEvent(
            step=run.steps,
            k=draft.requested,
            proposed=len(draft.tokens),
            accepted=verdict.accepted,
            committed=committed,
            draft_seconds=draft.seconds,
            verify_seconds=verify_seconds,
            tokens_per_second=running.tokens_per_second,
            acceptance_rate=running.acceptance_rate,
            measured_speedup=running.measured_speedup,
            theoretical_speedup=running.theoretical_speedup,
            mean_accepted_length=running.mean_accepted_length,
            exactness=running.exactness,
        )

    def _stats(self, run: StatsAccumulator) -> GenerationStats:
        return run.snapshot(self.drafter.name if self.speculation_enabled else NONE, self.costs)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _read_in_chunks(
    runner: Runner, tokens: Sequence[int], chunk: int, stop: threading.Event | None
) -> Iterator[None]:
    """Forward what `runner`'s cache lacks of `tokens`, `chunk` tokens at a time, yielding
    after each; a set `stop` ends it before the next chunk."""
    cached = runner.sync(tokens)
    for first in range(cached, len(tokens), chunk):
        if stop is not None and stop.is_set():
            return
        default_governor().maybe_adjust()  # as in _prefill: each chunk follows the machine's load
        runner.forward(tokens[first : first + chunk], logits_to_keep=1)
        yield


def _emit(run: StatsAccumulator, event: Event) -> Iterator[Event]:
    """Yield one event, booking the time the consumer keeps us suspended as paused."""
    start = time.perf_counter()
    yield event
    run.paused_seconds += time.perf_counter() - start
