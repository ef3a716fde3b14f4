"""The 4-bit weights in huge pages: the same bytes, so the same logits, in one 2 MB-aligned mapping."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import tiny_model

from specdec_core.kernels.cpu import huge_pages, native
from specdec_core.kernels.cpu.huge_pages import HUGE_PAGE, place_in_huge_pages
from specdec_core.kernels.cpu.int4_cpu import Int4Linear
from specdec_core.kernels.cpu.runner import CachedModel
from specdec_core.models import cpu_backend
from specdec_core.models.cpu_backend import prepare_for_cpu

needs_kernel = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))


def _int4_in_place(model, monkeypatch):
    """As loading makes it at int4, but with the weights left where quantizing put them."""
    with monkeypatch.context() as patch:
        patch.setattr(cpu_backend, "place_in_huge_pages", lambda modules: 0)
        prepare_for_cpu(model, "int4")
    return model


@needs_kernel
@pytest.mark.skipif(not huge_pages.available(), reason="this OS has no madvise(MADV_HUGEPAGE)")
def test_weights_moved_into_huge_pages_give_bitwise_the_same_logits(tokenizer, monkeypatch) -> None:
    base = tiny_model(len(tokenizer), hidden=64)
    plain = _int4_in_place(copy.deepcopy(base), monkeypatch)
    placed = copy.deepcopy(base)
    prepare_for_cpu(placed, "int4")  # the loader's way: placed before the one-call layers note addresses
    linears = [m for m in placed.modules() if isinstance(m, Int4Linear)]
    starts = sorted(m.packed.data_ptr() for m in linears)
    assert starts[0] % HUGE_PAGE == 0  # the mapping starts on a huge page
    assert starts[-1] - starts[0] < sum(m.packed.numel() for m in linears) + 4096 * len(linears)  # one mapping
    ids = torch.randint(0, len(tokenizer), (40,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = []
    for model in (plain, placed):
        runner = CachedModel(model)
        first = runner.forward(ids[:30], logits_to_keep=30)
        logits.append(torch.cat([first, runner.forward(ids[30:], logits_to_keep=10)]))
    assert torch.equal(logits[0], logits[1])


@needs_kernel
def test_nothing_moves_where_the_os_cannot_ask_for_huge_pages(tokenizer, monkeypatch) -> None:
    model = _int4_in_place(tiny_model(len(tokenizer), hidden=64), monkeypatch)
    before = {id(m): m.packed for m in model.modules() if isinstance(m, Int4Linear)}
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    assert place_in_huge_pages(model.modules()) == 0
    assert all(m.packed is before[id(m)] for m in model.modules() if isinstance(m, Int4Linear))


@needs_kernel
def test_a_mapping_that_cannot_be_made_leaves_the_weights_where_they_are(tokenizer, monkeypatch) -> None:
    model = _int4_in_place(tiny_model(len(tokenizer), hidden=64), monkeypatch)
    before = {id(m): m.packed for m in model.modules() if isinstance(m, Int4Linear)}

    def no_room(nbytes: int):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages, "buffer", no_room)
    assert place_in_huge_pages(model.modules()) == 0
    assert all(m.packed is before[id(m)] for m in model.modules() if isinstance(m, Int4Linear))


def test_modules_without_4_bit_weights_are_left_alone() -> None:
    linear = torch.nn.Linear(32, 16)
    assert place_in_huge_pages([linear, torch.nn.ReLU()]) == 0


@pytest.mark.skipif(huge_pages.granted_bytes() is None, reason="no /proc/self/smaps_rollup")
def test_granted_huge_pages_are_read_as_a_byte_count() -> None:
    assert huge_pages.granted_bytes() >= 0
