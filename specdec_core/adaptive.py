"""Choosing the draft length k from measured costs and acceptance.

Each step we pick the k that maximises expected tokens per second:

    E[tokens | k] = 1 + sum_{j=1..k} prod_{i<=j} a_i          (a_i: P(accept i | accepted 1..i-1))
    T(k)          = k * t_draft + t_verify(k + 1)
    k*            = argmax_k E[tokens | k] / T(k),   k = 0 meaning a plain target step

Nothing is assumed: t_verify(m) is timed for every target forward of m tokens
(on a CPU a 10-token verify costs clearly more than a 1-token step), t_draft for
every draft forward, and a_i from the verdicts. Timings are the median of the last
few: on a shared machine one forward now and then stalls for 5-20x its cost (an
OpenMP thread descheduled; measured in docs/performance.md), and an average would
carry such a spike into many steps, or forever for a size the controller then avoids. When k = 0 wins, speculation is
off until a periodic probe re-measures acceptance, so a prompt the draft cannot
predict costs at most a probe every `probe_every` steps over the target alone.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

# Timings kept per forward size. The median of 7 ignores up to 3 stalled forwards and
# still follows a real change (longer context, another load on the machine) within 4.
WINDOW = 7


@dataclass
class CostModel:
    """Measured seconds of a target forward by number of tokens, and of a draft forward."""

    verify: dict[int, float] = field(default_factory=dict)  # m tokens -> median recent seconds
    draft_token: float | None = None  # median recent seconds per draft forward
    # Used before anything is measured: verifying m tokens ~ (1 + slope * (m - 1)) x one step.
    prior_slope: float = 0.1
    _verify_recent: dict[int, deque[float]] = field(default_factory=dict, repr=False)
    _draft_recent: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW), repr=False)

    def observe_verify(self, m: int, seconds: float) -> None:
        recent = self._verify_recent.get(m)
        if recent is None:
            # A value given at construction counts as the first measurement.
            recent = self._verify_recent[m] = deque([self.verify[m]] if m in self.verify else [], WINDOW)
        recent.append(seconds)
        self.verify[m] = statistics.median(recent)

    def observe_draft(self, forwards: int, seconds: float) -> None:
        if forwards <= 0:
            return
        if not self._draft_recent and self.draft_token is not None:
            self._draft_recent.append(self.draft_token)
        self._draft_recent.append(seconds / forwards)
        self.draft_token = statistics.median(self._draft_recent)

    def forget_draft(self) -> None:
        """A new drafter has its own cost."""
        self.draft_token = None
        self._draft_recent.clear()

    def verify_seconds(self, m: int) -> float | None:
        """t_verify(m), never below a smaller size's: a size last timed in a calm moment
        must not look cheaper than a smaller one timed under load just now."""
        t = self._fitted_verify_seconds(m)
        if t is None:
            return None
        return max(t, max((v for n, v in self.verify.items() if n < m), default=0.0))

    def _fitted_verify_seconds(self, m: int) -> float | None:
        """Measured t_verify(m), else interpolated/extrapolated from a least-squares line."""
        if m in self.verify:
            return self.verify[m]
        if not self.verify:
            return None
        points = sorted(self.verify.items())
        if len(points) == 1:
            m0, t0 = points[0]
            unit = t0 / (1 + self.prior_slope * (m0 - 1))
            return unit * (1 + self.prior_slope * (m - 1))
        n = len(points)
        mean_m = sum(p[0] for p in points) / n
        mean_t = sum(p[1] for p in points) / n
        var = sum((p[0] - mean_m) ** 2 for p in points)
        slope = max(0.0, sum((p[0] - mean_m) * (p[1] - mean_t) for p in points) / var)
        return max(1e-9, mean_t + slope * (m - mean_m))


class AcceptanceEstimate:
    """Online per-position acceptance with exponential forgetting and a shrinkage prior."""

    def __init__(
        self, max_k: int, prior: float = 0.6, prior_weight: float = 2.0, decay: float = 0.97
    ) -> None:
        self.prior = prior
        self.prior_weight = prior_weight
        self.decay = decay
        self.hits = [0.0] * max_k
        self.trials = [0.0] * max_k

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.hits = [h * self.decay for h in self.hits]
        self.trials = [t * self.decay for t in self.trials]
        # Positions 1..accepted were accepted; position accepted+1 (if proposed) was rejected.
        for i in range(min(proposed, accepted + 1, len(self.trials))):
            self.trials[i] += 1.0
            if i < accepted:
                self.hits[i] += 1.0

    def rate(self, i: int) -> float:
        """a_{i+1}: probability position i+1 is accepted given all before were."""
        pooled_hits = sum(self.hits)
        pooled_trials = sum(self.trials)
        # Shrink each position toward the pooled rate, the pooled rate toward the prior.
        pooled = (pooled_hits + self.prior * self.prior_weight) / (pooled_trials + self.prior_weight)
        return (self.hits[i] + pooled * self.prior_weight) / (self.trials[i] + self.prior_weight)

    def expected_tokens(self, k: int) -> float:
        total, survive = 1.0, 1.0
        for i in range(k):
            survive *= self.rate(i)
            total += survive
        return total


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
        self.probe_every = probe_every
        self._plain_streak = 0

    def expected_rate(self, k: int, draft_cost: float) -> float | None:
        """Expected tokens per second when drafting k tokens."""
        t_verify = self.costs.verify_seconds(k + 1)
        if t_verify is None:
            return None
        return self.acceptance.expected_tokens(k) / (k * draft_cost + t_verify)

    def choose_k(self, drafter_is_model: bool) -> int:
        if self.pinned is not None:
            return self.pinned
        # A model-free drafter costs microseconds (it is timed too, but as a model it
        # would look free; its real cost is the longer verify, which is measured).
        draft_cost = (self.costs.draft_token or 0.0) if drafter_is_model else 0.0
        rates = [self.expected_rate(k, draft_cost) for k in range(self.max_k + 1)]
        if rates[0] is None:
            return min(4, self.max_k)  # nothing measured yet: start with a moderate draft
        best = max(range(self.max_k + 1), key=lambda k: rates[k] or 0.0)
        if best > 0:
            self._plain_streak = 0
            return best
        self._plain_streak += 1
        if self._plain_streak >= self.probe_every:
            self._plain_streak = 0
            return 1 + max(range(self.max_k), key=lambda k: rates[k + 1] or 0.0)
        return 0

    def observe(self, proposed: int, accepted: int) -> None:
        self.acceptance.observe(proposed, accepted)
