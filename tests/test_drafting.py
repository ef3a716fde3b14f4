"""Drafting strategies and the source policy: decisions from scripted costs, output unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sampling_exactness import SAMPLES, VOCAB, chi_square_pvalue, tiny_vocab_tokenizer
from tiny import hf_greedy, perturbed, tiny_model

from specdec_core.engine.adaptive import ConfidenceCalibration, CostModel, DraftLengthController
from specdec_core.engine.drafters import (
    DraftPlan,
    DraftSource,
    LookupThenModelDrafter,
    ModelDrafter,
    NgramDrafter,
    NoDrafter,
    one_hot_rows,
)
from specdec_core.engine.events import DoneEvent, StepEvent, TokenEvent
from specdec_core.engine.policy import PLAIN, Choice, SourcePolicy
from specdec_core.engine.selfcheck import BITWISE, ExactnessReport
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
from specdec_core.engine.stats import GenerationStats, speedup_bound, theoretical_speedup

# Shaped after this 2-core CPU: a verify of m tokens ~ (1 + 0.12 (m - 1)) target steps,
# a draft forward half a target step (docs/performance.md).
CPU_VERIFY = {m: 0.10 * (1 + 0.12 * (m - 1)) for m in range(1, 10)}


def policy_with(model_runs=(), lookup_runs=(), match_n=3, verify=None) -> SourcePolicy:
    policy = SourcePolicy(CostModel(verify=dict(verify or CPU_VERIFY)), max_k=8)
    for proposed, accepted in model_runs:
        policy.model.observe(proposed, accepted)
    for proposed, accepted in lookup_runs:
        policy.lookup(match_n).observe(proposed, accepted)
    return policy


def test_excellent_draft_model_beats_mediocre_lookup():
    # The finding this policy fixes: lookup tried first pulled acceptance to 0.33.
    policy = policy_with(model_runs=[(6, 6)] * 30, lookup_runs=[(3, 0), (3, 0), (3, 3)] * 10)
    choice = policy.choose(budget=8, match_n=3, found=8, t_draft=0.05)
    assert choice.model_tokens > 0 and choice.lookup_tokens == 0


def test_good_lookup_beats_costly_model():
    policy = policy_with(model_runs=[(4, 2)] * 30, lookup_runs=[(6, 6)] * 30)
    choice = policy.choose(budget=8, match_n=3, found=6, t_draft=0.05)
    assert choice == Choice(lookup_tokens=6, model_tokens=0)


def test_short_lookup_run_is_extended_by_a_good_model():
    policy = policy_with(model_runs=[(6, 6)] * 30, lookup_runs=[(2, 2)] * 30)
    choice = policy.choose(budget=8, match_n=3, found=2, t_draft=0.02)
    assert choice.lookup_tokens == 2 and choice.model_tokens > 0


def test_a_costly_first_draft_forward_tips_a_close_step_to_lookup():
    # Both sources draft well; what decides is that the model's first forward costs as
    # much as a verify (it reads the tokens it has not seen yet), and copying costs nothing.
    policy = policy_with(model_runs=[(4, 4)] * 30, lookup_runs=[(4, 2), (4, 1)] * 15)
    assert policy.choose(budget=4, match_n=3, found=4, t_draft=0.02).model_tokens > 0
    for _ in range(3):
        policy.costs.observe_draft(3, 0.06)
        policy.costs.observe_draft_first(2, 0.12)
    choice = policy.choose(budget=4, match_n=3, found=4, t_draft=0.02)
    assert choice.lookup_tokens > 0 and choice.model_tokens == 0


def test_where_the_text_matches_again_after_a_model_token_copies_replace_its_remaining_forwards():
    # Measured on a summary: the model drafted 7 tokens through each paraphrase (~400 ms)
    # while the text copied the prompt again right after the first of them.
    policy = policy_with(model_runs=[(7, 7)] * 30, lookup_runs=[(7, 7)] * 30)
    step = Choice(0, 7)
    assert policy.resume_copies(step, 0, drafted=1, resume_n=3, found=7, budget=8, t_draft=0.05) == 7
    assert policy.resume_copies(step, 0, drafted=1, resume_n=3, found=3, budget=8, t_draft=0.05) == 3


def test_copies_that_keep_failing_do_not_take_over_from_a_good_model():
    policy = policy_with(model_runs=[(7, 7)] * 30, lookup_runs=[(7, 0)] * 30)
    step = Choice(0, 7)
    assert policy.resume_copies(step, 0, drafted=1, resume_n=3, found=7, budget=8, t_draft=0.05) == 0
    assert policy.resume_copies(step, 0, drafted=1, resume_n=0, found=0, budget=8, t_draft=0.05) == 0
    pinned = SourcePolicy(CostModel(verify=dict(CPU_VERIFY)), max_k=8, pinned=5)
    assert pinned.resume_copies(Choice(0, 5), 0, drafted=1, resume_n=3, found=7, budget=8, t_draft=0.05) == 0


def test_copies_after_model_tokens_are_scored_as_copies_of_their_own_match():
    policy = policy_with()
    # 2 model tokens, then 4 copies from a 3-token match; rejected at the second copy.
    policy.observe(Choice(0, 4), 0, proposed_model=2, accepted=3, resume_n=3, resumed=4)
    assert policy.model.hits[:2] == [1.0, 1.0] and policy.model.trials[2] == 0.0
    assert policy.lookup(3).trials[:3] == [1.0, 1.0, 0.0]
    assert policy.lookup(3).hits[:2] == [1.0, 0.0]


def test_a_match_past_draft_tokens_copies_committed_text_and_indexes_nothing_new():
    lookup = NgramDrafter(max_ngram=4, min_ngram=2)
    committed = [5, 6, 7, 8, 0, 5]
    assert lookup.match_after(committed, [6, 7], 3) == ([8, 0, 5], 3)
    assert lookup.match_after(committed, [9], 3) == ([], 0)
    index = dict(lookup._last_end)
    lookup.match(committed, 3)
    assert lookup._last_end == index and lookup._tokens == committed


def test_copies_that_keep_being_accepted_run_past_the_model_draft_length():
    policy = SourcePolicy(CostModel(verify=dict(CPU_VERIFY)), max_k=8, max_copy=15)
    for _ in range(6):
        policy.lookup(16).observe(15, 15)
        policy.model.observe(8, 8)
    assert policy.choose(15, 16, 15, t_draft=0.05).lookup_tokens > 8
    assert policy.choose(15, 16, 0, t_draft=0.05).model_tokens <= 8  # no copies: the model's limit
    assert all(c.model_tokens <= 8 for _, c in policy.options(15, 16, 3, t_draft=0.05))


def test_lookup_acceptance_is_kept_per_match_length():
    policy = policy_with(model_runs=[(4, 1)] * 30, lookup_runs=[(4, 4)] * 30, match_n=4)
    for _ in range(30):
        policy.lookup(2).observe(4, 0)
    assert policy.choose(budget=8, match_n=4, found=4, t_draft=0.05).lookup_tokens == 4
    assert policy.choose(budget=8, match_n=2, found=4, t_draft=0.05).lookup_tokens == 0


def test_a_match_length_not_seen_yet_starts_from_how_copies_have_done_so_far():
    # Traced on a word problem: each new match length was drafted at the fixed prior and
    # rejected at once, while the model drafted at 0.9 or more.
    policy = policy_with(model_runs=[(4, 4), (4, 3)] * 15, lookup_runs=[(3, 0)] * 12, match_n=2)
    assert policy.lookup(5).rate(0) < 0.2
    assert policy.choose(budget=8, match_n=5, found=4, t_draft=0.03).lookup_tokens == 0
    fresh = policy_with(model_runs=[(4, 4), (4, 3)] * 15)  # nothing known of copies: the fixed prior
    assert fresh.lookup(5).rate(0) == pytest.approx(0.6)
    good = policy_with(lookup_runs=[(4, 4)] * 12, match_n=2)
    assert good.lookup(5).rate(0) > 0.8


def test_nothing_pays_means_a_plain_step_then_a_probe():
    policy = policy_with(model_runs=[(4, 0)] * 30, lookup_runs=[(4, 0)] * 30)
    policy.prober.every = 4
    choices = [policy.choose(budget=8, match_n=3, found=4, t_draft=0.05) for _ in range(4)]
    assert choices[:3] == [PLAIN] * 3
    assert choices[3].probe and choices[3].total > 0


def test_pinned_k_copies_what_lookup_found_and_the_model_fills_the_rest():
    policy = SourcePolicy(CostModel(verify=dict(CPU_VERIFY)), max_k=8, pinned=5)
    assert policy.choose(budget=8, match_n=2, found=3, t_draft=0.05) == Choice(3, 2)
    assert policy.choose(budget=8, match_n=0, found=0, t_draft=0.05) == Choice(0, 5)
    assert policy.choose(budget=2, match_n=2, found=3, t_draft=0.05) == Choice(2, 0)


def test_unused_lookup_is_scored_against_the_committed_tokens():
    policy = policy_with()
    policy.observe_unused_lookup(3, copies=[5, 6, 7], committed=[5, 9])  # rejected at 2
    policy.observe_unused_lookup(3, copies=[5, 6, 7], committed=[5, 6])  # accepted as far as known
    est = policy.lookup(3)
    assert est.trials[:3] == pytest.approx([0.97 + 1, 0.97 + 1, 0.0])
    assert est.hits[:2] == pytest.approx([0.97 + 1, 1.0])


def test_after_a_bad_stretch_a_good_draft_resumes_within_a_few_plain_steps():
    c = DraftLengthController(max_k=8, costs=CostModel(verify=dict(CPU_VERIFY), draft_token=0.03))
    for _ in range(200):  # a long stretch the draft could not predict
        k = c.choose_k(drafter_is_model=True)
        c.observe(k, 0)
    choices = []
    for _ in range(100):  # the draft is now perfect
        k = c.choose_k(drafter_is_model=True)
        c.observe(k, k)
        choices.append(k)
    last_plain = max(i for i, k in enumerate(choices) if k == 0)
    # At most one probe interval of plain steps, then it speculates every step
    # (was ~180 when acceptance only moved on probes and never decayed).
    assert choices.count(0) == last_plain + 1 <= c.probe_every


def test_a_perfect_draft_too_costly_to_pay_is_not_probed_every_step():
    # Always accepted, but a draft forward costs 1.5 target steps: quick re-probes would lose.
    c = DraftLengthController(max_k=8, costs=CostModel(verify=dict(CPU_VERIFY), draft_token=0.15))
    choices = []
    for _ in range(64):
        k = c.choose_k(drafter_is_model=True)
        c.observe(k, k)
        choices.append(k)
    assert choices.count(0) >= 56


@pytest.mark.parametrize("pinned", [None, 3])
def test_max_draft_length_zero_means_plain_steps(tokenizer, target, pinned):
    c = DraftLengthController(max_k=0, pinned=pinned, costs=CostModel(verify={1: 0.1}))
    assert [c.choose_k(drafter_is_model=True) for _ in range(40)] == [0] * 40
    drafter = LookupThenModelDrafter(ModelDrafter(tiny_model(len(tokenizer), seed=0), "same"))
    engine = SpeculativeEngine(target, tokenizer, drafter)
    engine.costs.observe_verify(1, 0.1)
    prompt = tokenizer("def add(a, b):")["input_ids"]
    params = GenerationParams(max_new_tokens=6, max_draft_length=0, draft_length=pinned)
    done = list(engine.generate(prompt, params))[-1]
    assert list(done.token_ids) == hf_greedy(target, prompt, 6)
    assert done.stats.proposed == 0


def test_bound_uses_per_position_acceptance_not_accepted_over_proposed():
    # Each step drafts 4; position acceptance 0.75: accepted/proposed counts unchecked positions.
    stats = GenerationStats(
        drafter="d",
        prompt_tokens=1,
        new_tokens=10,
        stop_reason="max_tokens",
        steps=10,
        proposed=40,
        accepted=20,
        per_position_acceptance=(0.75, 0.75, 0.75, 0.75),
        k_histogram={4: 10},
        target_token_seconds=1.0,
        draft_token_seconds=0.1,
    )
    c = stats.cost_ratio
    assert stats.theoretical_speedup == pytest.approx(theoretical_speedup(0.75, 4, c))
    assert stats.theoretical_speedup > theoretical_speedup(stats.acceptance_rate, 4, c)
    assert speedup_bound((), {0: 5}, 0.5) == 1.0


def test_copied_tokens_have_one_hot_draft_distributions():
    rows = one_hot_rows([2, 0], 4)
    assert rows.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]


# -- the engine with the policy: the output never changes ---------------------------------


class FrozenCosts(CostModel):
    """Scripted costs that real timings do not overwrite (decisions without timing)."""

    def observe_verify(self, m: int, seconds: float) -> None:
        pass

    def observe_draft(self, forwards: int, seconds: float) -> None:
        pass


class SourceSpy:
    """Wraps a strategy and records the source of every draft it made."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.sources: list[DraftSource] = []

    def draft(self, *args):
        draft = self.inner.draft(*args)
        self.sources.append(draft.source)
        return draft

    def __getattr__(self, name):
        return getattr(self.inner, name)


