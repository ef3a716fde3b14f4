"""Which source drafts the next step: copies (prompt lookup or the suffix index), the
draft model, both, or neither.

Per step, each option's expected tokens per second (after `adaptive`) is

    plain               1 / t_verify(1)
    lookup, k <= L      E_lookup(k) / t_verify(k + 1)                       (copying is free)
    model, k            E_model(k) / (t_first + k t_draft + t_verify(k + 1))
    lookup + model, j   (E_lookup(L) + S_lookup(L) (E_model(j) - 1))
                            / (t_first + j t_draft + t_verify(L + j + 1))

with L the tokens the lookup found, E the expected committed tokens and S the chance
all L copied tokens are accepted, from each source's own measured per-position
acceptance; t_draft is a one-token draft forward and t_first what the model's first
forward typically costs on top (it also reads the tokens the draft has not seen yet;
`adaptive.CostModel`). Lookup acceptance is kept per match length n (a 4-token match
predicts better than a 2-token one); a length not seen yet starts from how the first
copies of the others have done. A copied run may be longer than a model draft
(`max_copy` against `max_k`): copying is free, and only where copies keep being
accepted does its expected rate pay the wider verify. The best option wins, with no rule that lookup goes
first, so an excellent draft model is never pre-empted by worse copies
(docs/engine.md#drafters).

While the model drafts, each of its tokens may make the text match again (a summary
paraphrases a few words, then quotes the prompt once more); `resume_copies` then prices
copies from that match against the model's remaining forwards, and the draft goes on
with whichever pays more.

Under greedy decoding the lookup is scored for free at every step it was not used:
its tokens are compared with the tokens the target committed, which is exactly the
verdict it would have had. Its estimate therefore stays current even while the model
drafts or speculation is off, and a probe (a draft tried although a plain step looked
better, to re-measure) drafts with the model alone: only the model needs drafting to be
measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .adaptive import PRIOR, PRIOR_WEIGHT, AcceptanceEstimate, CostModel, Prober, perfect_draft_pays


@dataclass(frozen=True)
class Choice:
    """How many copied tokens, then how many model tokens, to draft (0 and 0: a plain step).

    Unless k is pinned, the model tokens are a plan: the draft goes on past it while its
    tokens stay confident enough to pay (`ModelDrafter.run_limit`)."""

    lookup_tokens: int = 0
    model_tokens: int = 0
    probe: bool = False  # drafted although a plain step looked better, to re-measure

    @property
    def total(self) -> int:
        return self.lookup_tokens + self.model_tokens


PLAIN = Choice()


class SourcePolicy:
    """Chooses and learns, per generation, between lookup and model drafts."""

    def __init__(
        self,
        costs: CostModel,
        max_k: int = 8,
        pinned: int | None = None,
        probe_every: int = 16,
        max_copy: int = 0,
    ) -> None:
        self.costs = costs
        self.max_k = max_k  # the longest model draft
        # The longest draft of copies (0: max_k). Copies cost nothing to draft, only the
        # verify's width, so where they keep being accepted they may run longer.
        self.max_copy = max(max_k, max_copy)
        self.pinned = pinned
        self.model = AcceptanceEstimate(max_k)
        self._lookup: dict[int, AcceptanceEstimate] = {}
        self.prober = Prober(probe_every)
        self._probe_model = False  # flips at every probe: the next one drafts with the model
        self._model_idle = 0  # steps since the model last drafted

    def carry_from(self, previous: SourcePolicy) -> None:
        """Keep what an earlier generation learned about each source's acceptance."""
        if previous.max_k == self.max_k:  # as a prior a few new verdicts can outvote
            self.model = previous.model.softened()
        if previous.max_copy == self.max_copy:
            self._lookup = {n: estimate.softened() for n, estimate in previous._lookup.items()}

    def lookup(self, n: int) -> AcceptanceEstimate:
        """The acceptance of copies after a match of n tokens."""
        if n not in self._lookup:
            self._lookup[n] = AcceptanceEstimate(self.max_copy, prior=self._lookup_prior())
        return self._lookup[n]

    def _lookup_prior(self) -> float:
        """What a first copy after a match length not seen yet is expected to do: the first
        copies of the lengths seen so far, shrunk toward the fixed prior.

        Starting every new length at the fixed prior would make copies look better than a
        good model on answers where copies fail: each new match length would draft copies
        at that prior and have them rejected at once, while the model drafts well.
        """
        hits = sum(estimate.hits[0] for estimate in self._lookup.values() if estimate.hits)
        trials = sum(estimate.trials[0] for estimate in self._lookup.values() if estimate.trials)
        return (hits + PRIOR * PRIOR_WEIGHT) / (trials + PRIOR_WEIGHT)

    def options(self, budget: int, match_n: int, found: int, t_draft: float) -> list[tuple[float, Choice]]:
        """(expected tokens per second, choice) for every way to draft this step, in
        `budget` tokens (model tokens up to max_k of them)."""
        verify = [self.costs.verify_seconds(m) or 0.0 for m in range(budget + 2)]
        model_budget = min(budget, self.max_k)

        def rate(tokens: float, draft_seconds: float, drafted: int) -> float:
            seconds = draft_seconds + verify[drafted + 1]
            return tokens / seconds if seconds > 0 else 0.0

        model = self.model.expected_curve(model_budget)
        out = [
            (rate(model[k], self.costs.draft_seconds(k, t_draft), k), Choice(0, k))
            for k in range(1, model_budget + 1)
        ]
        if found <= 0:
            return out
        copies = self.lookup(match_n).expected_curve(budget)
        n_copied = min(found, budget)
        out += [(rate(copies[k], 0.0, k), Choice(k, 0)) for k in range(1, n_copied + 1)]
        # A copied run's survival is the step in its expected-tokens curve.
        reach = copies[n_copied] - copies[n_copied - 1]
        for j in range(1, min(budget - n_copied, model_budget) + 1):
            tokens = copies[n_copied] + reach * (model[j] - 1.0)
            out.append(
                (rate(tokens, self.costs.draft_seconds(j, t_draft), n_copied + j), Choice(n_copied, j))
            )
        return out

    def choose(self, budget: int, match_n: int, found: int, t_draft: float, greedy: bool = False) -> Choice:
        """The step's draft: `found` tokens are available from a match of `match_n` tokens.
        `greedy`: the lookup is scored without drafting (`observe_unused_lookup`)."""
        choice = self._choose(budget, match_n, found, t_draft, greedy)
        self._model_idle = 0 if choice.model_tokens else self._model_idle + 1
        return choice

    def _choose(self, budget: int, match_n: int, found: int, t_draft: float, greedy: bool) -> Choice:
        budget = min(budget, self.max_copy if found > 0 else self.max_k)
        if budget <= 0:
            return PLAIN
        if self.pinned is not None:
            k = min(self.pinned, budget)
            copied = min(found, k)
            return Choice(copied, k - copied)
        plain = self.costs.verify_seconds(1)
        if plain is None:  # nothing measured yet: a moderate draft, copies if there are any
            return Choice(min(found, 4, budget), 0) if found > 0 else Choice(0, min(4, budget))
        options = self.options(budget, match_n, found, t_draft)
        rate, best = max(options, key=lambda o: o[0])
        if not best.model_tokens and self._model_idle >= self.prober.every:
            return self._model_probe(options)
        if rate > 1.0 / plain:
            self.prober.drafted()
            # Copies: the match decides how far they go. Model tokens: the planned length only
            # prices the step; the draft's early stop ends the run (`ModelDrafter.run_limit`).
            return best
        if greedy:  # copies are scored anyway: probe the model, on the model's evidence
            best = Choice(0, _best_model_tokens(options))
        model_budget = min(budget, self.max_k)
        could_pay = (found > 0 and not greedy) or perfect_draft_pays(self.costs, model_budget, t_draft)
        if self.prober.plain_step(could_pay, self._evidence(best, match_n)) or self._untried(best, match_n):
            return self._probe(best, options)
        self.model.age()
        for estimate in self._lookup.values():
            estimate.age()
        return PLAIN

    def _probe(self, best: Choice, options: list[tuple[float, Choice]]) -> Choice:
        """A probe; every other one drafts with the model alone.

        Probing only the best-looking option can starve the model draft: when its estimate
        sits below break-even (carried from answers of another kind), the probes would all
        go to prompt-lookup copies, and the model, however well it drafts this answer,
        would never be re-measured.
        """
        self._probe_model = not self._probe_model
        if self._probe_model and best.lookup_tokens:
            best = Choice(0, _best_model_tokens(options))
        return Choice(best.lookup_tokens, best.model_tokens, probe=True)

    def _model_probe(self, options: list[tuple[float, Choice]]) -> Choice:
        """The model's best draft, as a probe: it has not drafted for `probe_every` steps.

        The model is scored only when it drafts, and the plain-step probes count plain
        steps in a row, so copies drafted now and then would keep resetting that count and
        the model would never be tried again (docs/engine.md#drafters).
        """
        return Choice(0, _best_model_tokens(options), probe=True)

    def _evidence(self, choice: Choice, match_n: int) -> float:
        """The verdicts behind the source(s) a probe would try now (see `Prober`)."""
        model = self.model.evidence(0)
        return min(model, self.lookup(match_n).evidence(0)) if choice.lookup_tokens else model

    def _untried(self, choice: Choice, match_n: int) -> bool:
        return (choice.model_tokens > 0 and self.model.untried) or (
            choice.lookup_tokens > 0 and self.lookup(match_n).untried
        )

    def observe(
        self,
        choice: Choice,
        match_n: int,
        proposed_model: int,
        accepted: int,
        resume_n: int = 0,
        resumed: int = 0,
    ) -> None:
        """The verdict of a step drafted as `choice` (the model may have stopped early, and
        `resumed` copies from a match of `resume_n` may have followed its tokens)."""
        if choice.lookup_tokens:
            self.lookup(match_n).observe(choice.lookup_tokens, min(accepted, choice.lookup_tokens))
        if proposed_model and accepted >= choice.lookup_tokens:
            self.model.observe(proposed_model, min(accepted - choice.lookup_tokens, proposed_model))
        head = choice.lookup_tokens + proposed_model
        if resumed and accepted >= head:
            self.lookup(resume_n).observe(resumed, min(accepted - head, resumed))
        if choice.probe:
            self.prober.probe_result(head + resumed, accepted)

    def resume_copies(
        self, step: Choice, match_n: int, drafted: int, resume_n: int, found: int, budget: int, t_draft: float
    ) -> int:
        """How many copies to draft after the step's first `drafted` model tokens, where the
        text now matches again (`found` tokens after a match of `resume_n`), in place of
        the model's remaining tokens; 0 to go on with the model.

        Priced like `options`: the tokens so far and their cost are the same either way;
        copies add their expected tokens for the verify's extra positions only, the model
        its remaining forwards too: in a summary, the text often copies the prompt again
        right after the first token of a paraphrase, where the model would otherwise draft
        on through the rest of it (docs/engine.md#drafters).
        """
        budget = min(budget, self.max_copy)
        head = step.lookup_tokens + drafted
        room = min(found, budget - head)
        measured = self.costs.verify_seconds(1) is not None
        if room <= 0 or self.pinned is not None or not measured or resume_n <= 0:
            return 0
        verify = [self.costs.verify_seconds(m) or 0.0 for m in range(budget + 2)]
        # A run past its plan goes on while the draft is confident: price one more token.
        rest = max(step.model_tokens - drafted, 1)
        model = self.model.expected_curve(drafted + rest)
        reach = self.lookup_survival(match_n, step.lookup_tokens)
        before = self.lookup(match_n).expected_curve(step.lookup_tokens)[-1] if step.lookup_tokens else 1.0
        tokens = before + reach * (model[drafted] - 1.0)
        spent = self.costs.draft_seconds(drafted, t_draft)

        def rate(more_tokens: float, more_seconds: float, size: int) -> float:
            return (tokens + more_tokens) / (spent + more_seconds + verify[size + 1])

        model_rate = rate(reach * (model[drafted + rest] - model[drafted]), rest * t_draft, head + rest)
        survive = reach * self.model.survival(drafted)
        copies = self.lookup(resume_n).expected_curve(room)
        rated = [(rate(survive * (copies[c] - 1.0), 0.0, head + c), c) for c in range(1, room + 1)]
        best_rate, best = max(rated)
        return best if best_rate > max(model_rate, rate(0.0, 0.0, head)) else 0

    def observe_unused_lookup(self, match_n: int, copies: Sequence[int], committed: Sequence[int]) -> None:
        """Greedy only: score copies that were not drafted against what the target committed."""
        reached = min(len(copies), len(committed))
        m = 0
        while m < reached and copies[m] == committed[m]:
            m += 1
        if m < reached:
            self.lookup(match_n).observe(m + 1, m)  # rejected at m + 1
        elif m > 0:
            self.lookup(match_n).observe(m, m)  # accepted as far as the target went

    def lookup_survival(self, match_n: int, copied: int) -> float:
        return self.lookup(match_n).survival(copied) if copied else 1.0


def _best_model_tokens(options: list[tuple[float, Choice]]) -> int:
    """The length of the best model-only draft among `options` (it always has some)."""
    return max((o for o in options if o[1].lookup_tokens == 0), key=lambda o: o[0])[1].model_tokens
