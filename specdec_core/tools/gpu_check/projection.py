"""A projected end-to-end speedup from measured step costs and a measured acceptance.

With a draft step of t_d, a verify of m tokens costing v(m) and per-position acceptance
a_i, a fixed draft length k commits E(k) = 1 + sum_j prod_{i<=j} a_i tokens per
k * t_d + v(k + 1) (`stats.expected_tokens`), so against a baseline that spends t_base
per token the speedup is

    S(k) = E(k) / (k * t_d + v(k + 1)) * t_base,

and the projection is the best k (as `scripts/speedup-ceiling` takes it from a bench run).
Prompt reading and the host's work between steps are left out: it is a projection from
costs measured on one device and an acceptance measured on another, never a measurement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from ...engine.stats import expected_tokens


@dataclass(frozen=True)
class Projection:
    speedup: float  # S(k) at the best k
    k: int  # the best fixed draft length (0: speculation does not pay)
    tokens_per_verify: float  # E(k)
    ms_per_token: float  # (k * t_d + v(k + 1)) / E(k)

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def project(
    per_position: Sequence[float],
    draft_ms: float,
    verify_ms: Mapping[int, float],
    baseline_ms: float,
    max_k: int | None = None,
) -> Projection:
    """The best fixed k's speedup over `baseline_ms` per token; k runs while v(k + 1) was measured,
    up to `max_k` (the longest draft the engine issues, for our own projection)."""
    plain = verify_ms[1]
    best = Projection(speedup=baseline_ms / plain, k=0, tokens_per_verify=1.0, ms_per_token=plain)
    k = 1
    while k + 1 in verify_ms and k <= len(per_position) and (max_k is None or k <= max_k):
        tokens = expected_tokens(per_position, k)
        per_token = (k * draft_ms + verify_ms[k + 1]) / tokens
        if baseline_ms / per_token > best.speedup:
            best = Projection(baseline_ms / per_token, k, tokens, per_token)
        k += 1
    return best
