"""Statistics of one generation, and the theory they are compared against.

Speedup is measured against the target alone *on this machine, in this run*:
the engine times every target forward it makes, keyed by how many tokens it
carried (see `CostModel`). The baseline for "target alone" is the measured cost
of a one-token target forward (a plain decoding step: exactly what the target
alone does per token), times the number of tokens generated. So
`measured_speedup = new_tokens * t_verify(1) / decode_seconds`. When speculation
ran every step and no one-token forward was timed in this run, t_verify(1) comes
from calibration or from the fitted cost line (`baseline_measured` says which).

The theoretical figure is Leviathan et al.'s expected speedup, fed with what this
run measured: the acceptance of each draft position given the ones before it (not
accepted / proposed, which counts positions after a rejection that were never
checked), the draft lengths actually used, and the draft cost actually paid.

`StatsAccumulator` is the one place a run's figures are counted; a `GenerationStats`
is a frozen snapshot of it (the running gauges and the final stats alike).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .adaptive import CostModel


def theoretical_speedup(alpha: float, k: float, c: float) -> float:
    """Expected speedup for acceptance α, draft length k, cost ratio c = t_draft / t_target.

    Leviathan et al. 2023, eq. 1: (1 - α^(k+1)) / ((1 - α)(k c + 1)).
    """
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


def expected_tokens(per_position: Sequence[float], k: int) -> float:
    """Tokens a verify of k drafts commits on average: 1 + sum_j prod_{i<=j} a_i.

    A position never reached in the run counts as never accepted.
    """
    total, survive = 1.0, 1.0
    for i in range(k):
        survive *= per_position[i] if i < len(per_position) else 0.0
        total += survive
    return total


def speedup_bound(per_position: Sequence[float], k_histogram: Mapping[int, int], c: float) -> float:
    """Expected speedup for per-position acceptance a_i, the run's draft lengths and cost ratio c.

    With a constant a_i = α and one k this is `theoretical_speedup(α, k, c)`; a plain
    step (k = 0) counts as one token for one target step.
    """
    steps = sum(k_histogram.values())
    if steps == 0:
        return 1.0
    tokens = sum(n * expected_tokens(per_position, k) for k, n in k_histogram.items()) / steps
    mean_k = sum(k * n for k, n in k_histogram.items()) / steps
    return tokens / (mean_k * c + 1)


@dataclass(frozen=True)
class GenerationStats:
    drafter: str
    prompt_tokens: int
    new_tokens: int
    stop_reason: str  # "eos" | "max_tokens" | "cancelled"
    steps: int  # verify steps (target forwards after prefill)
    proposed: int
    accepted: int
    per_position_acceptance: tuple[float, ...]  # P(position i accepted | i-1 accepted), this run
    k_histogram: dict[int, int] = field(default_factory=dict)
    target_forwards: int = 0
    draft_forwards: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    target_token_seconds: float = 0.0  # t_verify(1): one plain target step
    draft_token_seconds: float = 0.0  # t_draft: one draft forward
    # What the engine believed a verify of m = 1, 2, ... tokens costs when the run ended:
    # the costs its draft lengths were chosen by.
    verify_curve: tuple[float, ...] = ()
    baseline_measured: bool = False
    # From the engine's exactness self-check: "bitwise" | "near-ties may differ" |
    # "unverified: check incomplete" | "unchecked" (no self-check ran).
    exactness: str = "unchecked"
    max_logit_diff: float | None = None
    # False when no plain-decoding baseline could be timed (a served engine that cannot
    # switch speculation off): `measured_speedup` is then 0.0 and `as_dict` writes None.
    speedup_known: bool = True
    note: str = ""  # one line on how the figures were obtained or why the answer ended early

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify step (accepted + the corrected/bonus one)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def mean_k(self) -> float:
        total = sum(self.k_histogram.values())
        return sum(k * n for k, n in self.k_histogram.items()) / total if total else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def baseline_tokens_per_second(self) -> float:
        return 1.0 / self.target_token_seconds if self.target_token_seconds > 0 else 0.0

    @property
    def measured_speedup(self) -> float:
        if self.decode_seconds <= 0 or self.target_token_seconds <= 0:
            return 0.0
        return self.new_tokens * self.target_token_seconds / self.decode_seconds

    @property
    def cost_ratio(self) -> float:
        """c = t_draft / t_target (Leviathan et al.), t_draft per *proposed* token as spent.

        For a model draft that is one forward per token; free lookup drafts cost ~0, so a
        mixed drafter's c is the blend it really paid, which keeps the bound meaningful.
        """
        if self.target_token_seconds <= 0:
            return 0.0
        if self.proposed > 0:
            return self.draft_seconds / self.proposed / self.target_token_seconds
        return self.draft_token_seconds / self.target_token_seconds

    @property
    def theoretical_speedup(self) -> float:
        return speedup_bound(self.per_position_acceptance, self.k_histogram, self.cost_ratio)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready, with the derived figures included."""
        plain = {name: getattr(self, name) for name in self.__dataclass_fields__}
        plain["per_position_acceptance"] = list(self.per_position_acceptance)
        plain["verify_curve"] = list(self.verify_curve)
        plain["k_histogram"] = {str(k): v for k, v in sorted(self.k_histogram.items())}
        for name in (
            "acceptance_rate",
            "mean_accepted_length",
            "mean_k",
            "tokens_per_second",
            "baseline_tokens_per_second",
            "measured_speedup",
            "cost_ratio",
            "theoretical_speedup",
        ):
            plain[name] = getattr(self, name)
        if not self.speedup_known:
            plain["measured_speedup"] = None
        return plain


