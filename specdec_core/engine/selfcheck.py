"""Exactness self-check: does a verify compute what plain steps compute, at every thread count?

Speculative greedy decoding commits the target's argmax at every position of a
verify. It reproduces the target alone bit for bit only if the logits of a verify
row equal those of the one-token step plain decoding would run there. Whether they
do depends on the kernels of this machine, precision and model, so it is measured
on the loaded model, on a short context, within a time budget (`BUDGET_S`, 5 s):

    prefill  c_1..c_n                        (one forward)
    verify   t_1..t_m                        -> logits A [m, V]   (one forward)
    crop back to n; steps t_1, .., t_m       -> logits B [m, V]   (m forwards)
    crop back to n; verify t_1..t_3, then t_4..t_m -> C          (two forwards)

m = `VERIFY_ROWS`: the widest verify the engine issues (`MAX_DRAFT_LENGTH` drafts after
the last committed token), and at least one row past the largest row chunk of the
fixed-rows linears (batch_invariant.ROWS), so rows on both sides of a chunk boundary
are compared, as a long prompt read in chunks crosses them. Every row of A is compared
with the plain step at its position. C is there because a GPU library picks its kernel
by row count: one of m rows may match a step of 1 while one of 3 does not. On CUDA the
context is longer (160 tokens), as its attention kernels also change with the key
length, and a short context can pass forwards whose speculative output differs
(docs/engine.md#where-near-ties-may-differ).

Thread counts: torch's thread count is an input to the numbers too, and the process's
thread governor (threads.py) may change it between two steps of an answer. So the check
runs A, B and C at the count the governor applies (its pinned count, else the current
one), then, at every other count the governor may choose (1 to its maximum, torch's
initial count), the verify again (all m rows against A) and the first plain step
(against B's first row): the multi-row and the one-row shapes of every kernel. Each
count runs as the governor runs it, with the C kernels' helper threads where it would
share a spare core (native.share_spare_core). Only when
every count gives the same logits may the governor follow the machine's load
(`follow_load`); otherwise it keeps the count it has.

Labels:
`bitwise`: every comparison above was made and found no difference, so greedy output
  equals the target alone's at any thread count the governor chooses.
`near-ties may differ`: some comparison differed; the largest difference is reported:
  a token whose top two logits are closer than that may come out differently than
  without speculation (the output is still a faithful greedy decoding of the target
  up to that rounding).
`unverified: check incomplete`: the budget ran out before every comparison was made
  (rows, the split or a thread count), and those made found no difference. Nothing
  is claimed; the summary says what was left out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from ..kernels.batch_invariant import ROWS
from ..kernels.cpu import native
from ..kernels.cpu.threads import ThreadGovernor, default_governor
from .speculative import MAX_DRAFT_LENGTH

if TYPE_CHECKING:
    from ..kernels.runner import Runner
    from .speculative import SpeculativeEngine

BITWISE = "bitwise"
NEAR_TIES = "near-ties may differ"
UNVERIFIED = "unverified: check incomplete"

# A cap for models too slow to check, not the check's expected time: the budget must also
# hold a check that a busy neighbour slows several-fold (threads.py), since one it cuts short
# leaves the label unverified and the governor at its count for the whole session.
BUDGET_S = 5.0
VERIFY_ROWS = max(MAX_DRAFT_LENGTH + 1, max(ROWS.values()) + 1)
_CONTEXT = 12  # prompt positions before the verify
_CUDA_CONTEXT = 160
_SPLIT = 3  # the verify again as 3 rows, then the rest


@dataclass(frozen=True)
class ExactnessReport:
    label: str  # BITWISE | NEAR_TIES | UNVERIFIED
    max_logit_diff: float  # the largest |logit difference| over every comparison made
    positions: int  # verify rows compared with the plain step at their position
    seconds: float  # time the check took
    thread_invariant: bool = True  # the other thread counts compared gave the same logits
    verify_rows: int = VERIFY_ROWS  # rows of the verify (every one is to be compared)
    split_compared: bool = True  # the verify as 3 rows then the rest was compared
    threads: int = 1  # the thread count A, B and C ran at
    threads_compared: tuple[int, ...] = ()  # the other counts the governor may choose, compared
    threads_skipped: tuple[int, ...] = ()  # ... and those the budget left out
    budget_s: float = BUDGET_S

    @property
    def bitwise(self) -> bool:
        return self.label == BITWISE

    @property
    def left_out(self) -> list[str]:
        """The comparisons the budget left out, for humans (empty when the check is complete)."""
        parts = []
        if self.positions < self.verify_rows:
            parts.append(f"{self.positions} of {self.verify_rows} verify rows compared")
        if not self.split_compared:
            parts.append(f"the {_SPLIT} + {self.verify_rows - _SPLIT} split not compared")
        if self.threads_skipped:
            parts.append(f"{_counts(self.threads_skipped)} not compared")
        return parts

    def summary(self) -> str:
        """One line for humans."""
        threads = _counts((self.threads, *self.threads_compared))
        if self.bitwise:
            return (
                f"bitwise (a {self.verify_rows}-token verify == plain steps at every position, at {threads})"
            )
        left_out = "; ".join(self.left_out)
        if self.label == NEAR_TIES:
            return (
                f"near-ties may differ (verify vs plain steps at {threads}: max logit difference "
                f"{self.max_logit_diff:.3g} over {self.positions} positions"
                + (f"; check incomplete: {left_out})" if left_out else ")")
            )
        return f"{UNVERIFIED} ({left_out} within the {self.budget_s:g} s budget; no difference in those compared)"

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "summary": self.summary()}


def check_exactness(
    engine: SpeculativeEngine,
    budget_s: float | None = None,
    context_tokens: int | None = None,
    governor: ThreadGovernor | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> ExactnessReport:
    """Compare a verify with plain steps on the engine's target, at every thread count
    `governor` (the process's) may choose; sets its `follow_load`. Leaves the target cache empty.

    `budget_s` (default `BUDGET_S`, read at the call) bounds the time: a comparison it
    leaves out makes the report `unverified` unless one already differed."""
    budget = BUDGET_S if budget_s is None else budget_s
    start = clock()
    governor = governor or default_governor()
    runner = engine.target
    if context_tokens is None:
        context_tokens = _CUDA_CONTEXT if runner.device.type == "cuda" else _CONTEXT
    ids = torch.randint(
        0, engine.vocab_size, (context_tokens + VERIFY_ROWS,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    threads = governor.pinned or torch.get_num_threads()  # what the governor applies at the first step
    others = [n for n in _choices(governor) if n != threads]
    seen = _compare(
        runner,
        ids[:context_tokens],
        ids[context_tokens:],
        governor,
        threads,
        others,
        lambda: clock() - start < budget,
    )
    report = seen.report(threads, others, budget, clock() - start)
    governor.follow_load = report.bitwise
    return report


@dataclass(frozen=True)
class _Comparison:
    """What one run of the check compared, before it is labelled."""

    rows: int  # the verify's
    positions: int  # rows compared with plain steps
    diff: float  # largest difference over the rows and the split
    split_compared: bool
    threads_compared: tuple[int, ...]
    thread_diff: float  # largest difference at the other thread counts

    def report(self, threads: int, others: list[int], budget_s: float, seconds: float) -> ExactnessReport:
        skipped = tuple(count for count in others if count not in self.threads_compared)
        complete = self.positions == self.rows and self.split_compared and not skipped
        diff = max(self.diff, self.thread_diff)
        return ExactnessReport(
            label=NEAR_TIES if diff > 0.0 else BITWISE if complete else UNVERIFIED,
            max_logit_diff=diff,
            positions=self.positions,
            seconds=seconds,
            thread_invariant=self.thread_diff == 0.0,
            verify_rows=self.rows,
            split_compared=self.split_compared,
            threads=threads,
            threads_compared=self.threads_compared,
            threads_skipped=skipped,
            budget_s=budget_s,
        )


def _compare(
    runner: Runner,
    context: list[int],
    tail: list[int],
    governor: ThreadGovernor,
    threads: int,
    others: list[int],
    in_budget: Callable[[], bool],
) -> _Comparison:
    """The check's forwards (module doc) at `threads`, then at the `others`, as far as the budget goes."""
    try:
        with _running_at(governor, threads):
            runner.reset()
            runner.forward(context, logits_to_keep=1)
            verify = runner.forward(tail, logits_to_keep=len(tail))  # [m, V]
            plain = _plain_steps(runner, len(context), tail, in_budget)  # [<= m, V]
            split = _split(runner, len(context), tail) if in_budget() else None
        compared, thread_diff = _other_thread_counts(
            runner, len(context), tail, verify, plain, governor, others, in_budget
        )
    finally:
        runner.reset()
    n = len(plain)
    diffs = [_max_diff(verify[:n], plain)] + ([] if split is None else [_max_diff(split[:n], plain)])
    return _Comparison(len(tail), n, max(diffs), split is not None, compared, thread_diff)


def _plain_steps(
    runner: Runner, context_tokens: int, tail: list[int], in_budget: Callable[[], bool]
) -> torch.Tensor:
    """One-token steps over `tail` after the context, as far as the budget goes -> [<= m, V]."""
    runner.crop(context_tokens)
    steps: list[torch.Tensor] = []
    for token in tail:
        if not in_budget():
            break
        steps.append(runner.forward([token], logits_to_keep=1)[0])
    return torch.stack(steps) if steps else torch.empty(0)


def _split(runner: Runner, context_tokens: int, tail: list[int]) -> torch.Tensor:
    """The verify again as _SPLIT rows, then the rest -> [m, V]."""
    runner.crop(context_tokens)
    parts = (tail[:_SPLIT], tail[_SPLIT:])
    return torch.cat([runner.forward(part, logits_to_keep=len(part)) for part in parts])


def _choices(governor: ThreadGovernor) -> list[int]:
    """The thread counts the governor may apply during an answer."""
    if governor.pinned is not None:
        return [governor.pinned]
    return list(range(1, governor.max_threads + 1))


def _other_thread_counts(
    runner: Runner,
    context_tokens: int,
    tail: list[int],
    verify: torch.Tensor,
    plain: torch.Tensor,
    governor: ThreadGovernor,
    counts: list[int],
    in_budget: Callable[[], bool],
) -> tuple[tuple[int, ...], float]:
    """At each count, the verify (vs `verify`) and the first plain step (vs `plain[0]`), as far
    as the budget goes -> (the counts compared, the largest difference seen)."""
    compared: list[int] = []
    diff = 0.0
    for count in counts:
        if len(plain) == 0 or not in_budget():
            break
        with _running_at(governor, count):
            runner.crop(context_tokens)
            rows = runner.forward(tail, logits_to_keep=len(tail))
            runner.crop(context_tokens)
            step = runner.forward(tail[:1], logits_to_keep=1)
        diff = max(diff, _max_diff(rows, verify), _max_diff(step, plain[:1]))
        compared.append(count)
    return tuple(compared), diff


@contextmanager
def _running_at(governor: ThreadGovernor, threads: int) -> Iterator[None]:
    """Run at `threads` as the governor applies them (the C kernels' helper included), then restore."""
    saved = torch.get_num_threads(), native.sharing_spare_core()
    torch.set_num_threads(threads)
    native.share_spare_core(governor.shares_at(threads))
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        native.share_spare_core(saved[1])


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over equal shapes; 0 for none."""
    return float((a - b).abs().max()) if b.numel() else 0.0


def _counts(counts: tuple[int, ...]) -> str:
    """(1, 2, 3) -> "1–3 threads"; (4,) -> "4 threads"; (1, 3) -> "1, 3 threads"."""
    ordered = sorted(set(counts))
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        text = f"{ordered[0]}–{ordered[-1]}"
    else:
        text = ", ".join(str(n) for n in ordered)
    return f"{text} thread{'s' if ordered != [1] else ''}"