REPETITIVE = "for i in range(10):\n    print(i * i)\nfor i in range(10):\n    print(i * i)\nfor i in"


@pytest.mark.parametrize(
    "draft, draft_cost",
    [("same", 0.001), ("perturbed", 0.001), ("same", 0.2)],  # free or twice a target step
)
def test_policy_never_changes_greedy_output(tokenizer, target, draft, draft_cost):
    model = tiny_model(len(tokenizer), seed=0) if draft == "same" else perturbed(target, 0.05)
    spy = SourceSpy(LookupThenModelDrafter(ModelDrafter(model, "d")))
    engine = SpeculativeEngine(target, tokenizer, spy)
    engine.costs = FrozenCosts(verify=dict(CPU_VERIFY), draft_token=draft_cost)
    prompt = tokenizer(REPETITIVE)["input_ids"]
    done = list(engine.generate(prompt, GenerationParams(max_new_tokens=40)))[-1]
    assert list(done.token_ids) == hf_greedy(target, prompt, 40)
    assert set(spy.sources) - {DraftSource.NONE}  # it drafted something


def test_with_an_excellent_draft_the_policy_keeps_the_model_acceptance(tokenizer, target):
    # The finding: lookup drafts tried first pulled acceptance down to 0.33 with a draft
    # identical to the target, and lost to the model alone.
    prompt = tokenizer(REPETITIVE)["input_ids"]
    stats = {}
    for name in ("model", "policy"):
        model = ModelDrafter(tiny_model(len(tokenizer), seed=0), "same")
        engine = SpeculativeEngine(
            target, tokenizer, model if name == "model" else LookupThenModelDrafter(model)
        )
        engine.costs = FrozenCosts(verify=dict(CPU_VERIFY), draft_token=0.02)
        stats[name] = list(engine.generate(prompt, GenerationParams(max_new_tokens=80)))[-1].stats
    assert stats["policy"].acceptance_rate >= 0.9
    assert stats["policy"].mean_accepted_length >= 0.9 * stats["model"].mean_accepted_length


