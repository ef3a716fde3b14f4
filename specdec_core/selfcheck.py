"""Exactness self-check: does a k-token verify compute what k plain steps compute?

Speculative greedy decoding commits the target's argmax at every position of a
verify. It reproduces the target alone bit for bit only if the logits of a verify
row equal those of the one-token step plain decoding would run there. Whether they
do depends on the kernels of this machine, precision and model, so it is measured
on the loaded model, on a short context, within a time budget (default 2 s):

    prefill  c_1..c_n                  (one forward)
    verify   t_1..t_k                  -> logits A [k, V]   (one forward)
    crop back to n; steps t_1, .., t_k -> logits B [k, V]   (k forwards)
    crop back to n; verify t_1..t_3, then t_4..t_k -> C   (two forwards)

`bitwise`: A == B == C exactly, so greedy output equals the target alone's. C is
there because a GPU library picks its kernel by row count: one of 8 rows may match
a step of 1 while one of 3 or 5 does not. On CUDA the context is longer (160
tokens), as its attention kernels also change with the key length; measured on an
H200 with random-weight models, a 12-token context passed forwards whose
speculative output differed.

Where torch runs more than one thread, two of the plain steps are repeated at one
thread: if they still equal A, the thread count does not change the numbers either,
and the process's thread governor may follow the machine's load mid-answer
(threads.py); otherwise it keeps the count the check ran at.
`near-ties may differ`: the largest |A - B| is reported; a token whose top two
logits are closer than that may come out differently than without speculation
(the output is still a faithful greedy decoding of the target up to that rounding).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from .threads import default_governor

if TYPE_CHECKING:
    from .engine import SpeculativeEngine
    from .kvcache import CachedModel

BITWISE = "bitwise"
NEAR_TIES = "near-ties may differ"

_CONTEXT = 12  # prompt positions before the verify
_CUDA_CONTEXT = 160
_VERIFY = 8  # verify rows compared (at least 2 are always checked, whatever the budget)
_SPLIT = 3  # the verify again as 3 rows, then the rest


@dataclass(frozen=True)
class ExactnessReport:
    label: str  # BITWISE | NEAR_TIES
    max_logit_diff: float  # max |verify logits - single-step logits| seen
    positions: int  # positions compared
    seconds: float  # time the check took
    thread_invariant: bool = True  # plain steps at one thread gave the verify's logits too

    @property
    def bitwise(self) -> bool:
        return self.label == BITWISE

    def summary(self) -> str:
        """One line for humans."""
        if self.bitwise:
            return f"bitwise (k-token verify == k plain steps, {self.positions} positions)"
        return (
            f"near-ties may differ (verify vs plain steps: max logit difference "
            f"{self.max_logit_diff:.3g} over {self.positions} positions)"
        )

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def check_exactness(
    engine: SpeculativeEngine, budget_s: float = 2.0, context_tokens: int | None = None
) -> ExactnessReport:
    """Compare a verify with plain steps on the engine's target; leaves the target cache empty."""
    start = time.perf_counter()
    runner = engine.target
    if context_tokens is None:
        context_tokens = _CUDA_CONTEXT if runner.device.type == "cuda" else _CONTEXT
    ids = torch.randint(
        0, engine.vocab_size, (context_tokens + _VERIFY,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    context, tail = ids[:context_tokens], ids[context_tokens:]
    try:
        runner.reset()
        runner.forward(context, logits_to_keep=1)
        verify = runner.forward(tail, logits_to_keep=len(tail))  # [k, V]
        runner.crop(context_tokens)
        steps: list[torch.Tensor] = []
        for token in tail:
            steps.append(runner.forward([token], logits_to_keep=1)[0])
            if len(steps) >= 2 and time.perf_counter() - start > budget_s:
                break
        runner.crop(context_tokens)
        split = [runner.forward(part, logits_to_keep=len(part)) for part in (tail[:_SPLIT], tail[_SPLIT:])]
        thread_invariant = _same_at_one_thread(runner, context, tail[:2], verify[:2])
    finally:
        runner.reset()
    n = len(steps)
    plain = torch.stack(steps)
    diff = max(float((rows[:n] - plain).abs().max()) for rows in (verify, torch.cat(split)))
    label = BITWISE if diff == 0.0 else NEAR_TIES
    default_governor().follow_load = thread_invariant and diff == 0.0
    return ExactnessReport(
        label=label,
        max_logit_diff=diff,
        positions=n,
        seconds=time.perf_counter() - start,
        thread_invariant=thread_invariant,
    )


def _same_at_one_thread(
    runner: CachedModel, context: list[int], tail: list[int], expected: torch.Tensor
) -> bool:
    """Do plain steps at one thread reproduce `expected` (computed at the current count)?"""
    threads = torch.get_num_threads()
    if threads == 1:
        return True  # nothing to compare with; a governor with one thread changes nothing
    runner.crop(len(context))
    torch.set_num_threads(1)
    try:
        steps = [runner.forward([token], logits_to_keep=1)[0] for token in tail]
    finally:
        torch.set_num_threads(threads)
    return bool(torch.equal(torch.stack(steps), expected))
