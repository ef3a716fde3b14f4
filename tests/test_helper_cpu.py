"""The helper thread that shares one-thread linears (helper_cpu.c): same numbers, always."""

from __future__ import annotations

import copy
import gc
import multiprocessing
import threading
from collections.abc import Iterator

import pytest
import torch

from specdec_core.kernels.cpu import native
from specdec_core.kernels.cpu.int4_cpu import Int4Linear

pytestmark = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))


@pytest.fixture(params=[1, 2], ids=["one helper", "two helpers"])
def one_thread(request, monkeypatch) -> Iterator[None]:
    """One torch thread, sharing its ops with this many helper threads when sharing is on."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr(native, "HELPERS", request.param)
    yield
    torch.set_num_threads(threads)
    native.share_spare_core(False)


def _linear(out_features: int, in_features: int, bits: int, bias: bool = True, seed: int = 0) -> Int4Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    linear.weight.data *= 5
    return Int4Linear.from_linear(linear, bits)


def _alone_and_shared(linear: Int4Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    native.share_spare_core(False)
    alone = linear(x)
    native.share_spare_core(True)
    return alone, linear(x)


# (out, in): one block, a block and a part, more blocks than an op has chunks (64) and not a multiple of them
SHAPES = [(16, 64), (40, 96), (1100, 128), (3000, 64)]


@pytest.mark.parametrize("bits", [4, 6])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_linear_shared_with_the_helper_gives_bitwise_its_one_thread_numbers(one_thread, bits, shape) -> None:
    linear = _linear(*shape, bits=bits, bias=shape[0] != 40, seed=shape[0])
    for rows in (1, 2, 5, 8, 9, 19):
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
        for _ in range(5):
            alone, shared = _alone_and_shared(linear, x)
            assert torch.equal(alone, shared), (rows, shape, bits)


def test_the_caller_merges_the_helpers_chunks_and_redoes_those_it_did_not_finish(one_thread) -> None:
    """Both ways a helper's chunk reaches the output are taken, and neither changes a number."""
    linear = _linear(3000, 512, bits=4)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1))
    native.share_spare_core(False)
    alone = linear(x)
    native.share_spare_core(True)
    merged, redone = native.helper_counts()
    for _ in range(2000):  # the helper runs when the OS gives it a core: on a loaded machine later
        assert torch.equal(linear(x), alone)
        now = native.helper_counts()
        if now[0] > merged and now[1] > redone:
            break
    assert now[0] > merged and now[1] > redone, (merged, redone, now)


def test_two_callers_at_once_both_get_their_numbers(one_thread) -> None:
    """One shares with the helper, the other runs alone meanwhile (ctypes lets both run)."""
    linears = [_linear(1100, 256, bits=4, seed=seed) for seed in (1, 2)]
    inputs = [torch.randn(6, 256, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    expected = [linear(x) for linear, x in zip(linears, inputs, strict=True)]
    native.share_spare_core(True)
    failures: list[int] = []

    def call(i: int) -> None:
        torch.set_num_threads(1)  # torch keeps the count per thread
        for _ in range(200):
            if not torch.equal(linears[i](inputs[i]), expected[i]):
                failures.append(i)

    workers = [threading.Thread(target=call, args=(i,)) for i in (0, 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert failures == []


def _in_forked_child(queue: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    linear = _linear(1100, 256, bits=4)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(3))
    queue.put(linear(x).tolist())  # plain floats: a tensor would travel as a handle to the exited child


def test_a_forked_child_computes_without_the_parents_helper(one_thread) -> None:
    """fork copies only the calling thread: the child's linears run alone, and do not hang."""
    native.share_spare_core(True)
    _linear(1100, 256, bits=4)(torch.randn(6, 256))  # the parent's helper is running
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_in_forked_child, args=(queue,))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    native.share_spare_core(False)
    linear = _linear(1100, 256, bits=4)
    assert child.exitcode == 0
    assert torch.equal(torch.tensor(got), linear(torch.randn(6, 256, generator=torch.Generator().manual_seed(3))))


def test_a_freed_linear_or_its_copy_first_waits_for_the_helper(monkeypatch) -> None:
    """The helper may still read an op's weights after the op returned: freeing them waits."""
    settled: list[None] = []
    monkeypatch.setattr(native, "settle_helper", lambda: settled.append(None))
    linear = _linear(40, 64, bits=4)
    copied = copy.deepcopy(linear)
    del linear
    gc.collect()
    assert len(settled) == 1
    del copied
    gc.collect()
    assert len(settled) == 2


def test_converting_a_linear_first_waits_for_the_helper(monkeypatch) -> None:
    """`.to()` and the like replace the tensors an op read: the old ones are freed after a settle."""
    settled: list[None] = []
    monkeypatch.setattr(native, "settle_helper", lambda: settled.append(None))
    linear = _linear(40, 64, bits=4)
    linear.to(torch.float64)
    assert settled


def test_back_to_back_ops_never_take_a_late_helpers_numbers(one_thread) -> None:
    """A helper may finish a chunk of an op that has ended while the next ops run: it must
    never write where another helper stages a chunk of a later op, of another shape or of
    the same one on other inputs. Helpers are made late often, as a descheduled one is."""
    shapes = ((3584, 768), (768, 3584), (256, 768), (768, 768))
    linears = [_linear(n_out, k, bits=4, seed=n_out) for n_out, k in shapes]
    ops = [
        (linear, torch.randn(rows, linear.in_features))
        for rows, linear in zip((5, 3, 9, 5), linears, strict=True)
        for _ in range(2)
    ]
    native.share_spare_core(False)
    expected = [linear(x) for linear, x in ops]
    native.share_spare_core(True)
    native.library().helper_lag(7)
    try:
        wrong = sum(
            not torch.equal(linear(x), want)
            for _ in range(1000)
            for (linear, x), want in zip(ops, expected, strict=True)
        )
    finally:
        native.library().helper_lag(0)
    assert wrong == 0