@pytest.mark.parametrize("strategy", ["model", "policy"])
def test_the_next_message_starts_from_the_acceptance_learned_so_far(tokenizer, target, strategy):
    model = ModelDrafter(tiny_model(len(tokenizer), seed=7), "random")
    engine = SpeculativeEngine(
        target, tokenizer, model if strategy == "model" else LookupThenModelDrafter(model)
    )
    engine.costs = FrozenCosts(verify=dict(CPU_VERIFY), draft_token=0.02)
    prompt = tokenizer("def add(a, b):")["input_ids"]
    # Long enough for the failures to weigh as the most a new message carries: on fewer
    # verdicts a probe comes sooner (`adaptive.Prober`).
    list(engine.generate(prompt, GenerationParams(max_new_tokens=64)))
    steps = [
        e for e in engine.generate(prompt, GenerationParams(max_new_tokens=8)) if isinstance(e, StepEvent)
    ]
    assert [s.proposed for s in steps] == [0] * len(steps)  # no fresh try of a draft known to fail


def test_model_draft_times_its_first_forward_apart(tokenizer, target):
    drafter = ModelDrafter(tiny_model(len(tokenizer), seed=1), "d")
    costs = CostModel(verify=dict(CPU_VERIFY))
    drafter.start(DraftPlan(costs=costs, pinned=3))
    prompt = tokenizer("def add(a, b):")["input_ids"]
    sampling = GenerationParams().sampling
    draft = drafter.propose(prompt, 3, sampling, None)
    drafter.observe(draft, 3, [], True)
    # The first forward read the whole prompt (not booked); the two after it one token each.
    assert costs.draft_first is None and costs.draft_token is not None
    bonus = 7  # all three accepted, then the target's token: the next draft reads two tokens
    drafter.observe(drafter.propose([*prompt, *draft.tokens, bonus], 3, sampling, None), 0, [], True)
    assert costs.draft_first is not None


