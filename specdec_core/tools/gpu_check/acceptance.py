"""Per-position acceptance of a draft, pooled over prompts, at a pinned draft length.

Position i of a draft is *reached* in a verify when positions 0..i-1 were accepted and
the draft held at least i+1 tokens; it is *accepted* when the target kept it. The
acceptance a_i = accepted_i / reached_i is P(position i accepted | all before it were),
the figure `stats.expected_tokens` takes. Counts are pooled over every verify of every
prompt (not an average of per-prompt ratios), so a long answer weighs by its verifies.
The draft length is pinned so every position up to k is measured.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ...engine.events import StepEvent
from ...engine.speculative import GenerationParams, SpeculativeEngine


@dataclass
class AcceptanceCounts:
    """Reached and accepted counts per draft position, over any number of verifies."""

    k: int
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    verifies: int = 0
    new_tokens: int = 0

    def __post_init__(self) -> None:
        self.reached = self.reached or [0] * self.k
        self.accepted = self.accepted or [0] * self.k

    def record(self, proposed: int, accepted: int) -> None:
        """One verify of `proposed` draft tokens of which the first `accepted` were kept."""
        self.verifies += 1
        for i in range(min(proposed, self.k, accepted + 1)):
            self.reached[i] += 1
            self.accepted[i] += i < accepted

    @property
    def per_position(self) -> list[float]:
        """a_i for every position reached at least once (a prefix of the k positions)."""
        rates = []
        for hits, trials in zip(self.accepted, self.reached, strict=True):
            if trials == 0:
                break
            rates.append(hits / trials)
        return rates

    def as_dict(self) -> dict[str, object]:
        return {
            "k": self.k,
            "verifies": self.verifies,
            "new_tokens": self.new_tokens,
            "reached": list(self.reached),
            "accepted": list(self.accepted),
            "per_position_acceptance": self.per_position,
        }


def measure(
    engine: SpeculativeEngine, prompts: Iterable[Sequence[int]], new_tokens: int, k: int
) -> AcceptanceCounts:
    """Greedy generations of `new_tokens` from each prompt with k pinned, their verifies counted."""
    counts = AcceptanceCounts(k)
    params = GenerationParams(max_new_tokens=new_tokens, draft_length=k, max_draft_length=k)
    for prompt in prompts:
        for event in engine.generate(list(prompt), params):
            if isinstance(event, StepEvent):
                counts.record(event.proposed, event.accepted)
                counts.new_tokens += event.committed
    return counts
