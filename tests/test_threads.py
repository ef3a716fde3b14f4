"""The thread governor: fewer threads when other processes take cores, back up with
hysteresis, a pinned count obeyed — and the thread count never changes int8 results."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
from tiny import tiny_model
from transformers import DynamicCache

from specdec_core.engine.events import ReadingEvent
from specdec_core.engine.selfcheck import check_exactness
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
from specdec_core.errors import SpecdecError
from specdec_core.kernels.batch_invariant import make_batch_invariant
from specdec_core.kernels.cpu import native, openmp, threads
from specdec_core.kernels.cpu.quant_cpu import int8_available, quantize_linears_int8
from specdec_core.kernels.cpu.threads import ThreadGovernor, default_governor, parse_threads_setting
from specdec_core.models.cpu_backend import prepare_for_cpu


class ScriptedLoad:
    """Foreign load to report, one value per check; counts how often it was asked."""

    def __init__(self, values: list[float]) -> None:
        self.values = list(values)
        self.calls = 0

    def others_busy(self) -> float:
        self.calls += 1
        return self.values.pop(0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    native.share_spare_core(False)  # a governor left at one thread has turned the helper on


def governor(values: list[float] | None = None, **kwargs: object) -> ThreadGovernor:
    return ThreadGovernor(max_threads=2, cores=2, probe=ScriptedLoad(values or []), **kwargs)  # type: ignore[arg-type]


def test_a_busy_core_drops_to_one_thread_at_once() -> None:
    g = governor()
    assert g.decide(0.05).threads == 2  # quiet: keep both cores
    assert g.decide(1.0).threads == 1  # `while True: pass` on one core
    assert g.decide(0.6).threads == 1  # still busy: stay down


def test_a_light_neighbour_drops_to_one_thread_too() -> None:
    """A loop busy 3 ms in 10 reads ~0.25: two threads would wait for it at every barrier."""
    g = governor()
    assert g.decide(0.25).threads == 1
    assert g.decide(0.25).threads == 1  # and stays down while it runs
    assert g.decide(0.25).threads == 1


def test_threads_come_back_only_after_two_quiet_checks() -> None:
    g = governor()
    g.decide(1.0)
    assert g.decide(0.05).threads == 1  # one lull is not enough
    assert g.decide(0.9).threads == 1
    assert g.decide(0.05).threads == 1
    assert g.decide(0.05).threads == 2


def test_never_below_one_or_above_the_maximum() -> None:
    g = ThreadGovernor(max_threads=4, cores=8, probe=ScriptedLoad([]))
    assert g.decide(7.9).threads == 1
    for _ in range(10):
        g.decide(0.0)
    assert g.threads == 4


def test_checks_the_load_only_when_due_and_applies_the_choice(restore_threads: None) -> None:
    clock = Clock()
    load = ScriptedLoad([1.0, 0.0, 0.0])
    g = ThreadGovernor(max_threads=2, cores=2, probe=load, clock=clock, interval_s=1.0)
    g.maybe_adjust()  # starts the measuring window
    clock.now = 0.1
    g.maybe_adjust()
    assert load.calls == 0
    clock.now = 0.3  # the first check comes early
    g.maybe_adjust()
    assert load.calls == 1 and torch.get_num_threads() == 1
    clock.now = 0.5
    g.maybe_adjust()
    assert load.calls == 1  # next check one interval later
    for now in (1.4, 2.5):  # two quiet checks: back to two threads
        clock.now = now
        g.maybe_adjust()
    assert load.calls == 3 and torch.get_num_threads() == 2


def test_after_an_idle_spell_the_first_check_counts_the_threads_running_now(restore_threads: None) -> None:
    """A neighbour that started a second before the next message is a sliver of a minute's window."""
    clock = Clock()
    load = ScriptedLoad([0.0, 0.02, 0.02])
    running = [0.0]
    g = ThreadGovernor(
        max_threads=2, cores=2, probe=load, clock=clock, interval_s=1.0, running_now=lambda: running[0]
    )
    g.maybe_adjust()  # the first call counts too: nobody else running
    assert g.threads == 2
    clock.now = 0.3
    g.maybe_adjust()  # a window check, not stale
    assert load.calls == 1 and g.threads == 2
    running[0] = 1.0  # the user reads for a minute; a busy loop starts just before the next message
    clock.now = 60.0
    g.maybe_adjust()
    assert g.threads == 1 and torch.get_num_threads() == 1
    assert load.calls == 2  # the window restarts all the same
    clock.now = 61.0
    g.maybe_adjust()  # due on time: the window's 0.02 again, and one quiet check does not add a thread
    assert load.calls == 3 and g.threads == 1