def test_model_draft_stops_early_when_confidence_is_too_low_to_pay(tokenizer, target):
    drafter = ModelDrafter(perturbed(target, 0.3), "p")
    # A draft forward as costly as a target step: only near-certain tokens pay.
    drafter.start(DraftPlan(costs=CostModel(verify=dict(CPU_VERIFY), draft_token=0.09)))
    prompt = tokenizer("def add(a, b):")["input_ids"]
    sampling = GenerationParams().sampling
    short = drafter.propose(prompt, 8, sampling, None)
    drafter.early_stop = False
    full = drafter.propose(prompt, 8, sampling, None)
    assert len(full.tokens) == 8
    assert 1 <= len(short.tokens) < 8
    assert short.tokens == full.tokens[: len(short.tokens)]


def test_one_stalled_verify_timing_does_not_cut_every_draft_to_one_token(tokenizer, target):
    # The early stop weighs a second token against the verify's extra position. If that
    # cost rests on one stalled timing, every draft stops after one token and the size
    # that would re-time it is never verified again.
    drafter = ModelDrafter(target, "same")
    for b in range(ConfidenceCalibration.BINS):  # a draft that is always right, and knows it
        for _ in range(20):
            drafter.calibration.observe((b + 0.5) / ConfidenceCalibration.BINS, True)
    costs = CostModel()
    for _ in range(3):  # what the calibration times
        for m in (1, 2, 4, 8):
            costs.observe_verify(m, CPU_VERIFY[m])
        costs.observe_draft(1, 0.02)
    costs.observe_verify(3, 3 * CPU_VERIFY[3])  # the first 3-token verify, in a stall
    drafter.start(DraftPlan(costs=costs))
    prompt = tokenizer("def add(a, b):")["input_ids"]
    assert len(drafter.propose(prompt, 8, GenerationParams().sampling, None).tokens) == 8


