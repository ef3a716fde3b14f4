"""The exactness self-check tells a batch-invariant forward from one that is not."""

from __future__ import annotations

import copy

import pytest
import torch

from specdec_core.batch_invariant import make_batch_invariant
from specdec_core.engine import SpeculativeEngine
from specdec_core.quant_cpu import int8_available, quantize_linears_int8
from specdec_core.selfcheck import BITWISE, NEAR_TIES, check_exactness
from specdec_core.threads import default_governor


class _RowCountBias(torch.nn.Module):
    """A linear whose output shifts with the number of tokens in the forward."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + 1e-3 * x.shape[-2]


def test_a_batch_dependent_forward_is_reported_with_its_logit_difference(tokenizer, target):
    model = copy.deepcopy(target)
    model.lm_head = _RowCountBias(model.lm_head)
    report = check_exactness(SpeculativeEngine(model, tokenizer))
    assert report.label == NEAR_TIES
    assert report.max_logit_diff == pytest.approx(7e-3, abs=2e-4)  # 8 rows vs 1, plus fp32 rounding noise
    assert "near-ties may differ" in report.summary()
    assert report.as_dict()["positions"] == report.positions >= 2


@pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm int8 kernels")
class _ThreeRowBias(torch.nn.Module):
    """A linear that is off only for 3-row inputs, as a GPU library may pick its kernel by row count."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + (1e-3 if x.shape[-2] == 3 else 0.0)


def test_a_forward_off_only_at_some_row_count_is_caught(tokenizer, target):
    model = copy.deepcopy(target)
    model.lm_head = _ThreeRowBias(model.lm_head)
    report = check_exactness(SpeculativeEngine(model, tokenizer))
    assert report.label == NEAR_TIES
    assert report.max_logit_diff == pytest.approx(1e-3, abs=2e-4)


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


def test_a_zero_budget_still_compares_two_positions(tokenizer, target):
    report = check_exactness(SpeculativeEngine(target, tokenizer), budget_s=0.0)
    assert report.positions == 2


class _ThreadCountBias(torch.nn.Module):
    """A linear whose output shifts with torch's thread count (as an fp32 matmul may, in its last bits)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + 1e-3 * torch.get_num_threads()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs two threads to compare with one")
def test_the_thread_governor_follows_the_load_only_where_thread_counts_do_not_change_results(
    tokenizer, target
):
    governor = default_governor()
    saved, pinned = governor.follow_load, governor.pinned
    threads = torch.get_num_threads()
    # Pinned for the test: following the machine's load, an earlier test's steps may have
    # left one thread, and at one thread there is nothing to compare with.
    governor.pin(max(2, threads))
    torch.set_num_threads(max(2, threads))
    try:
        report = check_exactness(SpeculativeEngine(target, tokenizer))
        assert report.bitwise == (report.thread_invariant and governor.follow_load)
        model = copy.deepcopy(target)
        model.lm_head = _ThreadCountBias(model.lm_head)
        report = check_exactness(SpeculativeEngine(model, tokenizer))
        assert not report.thread_invariant and not governor.follow_load
    finally:
        governor.follow_load = saved
        governor.pin(pinned)
        torch.set_num_threads(threads)