def test_a_check_on_time_reads_the_window_not_the_instant(restore_threads: None) -> None:
    clock = Clock()
    load = ScriptedLoad([0.0])
    running = [None]
    g = ThreadGovernor(
        max_threads=2, cores=2, probe=load, clock=clock, interval_s=1.0, running_now=lambda: running[0]
    )
    g.maybe_adjust()  # no instant count here (not Linux): the window decides
    running[0] = 2.0  # a blip at the instant of the check
    clock.now = 0.3
    g.maybe_adjust()
    assert g.threads == 2


def test_running_elsewhere_sees_a_busy_process(restore_threads: None) -> None:
    if threads.running_elsewhere() is None:
        pytest.skip("no /proc here")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        seen = []
        for _ in range(50):  # until the loop runs (its interpreter takes a moment to start)
            seen.append(threads.running_elsewhere())
            if seen[-1]:
                break
            time.sleep(0.05)
        assert seen[-1] is not None and seen[-1] >= 1.0
    finally:
        busy.kill()
        busy.wait()


def test_a_restarted_window_leaves_out_the_cpu_time_before_it(restore_threads: None) -> None:
    clock = Clock()
    load = ScriptedLoad([2.0, 0.0])  # 2.0: the bench's peer server answering while we waited
    g = ThreadGovernor(max_threads=2, cores=2, probe=load, clock=clock, interval_s=1.0)
    g.maybe_adjust()  # starts the measuring window
    g.restart_window()  # the peer's request ends here
    clock.now = 0.3
    g.maybe_adjust()  # the check sees only the time since the restart
    assert load.calls == 2 and g.threads == 2 and torch.get_num_threads() == 2


def test_a_pinned_count_is_applied_and_never_measured(restore_threads: None) -> None:
    load = ScriptedLoad([])
    g = ThreadGovernor(max_threads=2, cores=2, pinned=1, probe=load)
    for _ in range(3):
        g.maybe_adjust()
    assert torch.get_num_threads() == 1 and load.calls == 0
    with pytest.raises(SpecdecError):
        g.pin(0)


def test_the_helper_shares_while_load_not_the_user_took_threads_away(restore_threads, monkeypatch) -> None:
    told: list[bool] = []
    monkeypatch.setattr(threads.native, "share_spare_core", told.append)
    clock = Clock()
    g = ThreadGovernor(max_threads=2, cores=2, probe=ScriptedLoad([1.0, 0.0, 0.0]), clock=clock, interval_s=1.0)
    g.maybe_adjust()
    for now in (0.3, 1.4, 2.5):  # busy: one thread and the helper; then quiet twice: two threads again
        clock.now = now
        g.maybe_adjust()
    assert told == [False, True, False]
    pinned = ThreadGovernor(max_threads=2, cores=2, pinned=1, probe=ScriptedLoad([]))
    pinned.maybe_adjust()
    assert told[-1] is False and not pinned.shares_spare_core  # SPECDEC_THREADS=1 means one core


def test_threads_setting_parses_auto_and_counts() -> None:
    assert parse_threads_setting(None) is None
    assert parse_threads_setting("auto") is None
    assert parse_threads_setting("3") == 3
    with pytest.raises(SpecdecError, match="SPECDEC_THREADS"):
        parse_threads_setting("two")


def test_the_engine_applies_the_process_governor(target, tokenizer, restore_threads: None) -> None:
    governor = default_governor()
    assert governor is default_governor()  # one per process: torch's pool is per process
    saved = governor.pinned
    governor.pin(1)
    torch.set_num_threads(2)
    try:
        engine = SpeculativeEngine(target, tokenizer)
        for _ in engine.generate([1, 2, 3], GenerationParams(max_new_tokens=2)):
            pass
        assert torch.get_num_threads() == 1
    finally:
        governor.pin(saved)