def test_stop_token_is_flagged_counted_and_kept_out_of_the_text(tokenizer, target):
    prompt = tokenizer("def add(a, b):")["input_ids"]
    free_run = hf_greedy(target, prompt, 12)
    stop = free_run[5]
    engine = SpeculativeEngine(target, tokenizer, NgramDrafter(), stop_token_ids=[stop])
    events = list(engine.generate(prompt, GenerationParams(max_new_tokens=12)))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    done = events[-1]
    assert isinstance(done, DoneEvent)
    assert tokens[-1].is_stop and tokens[-1].text == "" and not any(t.is_stop for t in tokens[:-1])
    assert done.token_ids[-1] == stop
    expected = tokenizer.decode(list(done.token_ids[:-1]), clean_up_tokenization_spaces=False)
    assert done.text == expected
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert steps[-1].mean_accepted_length == pytest.approx(len(done.token_ids) / len(steps))
    assert steps[-1].exactness == done.stats.exactness == "unchecked"


def test_stats_carry_the_engine_exactness_label(tokenizer, target):
    engine = SpeculativeEngine(target, tokenizer, NoDrafter())
    engine.exactness = ExactnessReport(label=BITWISE, max_logit_diff=0.0, positions=8, seconds=0.0)
    done = list(engine.generate(tokenizer("def")["input_ids"], GenerationParams(max_new_tokens=2)))[-1]
    assert done.stats.exactness == "bitwise" and done.stats.max_logit_diff == 0.0
    assert done.stats.as_dict()["exactness"] == "bitwise"


def test_calibration_times_the_runners_the_draftingnames(tokenizer, target):
    for strategy, timed in ((NgramDrafter(), False), (ModelDrafter(tiny_model(len(tokenizer)), "d"), True)):
        engine = SpeculativeEngine(target, tokenizer, strategy)
        costs = engine.calibrate(sizes=(1,), repeats=1)
        assert (costs.draft_token is not None) == timed
    assert torch.is_tensor(one_hot_rows([], 3))


