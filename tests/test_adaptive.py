"""The adaptive draft length follows measured costs and acceptance."""

from __future__ import annotations

import pytest
from tiny import tiny_model

from specdec_core.engine.adaptive import CARRY_WEIGHT, AcceptanceEstimate, CostModel, DraftLengthController
from specdec_core.engine.drafters import ModelDrafter
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
from specdec_core.engine.stats import theoretical_speedup

# A verify of m tokens ~ (1 + 0.12 (m - 1)) target steps of 0.1 s, as on this 2-core CPU.
CPU_VERIFY = {m: 0.10 * (1 + 0.12 * (m - 1)) for m in range(1, 10)}


def controller_with(verify: dict[int, float], draft_token: float, accepted_runs: list[tuple[int, int]]):
    c = DraftLengthController(max_k=8, costs=CostModel(verify=dict(verify), draft_token=draft_token))
    for proposed, accepted in accepted_runs:
        c.observe(proposed, accepted)
    return c


def test_cheap_verify_and_high_acceptance_draft_long():
    # GPU-like: verifying 9 tokens costs barely more than 1; draft is 5% of the target.
    c = controller_with({1: 0.020, 9: 0.021}, 0.001, [(8, 8)] * 30)
    assert c.choose_k(drafter_is_model=True) >= 6


def test_verify_cost_growing_per_token_turns_speculation_off():
    # Each extra verified token costs a full step: speculation cannot pay.
    c = controller_with({1: 0.1, 2: 0.2, 5: 0.5}, 0.03, [(4, 4)] * 30)
    assert c.choose_k(drafter_is_model=True) == 0


def test_low_acceptance_turns_speculation_off():
    c = controller_with({1: 0.10, 5: 0.13}, 0.03, [(4, 0)] * 30)
    assert c.choose_k(drafter_is_model=True) == 0


def test_expensive_draft_turns_speculation_off():
    c = controller_with({1: 0.10, 5: 0.11}, 0.12, [(4, 2)] * 30)
    assert c.choose_k(drafter_is_model=True) == 0


def test_cpu_like_costs_pick_a_moderate_k():
    # Shaped after this 2-core CPU: a verify of m tokens costs ~ (1 + 0.12 (m-1)) steps.
    verify = {m: 0.25 * (1 + 0.12 * (m - 1)) for m in (1, 2, 4, 8)}
    c = controller_with(verify, 0.06, [(4, 3), (4, 4), (4, 2), (4, 4)] * 10)
    assert 2 <= c.choose_k(drafter_is_model=True) <= 6


def test_plain_steps_are_interrupted_by_periodic_probes():
    c = controller_with({1: 0.1, 2: 0.2}, 0.05, [(2, 0)] * 20)
    c.probe_every = 5
    choices = [c.choose_k(drafter_is_model=True) for _ in range(10)]
    assert choices.count(0) == 8
    assert choices[4] > 0 and choices[9] > 0


def test_a_plain_verdict_on_few_verdicts_is_probed_again_soon():
    # One rejection at an answer's first draft priced a good draft below a plain step;
    # the next probe must not wait the full interval (16 plain tokens).
    verify = {m: 0.04 * (1 + 0.05 * (m - 1)) for m in range(1, 10)}
    thin = controller_with(verify, 0.014, [(1, 0)])
    first = [thin.choose_k(drafter_is_model=True) for _ in range(4)]
    assert first[0] == 0 and any(k > 0 for k in first)
    solid = controller_with(verify, 0.014, [(1, 0)] * 30)
    assert [solid.choose_k(drafter_is_model=True) for _ in range(8)] == [0] * 8


def test_probes_wait_the_full_interval_where_even_a_perfect_draft_cannot_pay():
    c = controller_with({1: 0.1, 2: 0.2, 9: 0.9}, 0.05, [(1, 0)])
    c.probe_every = 6
    choices = [c.choose_k(drafter_is_model=True) for _ in range(6)]
    assert choices == [0] * 5 + [choices[5]] and choices[5] > 0


def test_pinned_k_is_obeyed():
    c = controller_with({1: 0.1, 2: 0.2}, 0.05, [(2, 0)] * 20)
    c.pinned = 5
    assert c.choose_k(drafter_is_model=True) == 5


def test_cost_model_uses_measurements_and_fits_the_rest():
    costs = CostModel(verify={1: 1.0, 3: 2.0})
    assert costs.verify_seconds(1) == 1.0
    assert abs(costs.verify_seconds(5) - 3.0) < 1e-9  # the line through (1, 1) and (3, 2)
    assert CostModel().verify_seconds(1) is None