@torch.inference_mode()
def _logits(model: torch.nn.Module, ids: torch.Tensor, threads: int) -> torch.Tensor:
    """A 28-token prefill then 4 one-token steps, at `threads` threads."""
    torch.set_num_threads(threads)
    cache = DynamicCache(config=model.config)
    parts = [model(ids[:, :28], cache=cache).logits[0]]
    parts += [model(ids[:, i : i + 1], cache=cache).logits[0] for i in range(28, 32)]
    return torch.cat(parts)


@pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm int8 kernels")
def test_int8_logits_are_bitwise_equal_at_one_and_two_threads(tokenizer, restore_threads: None) -> None:
    # Wide enough that the kernels split work between threads (fp32 at this size differs
    # in the last bits between 1 and 2 threads: its matmuls split the reduction).
    model = copy.deepcopy(tiny_model(len(tokenizer), seed=0, layers=2, hidden=512))
    quantize_linears_int8(model)
    make_batch_invariant(model)
    ids = torch.randint(0, len(tokenizer), (1, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(model, ids, 1), _logits(model, ids, 2))


def test_under_load_times_every_condition_and_restores_the_governor(target, tokenizer) -> None:
    from specdec_core.tools.bench import measure_under_load
    from specdec_core.tools.bench.render import under_load_markdown

    governor = default_governor()
    saved = governor.pinned
    runs = measure_under_load(SpeculativeEngine(target, tokenizer), [1, 2, 3], max_new_tokens=3)
    assert {(r.busy, r.governor) for r in runs} == {
        (busy, gov) for busy in (False, True) for gov in ("auto", f"pinned {governor.max_threads}")
    }
    assert all(r.tokens_per_s > 0 for r in runs)
    assert governor.pinned == saved
    assert "one busy process" in under_load_markdown(runs)


def test_preparing_the_process_sets_a_short_openmp_spin_before_torch_is_loaded() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = (
        "import os, sys, specdec_core; specdec_core.prepare_process(); "
        "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    # libgomp reads the variable once, when torch loads it: it must be set and torch not yet loaded.
    assert out.stdout.split() == [openmp.SPIN_COUNT, "False"]


def test_a_users_own_openmp_spin_or_wait_policy_is_kept() -> None:
    chosen = {"GOMP_SPINCOUNT": "0"}
    openmp.apply_defaults(chosen)
    assert chosen == {"GOMP_SPINCOUNT": "0"}
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}
    openmp.apply_defaults(passive)
    assert passive == {"OMP_WAIT_POLICY": "PASSIVE"}
    unset: dict[str, str] = {}
    openmp.apply_defaults(unset)
    assert unset == {"GOMP_SPINCOUNT": openmp.SPIN_COUNT}


def test_a_short_prompt_is_read_at_the_governors_count(target, tokenizer, restore_threads: None) -> None:
    """Load that came between two answers: the prompt's one forward already runs at the new count."""
    engine = SpeculativeEngine(target, tokenizer)
    governor = default_governor()
    saved = governor.pinned
    governor.pin(1)  # what the governor chooses when another process takes a core
    torch.set_num_threads(2)
    counts = []
    forward = engine.target.forward

    def counting(*args, **kwargs):
        counts.append(torch.get_num_threads())
        return forward(*args, **kwargs)

    engine.target.forward = counting
    try:
        for _ in engine.generate([3, 4, 5, 6, 7], GenerationParams(max_new_tokens=2)):
            pass
    finally:
        governor.pin(saved)
    assert counts[0] == 1  # the prompt's read


def test_a_long_prompt_follows_the_governor_between_its_chunks(target, tokenizer, restore_threads: None) -> None:
    model = copy.deepcopy(target)
    prepare_for_cpu(model, "fp32")  # row-wise, so the engine reads long prompts in chunks
    engine = SpeculativeEngine(model, tokenizer)
    engine.exactness = check_exactness(engine)
    engine.prefill_chunk = 4
    governor = default_governor()
    saved = governor.pinned
    governor.pin(1)  # what the governor chooses when another process takes a core
    torch.set_num_threads(2)
    try:
        threads_at_chunk = [
            torch.get_num_threads()
            for event in engine.generate(list(range(3, 20)), GenerationParams(max_new_tokens=2))
            if isinstance(event, ReadingEvent)
        ]
    finally:
        governor.pin(saved)
    assert len(threads_at_chunk) == 4 and threads_at_chunk[1:] == [1, 1, 1]  # applied before chunk 1