def two_token_samples(**params) -> tuple[list[DraftSource], list[int], np.ndarray]:
    """The policy's drafts on a 12-token vocabulary after "3 1 1 1": the sources drafted,
    the first two sampled tokens of each seeded run (as x1 * V + x2), and their joint
    probability under the target alone."""
    target = tiny_model(VOCAB, seed=3, layers=1, hidden=32)
    spy = SourceSpy(LookupThenModelDrafter(ModelDrafter(perturbed(target, 0.5, seed=4), "p")))
    engine = SpeculativeEngine(target, tiny_vocab_tokenizer(), spy)
    prompt = [3, 1, 1, 1]
    generation = GenerationParams(max_new_tokens=3, temperature=1.0, **params)
    with torch.no_grad():
        p1 = generation.sampling.probs(target(torch.tensor([prompt])).logits[0, -1])
        p2 = torch.stack(
            [
                generation.sampling.probs(target(torch.tensor([[*prompt, t]])).logits[0, -1])
                for t in range(VOCAB)
            ]
        )
    joint = (p1[:, None] * p2).flatten().numpy()
    samples = []
    for seed in range(SAMPLES):
        run_params = GenerationParams(**{**generation.__dict__, "seed": seed})
        x1, x2 = list(engine.generate(prompt, run_params))[-1].token_ids[:2]
        samples.append(x1 * VOCAB + x2)
    return spy.sources, samples, joint / joint.sum()


def test_lookup_run_extended_by_the_model_keeps_the_target_distribution():
    # The lookup finds one token after "1 1" (the match overlaps the suffix); with k pinned
    # to 2 the model drafts the second, so each step verifies a one-hot row then a model q.
    sources, samples, joint = two_token_samples(draft_length=2)
    assert sources[0] is DraftSource.LOOKUP_MODEL
    assert chi_square_pvalue(samples, joint) > 1e-3


def test_copies_resumed_after_a_model_token_keep_the_target_distribution(monkeypatch):
    # Every step asks the model for 2 tokens; where its first token makes the text match
    # again ("1" after "3 1 1 1"), a copy takes the second position, else the model does.
    # So the draft's second row is one-hot or the model's q depending on the first token.
    monkeypatch.setattr(SourcePolicy, "choose", lambda self, budget, *rest: Choice(0, min(2, budget)))
    monkeypatch.setattr(SourcePolicy, "resume_copies", lambda self, step, n, drafted, rn, found, *rest: found)
    sources, samples, joint = two_token_samples()
    assert DraftSource.MODEL_LOOKUP in sources and DraftSource.MODEL in sources
    assert chi_square_pvalue(samples, joint) > 1e-3


def test_copies_resumed_after_model_tokens_never_change_greedy_output(tokenizer, target, monkeypatch):
    monkeypatch.setattr(SourcePolicy, "choose", lambda self, budget, *rest: Choice(0, min(4, budget)))
    monkeypatch.setattr(SourcePolicy, "resume_copies", lambda self, step, n, drafted, rn, found, *rest: found)
    spy = SourceSpy(LookupThenModelDrafter(ModelDrafter(perturbed(target, 0.05), "d")))
    engine = SpeculativeEngine(target, tokenizer, spy)
    engine.costs = FrozenCosts(verify=dict(CPU_VERIFY), draft_token=0.02)
    prompt = tokenizer(REPETITIVE)["input_ids"]
    done = list(engine.generate(prompt, GenerationParams(max_new_tokens=40)))[-1]
    assert list(done.token_ids) == hf_greedy(target, prompt, 40)
    assert DraftSource.MODEL_LOOKUP in spy.sources


def failing_sources_probed_every_other_step() -> SourcePolicy:
    """Both sources look unprofitable, the copies slightly less so; a probe every 2nd plain step."""
    steep = {m: 0.10 * (1 + 0.3 * (m - 1)) for m in range(1, 10)}  # a copy must be right 30% of the time
    policy = policy_with(model_runs=[(4, 0)] * 30, lookup_runs=[(4, 0)] * 27 + [(4, 1)] * 3, verify=steep)
    policy.prober.every = 2
    return policy