def test_acceptance_estimate_is_per_position():
    est = AcceptanceEstimate(max_k=4, prior_weight=0.5)
    for _ in range(50):
        est.observe(proposed=4, accepted=1)  # position 1 always accepted, position 2 never
    assert est.rate(0) > 0.9
    assert est.rate(1) < 0.2
    assert 1.9 < est.expected_tokens(1) < 2.0


def test_theoretical_speedup_formula():
    assert theoretical_speedup(0.0, 4, 0.1) == 1 / 1.4
    assert abs(theoretical_speedup(0.8, 4, 0.0) - (1 - 0.8**5) / 0.2) < 1e-12
    assert theoretical_speedup(1.0, 3, 0.0) == 4.0
    assert theoretical_speedup(0.5, 0, 0.5) == 1.0


def test_unpredictable_draft_is_switched_off_in_a_real_run(tokenizer, target):
    # A random draft as costly as the target: the engine must mostly run plain steps.
    engine = SpeculativeEngine(target, tokenizer, ModelDrafter(tiny_model(len(tokenizer), seed=9), "random"))
    engine.calibrate()
    prompt = tokenizer("def add(a, b):")["input_ids"]
    done = list(engine.generate(prompt, GenerationParams(max_new_tokens=60)))[-1]
    assert done.stats.k_histogram.get(0, 0) >= 0.7 * done.stats.steps


def test_calibration_measures_target_and_draft_costs(tokenizer, target):
    engine = SpeculativeEngine(target, tokenizer, ModelDrafter(tiny_model(len(tokenizer), seed=1), "d"))
    costs = engine.calibrate(sizes=(1, 4))
    assert set(costs.verify) == {1, 4}
    assert costs.draft_token is not None and costs.draft_token > 0
    assert engine.target.ids == []  # calibration leaves no context behind


def test_a_drafts_first_forward_is_kept_apart_from_the_one_token_cost():
    # The first forward also reads the tokens the draft has not seen; counted as one
    # forward's cost it would make every further draft token look dearer.
    costs = CostModel()
    assert costs.first_forward_extra() == 0.0
    costs.observe_draft_first(60, 2.0)  # the prompt, read at the model's first draft
    assert costs.draft_first is None  # a debt paid once, not what a draft step costs
    for _ in range(3):
        costs.observe_draft_first(2, 0.07)
        costs.observe_draft(3, 0.15)
    assert costs.draft_token == pytest.approx(0.05)
    assert costs.first_forward_extra() == pytest.approx(0.02)
    costs.observe_draft_first(17, 0.5)  # the catch-up after 16 plain steps
    assert costs.first_forward_extra() == pytest.approx(0.02)
    costs.forget_draft()
    assert costs.draft_token is None and costs.draft_first is None


def test_one_stalled_forward_does_not_move_the_cost():
    # On a shared machine a forward now and then takes 10x: the median ignores it,
    # so the controller does not avoid a draft length for the rest of the run.
    costs = CostModel()
    for seconds in (0.10, 0.10, 1.50, 0.11):
        costs.observe_verify(4, seconds)
        costs.observe_draft(1, seconds / 2)
    assert costs.verify[4] < 0.12
    assert costs.draft_token is not None and costs.draft_token < 0.06
    for _ in range(4):  # a lasting change (a longer context) is followed within a few steps
        costs.observe_verify(4, 0.2)
    assert costs.verify[4] == 0.2


def test_a_machine_that_sped_up_during_plain_steps_makes_drafting_look_as_cheap_as_it_is():
    # The draft and the 2-token verify were timed in a slow moment; plain steps re-time only
    # the 1-token verify. Each cost kept apart, drafting one token looked worse than a plain
    # step (1.6 tokens in 0.173 s vs 1 in 0.100 s) although the whole machine had sped up.
    costs = CostModel(verify={1: 0.115, 2: 0.130}, draft_token=0.043)
    controller = DraftLengthController(max_k=8, costs=costs)
    for _ in range(6):
        costs.observe_verify(1, 0.100)
    speedup = 0.100 / 0.115
    assert costs.verify_seconds(2) == pytest.approx(0.130 * speedup)
    assert costs.draft_token == pytest.approx(0.043 * speedup)
    draft_cost = costs.draft_token
    assert controller.expected_rate(1, draft_cost) > controller.expected_rate(0, draft_cost)


