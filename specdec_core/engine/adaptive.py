"""Choosing the draft length k from measured costs and acceptance.

Each step we pick the k that maximises expected tokens per second:

    E[tokens | k] = 1 + sum_{j=1..k} prod_{i<=j} a_i          (a_i: P(accept i | accepted 1..i-1))
    T(k)          = t_first + k * t_draft + t_verify(k + 1)
    k*            = argmax_k E[tokens | k] / T(k),   k = 0 meaning a plain target step

Nothing is assumed: t_verify(m) is timed for every target forward of m tokens
(on a CPU a 10-token verify costs clearly more than a 1-token step), t_draft for
every one-token draft forward, t_first for what a draft's first forward costs on top,
and a_i from the verdicts. Timings are medians of the last few: on a shared machine
one forward now and then stalls for many times its cost (an OpenMP thread descheduled;
docs/engine.md#adaptive-k-adaptivepy), and an average would carry such a spike into many
steps, or forever for a size the controller then avoids. Each is kept as the machine's
current speed times the kind's usual cost (`CostModel`), so a kind not timed lately
still follows the machine.

When k = 0 wins, speculation is off until a probe re-measures acceptance, so a
prompt the draft cannot predict costs at most a probe every `probe_every` steps
over the target alone. Plain steps also age the acceptance evidence, and a probe
that was fully accepted calls the next one at once, so a draft that turns good
again after a bad stretch is back within about `probe_every` plain steps.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping

# Timings kept per kind of forward. The median of 7 ignores up to 3 stalled forwards and
# still follows a real change (a longer context) within 4.
WINDOW = 7

# A verify size's own timings count once it has this many (a median of fewer can be one
# stalled forward); until then it is read off the line through the sizes that have them.
# Taken alone, one stalled first timing of a size the calibration skips would price every
# longer verify as high, since none may look cheaper than a smaller one; the draft's early
# stop would then cut every draft short, and the size would never be timed again
# (docs/engine.md#adaptive-k-adaptivepy).
ESTABLISHED = 3

# The machine's speed is the low median ratio of the last few forwards of any kind to
# their usual cost (a stall only ever reads slower): several forwards a step, so it
# follows a change within a step or two.
SCALE_WINDOW = 7

# A draft's first forward reads the last committed token, and after a fully accepted
# step also the last draft token (never fed back): the steady state's catch-up.
STEADY_FIRST_TOKENS = 2

# At most this many verdicts' weight of acceptance carries from one answer to the next.
CARRY_WEIGHT = 4.0

# A position with less than this much recent evidence is "thin" (see `Stretcher`), and
# every STRETCH_EVERY drafting steps a thin one rated below the rest is drafted beyond
# the plan.
THIN_EVIDENCE = 2.0
STRETCH_EVERY = 4

# Plain steps before a probe, per verdict the stopping estimate rests on (see `Prober`).
# Against a draft that never pays, the evidence settles near a few aged verdicts, so a
# probe comes a little sooner than every `Prober.every` plain steps, at a small cost a step
# (docs/engine.md#adaptive-k-adaptivepy).
PLAIN_STEPS_PER_VERDICT = 3.0

# What an acceptance estimate assumes before its first verdicts, and how many verdicts
# weight that guess has.
PRIOR = 0.6
PRIOR_WEIGHT = 2.0

# The kinds of forward timed: a target forward of m tokens (an int), or these two.
DRAFT_TOKEN = "draft token"
DRAFT_FIRST = "draft first"
Kind = int | str


class CostModel:
    """Measured seconds of a target forward by number of tokens, and of a draft's forwards.

    Each cost is the machine's current speed (`scale`) times the kind's usual cost at that
    speed (its shape). On a shared desktop the speed drifts within minutes, and a policy
    re-times only the forwards it runs: timed apart, a plain step's cost would follow the
    machine while the draft and the larger verifies kept the figures of a slower moment,
    so drafting would look worse than it is and plain steps would go on. So every forward,
    of any kind, moves the common scale, and each kind keeps only its cost relative to the
    others (docs/engine.md#adaptive-k-adaptivepy).

    A draft's first forward also reads the tokens the draft model has not seen yet, and
    on a CPU that makes it dearer than the one-token forwards after it
    (docs/performance.md#measurements-behind-the-design). While
    the model drafts step after step, that is the bonus token of a fully accepted step:
    `draft_first` is the typical first forward of that steady state (reading at most
    `STEADY_FIRST_TOKENS`), `draft_token` each further one. A longer catch-up (the prompt,
    the tokens of plain or copied steps) is a debt paid whenever the model next drafts,
    so it is not booked: counted, it would make the model look dearer the longer it has
    been off and keep it off.
    """

    def __init__(
        self,
        verify: Mapping[int, float] | None = None,
        draft_token: float | None = None,
        draft_first: float | None = None,
        prior_slope: float = 0.1,
    ) -> None:
        # Used before anything is measured: verifying m tokens ~ (1 + slope * (m - 1)) x one step.
        self.prior_slope = prior_slope
        self.scale = 1.0
        self._ratios: deque[float] = deque(maxlen=SCALE_WINDOW)
        self._shape: dict[Kind, float] = {}
        self._samples: dict[Kind, deque[float]] = {}
        given: list[tuple[Kind, float | None]] = [*(verify or {}).items()]
        given += [(DRAFT_TOKEN, draft_token), (DRAFT_FIRST, draft_first)]
        for kind, seconds in given:  # values given here count as first measurements
            if seconds is not None:
                self._observe(kind, seconds)

    # -- what is known ------------------------------------------------------------------
    @property
    def verify(self) -> dict[int, float]:
        """Seconds of a target forward by number of tokens, for the sizes timed so far."""
        return {m: self.scale * shape for m, shape in self._shape.items() if isinstance(m, int)}

    @property
    def draft_token(self) -> float | None:
        """Seconds of a one-token draft forward."""
        return self._seconds(DRAFT_TOKEN)

    @property
    def draft_first(self) -> float | None:
        """Seconds of a draft's first forward in the steady state."""
        return self._seconds(DRAFT_FIRST)

    def _seconds(self, kind: Kind) -> float | None:
        shape = self._shape.get(kind)
        return None if shape is None else self.scale * shape

    # -- timings ------------------------------------------------------------------------
    def observe_verify(self, m: int, seconds: float) -> None:
        self._observe(m, seconds)

    def observe_draft(self, forwards: int, seconds: float) -> None:
        """`forwards` one-token draft forwards took `seconds` in all."""
        if forwards > 0:
            self._observe(DRAFT_TOKEN, seconds / forwards)

    def observe_draft_first(self, tokens: int, seconds: float) -> None:
        """A draft's first forward read `tokens` tokens in `seconds`."""
        if tokens <= STEADY_FIRST_TOKENS:
            self._observe(DRAFT_FIRST, seconds)

    def _observe(self, kind: Kind, seconds: float) -> None:
        """One timing: it moves the common scale (if its kind has a usual cost), then its
        kind's usual cost at that scale. Medians on both sides, so a stalled forward moves
        neither; the scale's window is shared by all kinds and so follows the machine faster."""
        shape = self._shape.get(kind)
        if shape is not None and shape > 0:
            self._ratios.append(seconds / shape)
            self.scale = statistics.median_low(self._ratios)
        samples = self._samples.setdefault(kind, deque(maxlen=WINDOW))
        samples.append(seconds / self.scale)
        self._shape[kind] = statistics.median(samples)

    def first_forward_extra(self) -> float:
        """What a draft's first forward typically costs over a one-token one (0 until both are measured)."""
        if self.draft_first is None or self.draft_token is None:
            return 0.0
        return max(0.0, self.draft_first - self.draft_token)

    def draft_seconds(self, k: int, per_token: float) -> float:
        """What drafting k tokens costs at `per_token` a forward (0 for a model-free
        drafter): k forwards, and the first one's extra once."""
        if k <= 0 or per_token <= 0:
            return 0.0
        return self.first_forward_extra() + k * per_token

    def forget_draft(self) -> None:
        """A new drafter has its own cost."""
        for kind in (DRAFT_TOKEN, DRAFT_FIRST):
            self._shape.pop(kind, None)
            self._samples.pop(kind, None)

    def verify_seconds(self, m: int) -> float | None:
        """t_verify(m), never below a smaller size's: a size last timed in a calm moment
        must not look cheaper than a smaller one timed under load just now."""
        verify = self._verify_points()
        t = self._fitted_verify_seconds(verify, m)
        if t is None:
            return None
        return max(t, max((v for n, v in verify.items() if n < m), default=0.0))

    def _verify_points(self) -> dict[int, float]:
        """The verify sizes the estimate rests on: those timed `ESTABLISHED` times, once two
        sizes are (the calibration times four); before that, every size timed."""
        verify = self.verify
        established = {m: t for m, t in verify.items() if len(self._samples[m]) >= ESTABLISHED}
        return established if len(established) >= 2 else verify

    def _fitted_verify_seconds(self, verify: dict[int, float], m: int) -> float | None:
        """Measured t_verify(m), else interpolated/extrapolated from a least-squares line."""
        if m in verify:
            return verify[m]
        if not verify:
            return None
        points = sorted(verify.items())
        if len(points) == 1:
            m0, t0 = points[0]
            unit = t0 / (1 + self.prior_slope * (m0 - 1))
            return unit * (1 + self.prior_slope * (m - 1))
        mean_m, mean_t, slope = _line(points)
        return max(1e-9, mean_t + slope * (m - mean_m))

    def verify_slope(self) -> float:
        """Seconds one more verified token adds to a verify of two or more: the slope of the
        line through those sizes. Adjacent sizes' medians differ by more noise than that
        (docs/engine.md#drafters), and a draft weighing one more token must not take noise
        for its price."""
        points = sorted((m, t) for m, t in self._verify_points().items() if m >= 2)
        if len(points) >= 2:
            return _line(points)[2]
        one = self.verify_seconds(1)
        return self.prior_slope * one if one else 0.0


def _line(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """The least-squares line through (m, seconds) points: mean m, mean seconds, slope (>= 0)."""
    n = len(points)
    mean_m = sum(p[0] for p in points) / n
    mean_t = sum(p[1] for p in points) / n
    var = sum((p[0] - mean_m) ** 2 for p in points)
    slope = max(0.0, sum((p[0] - mean_m) * (p[1] - mean_t) for p in points) / var)
    return mean_m, mean_t, slope


def perfect_draft_pays(costs: CostModel, limit: int, draft_cost: float) -> bool:
    """Would a draft that is always accepted beat a plain step, for some k <= limit?"""
    plain = costs.verify_seconds(1)
    if plain is None:
        return True
    return any(
        (k + 1) / (costs.draft_seconds(k, draft_cost) + (costs.verify_seconds(k + 1) or 0.0)) > 1.0 / plain
        for k in range(1, limit + 1)
    )


class AcceptanceEstimate:
    """Online per-position acceptance with exponential forgetting and a shrinkage prior."""

    def __init__(
        self, max_k: int, prior: float = PRIOR, prior_weight: float = PRIOR_WEIGHT, decay: float = 0.97
    ) -> None:
        self.prior = prior
        self.prior_weight = prior_weight
        self.decay = decay
        self.hits = [0.0] * max_k
        self.trials = [0.0] * max_k

    def age(self) -> None:
        """One step of forgetting without new evidence (a plain step): the prior regains weight."""
        self.hits = [h * self.decay for h in self.hits]
        self.trials = [t * self.decay for t in self.trials]

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.age()
        # Positions 1..accepted were accepted; position accepted+1 (if proposed) was rejected.
        for i in range(min(proposed, accepted + 1, len(self.trials))):
            self.trials[i] += 1.0
            if i < accepted:
                self.hits[i] += 1.0

    def _pooled(self) -> float:
        # The pooled rate over all positions, shrunk toward the prior.
        return (sum(self.hits) + self.prior * self.prior_weight) / (sum(self.trials) + self.prior_weight)

    def rate(self, i: int, pooled: float | None = None) -> float:
        """a_{i+1}: probability position i+1 is accepted given all before were."""
        pooled = self._pooled() if pooled is None else pooled
        if i >= len(self.trials):
            return pooled
        # Shrink each position toward the pooled rate.
        return (self.hits[i] + pooled * self.prior_weight) / (self.trials[i] + self.prior_weight)

    def survival(self, k: int) -> float:
        """P(the first k draft tokens are all accepted)."""
        pooled = self._pooled()
        p = 1.0
        for i in range(k):
            p *= self.rate(i, pooled)
        return p

    def expected_curve(self, k_max: int) -> list[float]:
        """E[tokens committed by a verify of k drafts] for k = 0..k_max: 1 + sum_j P(first j accepted)."""
        pooled = self._pooled()
        curve, survive = [1.0], 1.0
        for i in range(k_max):
            survive *= self.rate(i, pooled)
            curve.append(curve[-1] + survive)
        return curve

    def expected_tokens(self, k: int) -> float:
        return self.expected_curve(k)[k]

    def evidence(self, i: int) -> float:
        """How many (aged) verdicts position i + 1's rate rests on."""
        return self.trials[i] if i < len(self.trials) else 0.0

    def thin_and_low(self, i: int) -> bool:
        """Position i + 1 looks worse than the rest on too few verdicts to be sure."""
        pooled = self._pooled()
        return self.evidence(i) < THIN_EVIDENCE and self.rate(i, pooled) < pooled

    @property
    def untried(self) -> bool:
        """No verdict seen yet: the rate is the prior's guess, worth one try."""
        return sum(self.trials) == 0.0

    def softened(self, weight: float = CARRY_WEIGHT) -> AcceptanceEstimate:
        """A copy whose evidence counts as at most `weight` verdicts: the prior of a new answer.

        The last answer's acceptance is a fair first guess for the next, but another topic
        drafts differently: carried whole, a low estimate from one kind of answer can keep
        the model draft off a whole answer it drafts well. So a few new verdicts must be
        able to outvote it.
        """
        copy = AcceptanceEstimate(len(self.trials), self.prior, self.prior_weight, self.decay)
        total = sum(self.trials)
        scale = min(1.0, weight / total) if total > 0 else 1.0
        copy.hits = [h * scale for h in self.hits]
        copy.trials = [t * scale for t in self.trials]
        return copy


class ConfidenceCalibration:
    """P(a draft token is accepted | the draft's top probability), learned per bin.

    Starts from the identity (a draft whose distribution matches the target's has its
    top token accepted with about that probability) and follows the verdicts, so an
    over- or under-confident draft is read as it behaves.
    """

    BINS = 10

    def __init__(self, prior_weight: float = 1.0, decay: float = 0.995) -> None:
        self.prior_weight = prior_weight
        self.decay = decay
        self.hits = [0.0] * self.BINS
        self.trials = [0.0] * self.BINS

    def _bin(self, confidence: float) -> int:
        return min(self.BINS - 1, max(0, int(confidence * self.BINS)))

    def observe(self, confidence: float, accepted: bool) -> None:
        b = self._bin(confidence)
        self.hits[b] = self.hits[b] * self.decay + accepted
        self.trials[b] = self.trials[b] * self.decay + 1.0

    def accept_chance(self, confidence: float) -> float:
        b = self._bin(confidence)
        center = (b + 0.5) / self.BINS
        return (self.hits[b] + center * self.prior_weight) / (self.trials[b] + self.prior_weight)


class Prober:
    """When speculation looks unprofitable, still try a draft now and then.

    A probe comes after `every` plain steps, sooner while the estimate that stopped
    drafting rests on few verdicts: after `PLAIN_STEPS_PER_VERDICT` plain steps per
    verdict of evidence. One or two rejections at an answer's first drafts are weak
    evidence against a draft that is usually right, yet they can price it below a plain
    step, and the full wait for the next probe would then be a long run of plain
    decoding (docs/engine.md#adaptive-k-adaptivepy).
    A probe whose every token was accepted calls the next one after a single plain
    step, so a draft that pays again is re-measured at once.
    """

    def __init__(self, every: int = 16) -> None:
        self.every = every
        self._quick = False  # the last probe was fully accepted: probe again at once
        self._streak = 0

    def plain_step(self, could_pay: bool = True, evidence: float = math.inf) -> bool:
        """Count one step that would be plain; True when it should be a probe instead.

        `could_pay`: a perfect draft would beat a plain step at these costs; if not,
        probes wait the full interval, as sooner ones would only lose time. `evidence`:
        how many (aged) verdicts the estimate that chose a plain step rests on.
        """
        self._streak += 1
        if not could_pay:
            wait = self.every
        elif self._quick:
            wait = 1
        else:
            wait = max(1, min(self.every, math.ceil(PLAIN_STEPS_PER_VERDICT * evidence)))
        if self._streak >= wait:
            self._streak = 0
            return True
        return False

    def drafted(self) -> None:
        self._streak = 0

    def probe_result(self, proposed: int, accepted: int) -> None:
        self._quick = proposed > 0 and accepted == proposed


class Stretcher:
    """Now and then one draft token more than planned, where the next position looks bad
    on too little evidence.

    A position is only measured by drafts that reach it, so a single rejection at
    position 2 (its rate then rests on one verdict, below the pooled rate) makes k = 1
    look best, and k = 1 never tests position 2 again; only aging slowly lifts it
    (docs/engine.md#adaptive-k-adaptivepy). So every `every` drafting steps
    whose next position has less than THIN_EVIDENCE verdicts and a rate below the
    pooled one draft one token more. The draft's early stop still cuts an unconfident
    token, and a few judged tokens settle the position either way.
    """

    def __init__(self, every: int = STRETCH_EVERY) -> None:
        self.every = every
        self._streak = 0

    def stretch(self, k: int, limit: int, acceptance: AcceptanceEstimate) -> int:
        """k, or k + 1 on every `every`-th call in a row where position k + 1 is thin and low."""
        if k <= 0 or k >= limit or not acceptance.thin_and_low(k):
            self._streak = 0
            return k
        self._streak += 1
        if self._streak < self.every:
            return k
        self._streak = 0
        return k + 1


class DraftLengthController:
    def __init__(
        self,
        max_k: int = 8,
        pinned: int | None = None,
        costs: CostModel | None = None,
        probe_every: int = 16,
    ) -> None:
        self.max_k = max_k
        self.pinned = pinned
        self.costs = costs or CostModel()
        self.acceptance = AcceptanceEstimate(max_k)
        self.prober = Prober(probe_every)
        self.stretcher = Stretcher()
        self._probing = False

    @property
    def probe_every(self) -> int:
        return self.prober.every

    @probe_every.setter
    def probe_every(self, value: int) -> None:
        self.prober.every = value

    def carry_from(self, previous: DraftLengthController) -> None:
        """Keep what an earlier generation learned about acceptance (the next message of a
        chat is mostly like the last; forgetting still follows a change)."""
        if previous.max_k == self.max_k:
            self.acceptance = previous.acceptance.softened()

    def expected_rate(self, k: int, draft_cost: float) -> float | None:
        """Expected tokens per second when drafting k tokens (k = 0: a plain step)."""
        t_verify = self.costs.verify_seconds(k + 1)
        if t_verify is None:
            return None
        return self.acceptance.expected_tokens(k) / (self.costs.draft_seconds(k, draft_cost) + t_verify)

    def best(self, limit: int, draft_cost: float) -> tuple[int, float]:
        """The k in 1..limit with the highest expected rate, and that rate (0 if unmeasured)."""
        rates = {k: self.expected_rate(k, draft_cost) or 0.0 for k in range(1, limit + 1)}
        if not rates:
            return 0, 0.0
        k = max(rates, key=lambda n: rates[n])
        return k, rates[k]

    def choose_k(self, drafter_is_model: bool = True, limit: int | None = None) -> int:
        """k for the next step (0 = plain), at most `limit` (default max_k).

        A model-free drafter costs microseconds (it is timed too, but as a model it
        would look free; its real cost is the longer verify, which is measured).
        """
        limit = self.max_k if limit is None else min(limit, self.max_k)
        self._probing = False
        if self.pinned is not None:
            return min(self.pinned, limit) if limit >= 0 else 0
        if limit <= 0:
            return 0
        draft_cost = (self.costs.draft_token or 0.0) if drafter_is_model else 0.0
        plain = self.expected_rate(0, draft_cost)
        if plain is None:
            return min(4, limit)  # nothing measured yet: start with a moderate draft
        k, rate = self.best(limit, draft_cost)
        if rate > plain:
            self.prober.drafted()
            return self.stretcher.stretch(k, limit, self.acceptance)
        if (
            self.prober.plain_step(
                perfect_draft_pays(self.costs, limit, draft_cost), self.acceptance.evidence(0)
            )
            or self.acceptance.untried
        ):
            self._probing = True
            return k
        self.acceptance.age()
        return 0

    def observe(self, proposed: int, accepted: int) -> None:
        self.acceptance.observe(proposed, accepted)
        if self._probing:
            self.prober.probe_result(proposed, accepted)
            self._probing = False
