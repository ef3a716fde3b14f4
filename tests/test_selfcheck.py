"""The exactness self-check tells a batch-invariant forward from one that is not."""

from __future__ import annotations

import copy

import pytest
import torch

from specdec_core.engine.selfcheck import BITWISE, NEAR_TIES, UNVERIFIED, VERIFY_ROWS, check_exactness
from specdec_core.engine.speculative import MAX_DRAFT_LENGTH, SpeculativeEngine
from specdec_core.kernels.batch_invariant import ROWS, make_batch_invariant
from specdec_core.kernels.cpu import native
from specdec_core.kernels.cpu.quant_cpu import int8_available, quantize_linears_int8
from specdec_core.kernels.cpu.threads import ThreadGovernor
from specdec_core.models.cpu_backend import prepare_for_cpu


@pytest.fixture(scope="module")
def rowwise(target):
    """The tiny target as the CPU loader prepares it at fp32: its self-check is bitwise."""
    model = copy.deepcopy(target)
    prepare_for_cpu(model, "fp32")
    return model


@pytest.fixture
def one_thread():
    """Torch at one thread for the test, as after the governor dropped one; restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _with_head(model: torch.nn.Module, head: type[torch.nn.Module], *args: object) -> torch.nn.Module:
    """A copy of `model` whose lm_head is wrapped in `head(lm_head, *args)`."""
    other = copy.deepcopy(model)
    other.lm_head = head(other.lm_head, *args)
    return other


class _RowCountBias(torch.nn.Module):
    """A linear whose output shifts with the number of tokens in the forward."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + 1e-3 * x.shape[-2]


def test_the_verify_compared_is_the_widest_the_engine_issues_and_crosses_a_row_chunk():
    assert MAX_DRAFT_LENGTH + 1 <= VERIFY_ROWS  # the last committed token and a full draft
    assert max(ROWS.values()) < VERIFY_ROWS  # rows on both sides of a fixed-rows chunk


def test_a_batch_dependent_forward_is_reported_with_its_logit_difference(tokenizer, target):
    report = check_exactness(SpeculativeEngine(_with_head(target, _RowCountBias), tokenizer))
    assert report.label == NEAR_TIES
    # VERIFY_ROWS rows vs 1, plus fp32 rounding noise.
    assert report.max_logit_diff == pytest.approx((VERIFY_ROWS - 1) * 1e-3, abs=2e-4)
    assert "near-ties may differ" in report.summary()
    assert report.as_dict()["positions"] == report.positions == VERIFY_ROWS


class _ThreeRowBias(torch.nn.Module):
    """A linear that is off only for 3-row inputs, as a GPU library may pick its kernel by row count."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + (1e-3 if x.shape[-2] == 3 else 0.0)


def test_a_forward_off_only_at_some_row_count_is_caught(tokenizer, target):
    report = check_exactness(SpeculativeEngine(_with_head(target, _ThreeRowBias), tokenizer))
    assert report.label == NEAR_TIES
    assert report.max_logit_diff == pytest.approx(1e-3, abs=2e-4)


class _OneRowBias(torch.nn.Module):
    """A linear that is off only at row `row` of a forward that has that many rows."""

    def __init__(self, linear: torch.nn.Linear, row: int) -> None:
        super().__init__()
        self.linear = linear
        self.row = row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        if x.shape[-2] > self.row:
            out = out.clone()
            out[..., self.row, :] += 1e-3
        return out


@pytest.mark.parametrize("row", [MAX_DRAFT_LENGTH, VERIFY_ROWS - 1])
def test_every_row_of_the_widest_verify_is_compared(tokenizer, rowwise, row):
    """Row 12: the last of a verify with k pinned at 12; row 16: the first past a 16-row chunk."""
    report = check_exactness(SpeculativeEngine(_with_head(rowwise, _OneRowBias, row), tokenizer))
    assert report.label == NEAR_TIES
    assert report.max_logit_diff == pytest.approx(1e-3, rel=1e-2)


@pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm int8 kernels")
def test_the_batch_invariant_int8_forward_checks_bitwise_and_leaves_no_cache(tokenizer, target):
    model = copy.deepcopy(target)
    quantize_linears_int8(model)
    make_batch_invariant(model)
    engine = SpeculativeEngine(model, tokenizer)
    report = check_exactness(engine)
    assert (report.label, report.max_logit_diff) == (BITWISE, 0.0)
    assert report.summary().startswith("bitwise")
    assert engine.target.ids == []


class _TwoThreadBias(torch.nn.Module):
    """A linear that is off only at two threads (as an fp32 matmul may be, in its last bits)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + (1e-3 if torch.get_num_threads() == 2 else 0.0)