@dataclass
class StatsAccumulator:
    """A run's counters; `snapshot()` turns them into `GenerationStats`."""

    prompt_tokens: int
    max_draft_length: int
    exactness: str = "unchecked"
    max_logit_diff: float | None = None
    new_tokens: int = 0
    stop_reason: str = "max_tokens"  # | "eos" | "cancelled"
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_forwards: int = 0
    target_forwards: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    # Time the consumer held the generator between events (a UI rendering, a test
    # pausing): not the engine's, so not in decode_seconds or the speedup.
    paused_seconds: float = 0.0
    k_histogram: Counter[int] = field(default_factory=Counter)  # drafted tokens per step
    position_hits: list[int] = field(default_factory=list)  # per draft position: accepted
    position_trials: list[int] = field(default_factory=list)  # per draft position: reached

    def __post_init__(self) -> None:
        self.position_hits = [0] * self.max_draft_length
        self.position_trials = [0] * self.max_draft_length

    def record_step(
        self, proposed: int, accepted: int, draft_seconds: float, draft_forwards: int, verify_seconds: float
    ) -> None:
        """One verify of `proposed` draft tokens, `accepted` of them kept."""
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        self.draft_forwards += draft_forwards
        self.target_forwards += 1
        self.k_histogram[proposed] += 1
        # Position i was reached if all before it were accepted; accepted if i < n.
        for i in range(min(proposed, self.max_draft_length, accepted + 1)):
            self.position_trials[i] += 1
            self.position_hits[i] += i < accepted

    def snapshot(self, drafter: str, costs: CostModel) -> GenerationStats:
        pairs = zip(self.position_hits, self.position_trials, strict=True)
        return GenerationStats(
            drafter=drafter,
            prompt_tokens=self.prompt_tokens,
            new_tokens=self.new_tokens,
            stop_reason=self.stop_reason,
            steps=self.steps,
            proposed=self.proposed,
            accepted=self.accepted,
            per_position_acceptance=tuple(h / t for h, t in pairs if t > 0),
            k_histogram=dict(self.k_histogram),
            target_forwards=self.target_forwards,
            draft_forwards=self.draft_forwards,
            prefill_seconds=self.prefill_seconds,
            decode_seconds=self.decode_seconds,
            draft_seconds=self.draft_seconds,
            verify_seconds=self.verify_seconds,
            target_token_seconds=costs.verify_seconds(1) or 0.0,
            draft_token_seconds=costs.draft_token or 0.0,
            verify_curve=tuple(costs.verify_seconds(m) or 0.0 for m in range(1, self.max_draft_length + 2)),
            baseline_measured=1 in costs.verify,
            exactness=self.exactness,
            max_logit_diff=self.max_logit_diff,
        )