def test_probes_also_remeasure_a_model_draft_that_looks_worse_than_failing_copies():
    # Sampling, so copies are scored only when drafted: every other probe must still try
    # the model, or a model that drafts this answer well is never found out.
    policy = failing_sources_probed_every_other_step()
    probes = [c for c in (policy.choose(budget=8, match_n=3, found=4, t_draft=0.05) for _ in range(8)) if c.probe]
    assert len(probes) == 4
    assert any(p.lookup_tokens > 0 for p in probes)
    assert any(p.lookup_tokens == 0 and p.model_tokens > 0 for p in probes)


def test_greedy_probes_draft_the_model_alone_since_copies_are_scored_without_drafting():
    # Under greedy decoding a probe that drafts copies learns nothing `observe_unused_lookup`
    # would not, so every probe tries the model (traced: probes alternating with failing
    # copies kept a question's answer plain for 21 steps where the model alone drafted
    # again after 10).
    policy = failing_sources_probed_every_other_step()
    choices = [policy.choose(budget=8, match_n=3, found=4, t_draft=0.05, greedy=True) for _ in range(8)]
    probes = [c for c in choices if c.probe]
    assert len(probes) == 4
    assert all(p.lookup_tokens == 0 and p.model_tokens > 0 for p in probes)
    assert all(c == PLAIN for c in choices if not c.probe)


def test_copies_drafted_now_and_then_do_not_keep_the_model_from_being_tried_again():
    # The model looks unprofitable; a match turns up every 5th step and its copies pay.
    # Each copied step ended the run of plain steps a probe waits for, so the model never
    # drafted again (measured: 70 plain steps, 11 copied, no model token, on a prompt the
    # model alone drafted at 2.15x the target).
    policy = policy_with(model_runs=[(4, 0)] * 30, lookup_runs=[(4, 4)] * 30)
    model_steps = 0
    for step in range(40):
        found = 4 if step % 5 == 0 else 0
        choice = policy.choose(budget=8, match_n=3, found=found, t_draft=0.05)
        model_steps += choice.model_tokens > 0
        policy.observe(choice, 3, choice.model_tokens, choice.lookup_tokens)  # copies right, model wrong
    assert 1 <= model_steps <= 40 // policy.prober.every


def sure_drafter(target, costs: CostModel, pinned: int | None = None) -> ModelDrafter:
    """The target as its own draft, calibrated as always right: every token it drafts pays."""
    drafter = ModelDrafter(target, "same")
    for b in range(ConfidenceCalibration.BINS):
        for _ in range(20):
            drafter.calibration.observe((b + 0.5) / ConfidenceCalibration.BINS, True)
    drafter.start(DraftPlan(costs=costs, pinned=pinned))
    return drafter


@pytest.mark.parametrize("strategy", ["model", "policy"])
def test_a_sure_draft_runs_past_a_short_planned_length(tokenizer, target, strategy):
    # Acceptance by position says one token (position 2 was rejected again and again),
    # but each token of this draft is sure: the early stop, not the plan, ends the run.
    costs = CostModel(verify=dict(CPU_VERIFY), draft_token=0.02)
    drafter = sure_drafter(target, costs)
    drafting = drafter if strategy == "model" else LookupThenModelDrafter(drafter)
    drafting.start(DraftPlan(costs=costs))
    estimate = drafter.controller.acceptance if strategy == "model" else drafting.policy.model
    for _ in range(30):
        estimate.observe(2, 1)
    planned = (
        drafter.controller.choose_k(limit=8) if strategy == "model" else drafting.policy.choose(8, 0, 0, 0.02).model_tokens
    )
    assert planned == 1
    prompt = tokenizer("def add(a, b):")["input_ids"]
    draft = drafting.draft(prompt, 8, GenerationParams().sampling, None)
    assert len(draft.tokens) == 8


def test_a_pinned_length_is_drafted_exactly_even_when_sure(tokenizer, target):
    costs = CostModel(verify=dict(CPU_VERIFY), draft_token=0.02)
    drafter = sure_drafter(target, costs, pinned=2)
    prompt = tokenizer("def add(a, b):")["input_ids"]
    assert len(drafter.draft(prompt, 8, GenerationParams().sampling, None).tokens) == 2