def test_the_governor_follows_the_load_only_where_every_thread_count_it_may_choose_agrees(
    tokenizer, rowwise, one_thread
):
    governor = ThreadGovernor(max_threads=2, follow_load=False)
    report = check_exactness(SpeculativeEngine(rowwise, tokenizer), governor=governor)
    assert report.bitwise and governor.follow_load
    assert (report.threads, report.threads_compared) == (1, (2,))

    model = _with_head(rowwise, _TwoThreadBias)
    report = check_exactness(SpeculativeEngine(model, tokenizer), governor=governor)
    assert (report.threads, report.threads_compared) == (1, (2,))
    assert not report.bitwise and not report.thread_invariant and not governor.follow_load
    assert torch.get_num_threads() == 1  # the count it ran at


class _ThreadsSeen(torch.nn.Module):
    """A linear that notes torch's thread count, and whether the C kernels share with a helper, at every call."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        self.seen: set[tuple[int, bool]] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add((torch.get_num_threads(), native.sharing_spare_core()))
        return self.linear(x)


def test_each_thread_count_runs_as_the_governor_runs_it_and_the_settings_are_restored(
    tokenizer, rowwise, one_thread
):
    governor = ThreadGovernor(max_threads=2, follow_load=False)
    sharing = native.sharing_spare_core()
    model = _with_head(rowwise, _ThreadsSeen)
    check_exactness(SpeculativeEngine(model, tokenizer), governor=governor)
    assert model.lm_head.seen == {(1, True), (2, False)}  # one thread shares a spare core with the helper
    assert (torch.get_num_threads(), native.sharing_spare_core()) == (1, sharing)


def test_a_pinned_thread_count_is_the_one_checked_and_the_only_one(tokenizer, rowwise, one_thread):
    governor = ThreadGovernor(max_threads=3, pinned=2, follow_load=False)
    model = _with_head(rowwise, _ThreadsSeen)
    report = check_exactness(SpeculativeEngine(model, tokenizer), governor=governor)
    assert report.bitwise and (report.threads, report.threads_compared) == (2, ())
    assert model.lm_head.seen == {(2, False)}
    assert torch.get_num_threads() == 1


def test_a_budget_too_small_to_compare_every_row_leaves_the_check_unverified(tokenizer, rowwise):
    governor = ThreadGovernor(max_threads=2, follow_load=True)
    report = check_exactness(SpeculativeEngine(rowwise, tokenizer), budget_s=0.0, governor=governor)
    assert report.label == UNVERIFIED and not report.bitwise and not governor.follow_load
    assert report.positions < report.verify_rows and not report.split_compared
    assert report.summary().startswith(f"{UNVERIFIED} (0 of {VERIFY_ROWS} verify rows compared")


class _Clock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _SlowAtTwoThreads(torch.nn.Module):
    """A linear during whose calls at two threads the clock jumps a minute."""

    def __init__(self, linear: torch.nn.Linear, clock: _Clock) -> None:
        super().__init__()
        self.linear = linear
        self.clock = clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.get_num_threads() == 2:
            self.clock.now += 60.0
        return self.linear(x)


def test_a_thread_count_the_budget_left_out_leaves_the_check_unverified(tokenizer, rowwise, one_thread):
    clock = _Clock()
    governor = ThreadGovernor(max_threads=3, follow_load=True)
    model = _with_head(rowwise, _SlowAtTwoThreads, clock)
    report = check_exactness(
        SpeculativeEngine(model, tokenizer), budget_s=30.0, governor=governor, clock=clock
    )
    assert (report.positions, report.split_compared) == (VERIFY_ROWS, True)
    assert (report.threads_compared, report.threads_skipped) == ((2,), (3,))
    assert report.label == UNVERIFIED and not governor.follow_load
    assert "3 threads not compared" in report.summary()