def test_a_kind_that_got_dearer_on_its_own_keeps_its_new_cost():
    # A longer context makes the 4-token verify dearer while 1-token steps stay as they were:
    # the common scale must not spread that to the other kinds, nor hide it.
    costs = CostModel(verify={1: 0.10, 4: 0.15})
    for _ in range(6):
        costs.observe_verify(1, 0.10)
        costs.observe_verify(4, 0.20)
    assert costs.verify_seconds(4) == pytest.approx(0.20, rel=0.05)
    assert costs.verify_seconds(1) == pytest.approx(0.10, rel=0.05)


def test_a_size_timed_earlier_never_looks_cheaper_than_a_smaller_one():
    # 1-token steps slowed by load just now; 2-token verify last timed when calm.
    costs = CostModel(verify={1: 0.30, 2: 0.12})
    assert costs.verify_seconds(2) == 0.30


def calibrated_costs() -> CostModel:
    """What `engine.calibrate()` leaves: 1, 2, 4 and 8 tokens timed three times each."""
    costs = CostModel()
    for _ in range(3):
        for m in (1, 2, 4, 8):
            costs.observe_verify(m, CPU_VERIFY[m])
    return costs


def test_a_size_timed_once_in_a_stall_does_not_make_longer_verifies_look_dearer() -> None:
    # The calibration times 1, 2, 4 and 8 tokens; 3 is first timed while drafting, and
    # that first timing can be a stall. Taken alone it made every size from 3 up cost 3x.
    costs = calibrated_costs()
    costs.observe_verify(3, 3 * CPU_VERIFY[3])
    for m in range(1, 10):
        assert costs.verify_seconds(m) == pytest.approx(CPU_VERIFY[m], rel=0.02)
    for _ in range(2):  # its own timings count once there are enough to outvote the stall
        costs.observe_verify(3, 1.2 * CPU_VERIFY[3])
    assert costs.verify_seconds(3) == pytest.approx(1.2 * CPU_VERIFY[3])


def test_one_more_verified_token_is_priced_by_the_line_not_by_a_bump_between_two_sizes() -> None:
    # Each size's median carries its own noise; the 3-token one sits 40% above its line.
    # Priced as the step from 2 to 3 tokens, a second draft token would cost 4x what it does.
    costs = calibrated_costs()
    for _ in range(3):
        costs.observe_verify(3, 1.4 * CPU_VERIFY[3])
    assert costs.verify_seconds(3) - costs.verify_seconds(2) > 0.04
    assert costs.verify_slope() == pytest.approx(0.012, abs=0.004)


def test_acceptance_carried_to_a_new_answer_yields_to_a_few_new_verdicts() -> None:
    prose = AcceptanceEstimate(4)
    for _ in range(60):  # a long answer the draft rarely got right
        prose.observe(4, 0)
    carried = prose.softened()
    assert sum(carried.trials) <= CARRY_WEIGHT + 1e-9
    assert carried.rate(0) == pytest.approx(prose.rate(0), abs=0.15)  # still the first guess
    for _ in range(6):  # the new answer drafts well from the start
        carried.observe(4, 4)
        prose.observe(4, 4)
    assert carried.rate(0) > 0.6
    assert prose.rate(0) < 0.4  # carried whole, the old answer would still outvote them
    assert sum(prose.trials) > 10  # the original is left as it was


def test_one_rejection_at_the_second_position_does_not_keep_drafts_at_one_token() -> None:
    costs = CostModel(verify=dict(CPU_VERIFY), draft_token=0.045)
    before = DraftLengthController(max_k=8, costs=costs)
    for _ in range(30):
        before.observe(4, 4)
    controller = DraftLengthController(max_k=8, costs=costs)
    controller.carry_from(before)
    controller.observe(4, 1)  # position 2 rejected: its rate now rests on this verdict
    lengths = []
    for _ in range(8):
        k = controller.choose_k(drafter_is_model=True)
        lengths.append(k)
        controller.observe(k, k)  # all accepted
    assert lengths[0] == 1 and max(lengths) >= 3


def test_a_well_tested_short_draft_is_not_stretched() -> None:
    # Position 2 is rejected often and recently: k = 1 is right and stays as planned.
    controller = controller_with(CPU_VERIFY, 0.045, [(2, 1)] * 30)
    assert [controller.choose_k(drafter_is_model=True) for _ in range(8)] == [1] * 8
