"""Statistics of one generation, and the theory they are compared against.

Speedup is measured against the target alone *on this machine, in this run*:
the engine times every target forward it makes, keyed by how many tokens it
carried (see `CostModel`). The baseline for "target alone" is the measured cost
of a one-token target forward (a plain decoding step: exactly what the target
alone does per token), times the number of tokens generated. So
`measured_speedup = new_tokens * t_verify(1) / decode_seconds`. When speculation
ran every step and no one-token forward was timed in this run, t_verify(1) comes
from calibration or from the fitted cost line (`baseline_measured` says which).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def theoretical_speedup(alpha: float, k: float, c: float) -> float:
    """Expected speedup for acceptance α, draft length k, cost ratio c = t_draft / t_target.

    Leviathan et al. 2023, eq. 1: (1 - α^(k+1)) / ((1 - α)(k c + 1)).
    """
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


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
    baseline_measured: bool = False

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
        return theoretical_speedup(self.acceptance_rate, self.mean_k, self.cost_ratio)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready, with the derived figures included."""
        plain = {name: getattr(self, name) for name in self.__dataclass_fields__}
        plain["per_position_acceptance"] = list(self.per_position_acceptance)
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
        return plain
