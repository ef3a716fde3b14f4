"""The cascade: the draft model checks copies in one forward before the target verifies them."""

from __future__ import annotations

import torch
from test_drafting import CPU_VERIFY, REPETITIVE, FrozenCosts, SourceSpy
from test_sampling_exactness import SAMPLES, VOCAB, chi_square_pvalue, tiny_vocab_tokenizer
from tiny import hf_greedy, perturbed, tiny_model

from specdec_core.engine.drafters import DraftSource, LookupThenModelDrafter, ModelDrafter
from specdec_core.engine.policy import Choice, SourcePolicy
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine


def test_check_keeps_copies_up_to_the_drafts_first_disagreement(tokenizer, target):
    # The draft is the target itself, so its greedy choices are the target's continuation;
    # a proposal that departs from it at position 3 keeps 3 tokens.
    prompt = tokenizer(REPETITIVE)["input_ids"]
    greedy = hf_greedy(target, prompt, 6)
    proposal = [*greedy[:3], (greedy[3] + 1) % len(tokenizer), *greedy[4:]]
    drafter = ModelDrafter(target, "same")
    kept, after = drafter.check(prompt, proposal)
    assert kept == 3
    assert int(after.argmax()) == greedy[3]  # the draft's own token at the break, free
    assert drafter.runner.ids == [*prompt, *greedy[:3]]  # the cache holds the agreed copies only


def test_check_keeps_a_proposal_the_draft_agrees_with_whole(tokenizer, target):
    prompt = tokenizer(REPETITIVE)["input_ids"]
    greedy = hf_greedy(target, prompt, 7)
    kept, after = ModelDrafter(target, "same").check(prompt, greedy[:6])
    assert kept == 6 and int(after.argmax()) == greedy[6]


def cascade_run(tokenizer, target, draft, monkeypatch, new_tokens: int = 40) -> tuple[list[int], list[DraftSource]]:
    """Greedy tokens and draft sources with a cascade at every step that finds copies."""
    monkeypatch.setattr(
        SourcePolicy,
        "choose",
        lambda self, budget, n, found, *rest: Choice(min(found, budget), 0) if found else Choice(0, min(2, budget)),
    )
    spy = SourceSpy(LookupThenModelDrafter(ModelDrafter(draft, "d"), cascade=True))
    engine = SpeculativeEngine(target, tokenizer, spy)
    engine.costs = FrozenCosts(verify=dict(CPU_VERIFY), draft_token=0.02)
    prompt = tokenizer(REPETITIVE)["input_ids"]
    done = list(engine.generate(prompt, GenerationParams(max_new_tokens=new_tokens)))[-1]
    return list(done.token_ids), spy.sources


def test_a_cascade_never_changes_greedy_output(tokenizer, target, monkeypatch):
    for draft in (target, perturbed(target, 0.3), tiny_model(len(tokenizer), seed=7)):
        tokens, sources = cascade_run(tokenizer, target, draft, monkeypatch)
        assert tokens == hf_greedy(target, tokenizer(REPETITIVE)["input_ids"], 40)
        assert DraftSource.CASCADE in sources


def test_sampling_keeps_copies_unchecked_and_the_target_distribution():
    # The cascade is greedy's: sampled, a step with copies drafts them as before (one-hot
    # rows), and the first two tokens follow the target alone's joint distribution.
    target = tiny_model(VOCAB, seed=3, layers=1, hidden=32)
    spy = SourceSpy(LookupThenModelDrafter(ModelDrafter(perturbed(target, 0.5, seed=4), "p"), cascade=True))
    engine = SpeculativeEngine(target, tiny_vocab_tokenizer(), spy)
    prompt = [3, 1, 1, 1]
    params = GenerationParams(max_new_tokens=3, temperature=1.0, draft_length=2)
    with torch.no_grad():
        p1 = params.sampling.probs(target(torch.tensor([prompt])).logits[0, -1])
        p2 = torch.stack(
            [params.sampling.probs(target(torch.tensor([[*prompt, t]])).logits[0, -1]) for t in range(VOCAB)]
        )
    joint = (p1[:, None] * p2).flatten().numpy()
    samples = []
    for seed in range(SAMPLES):
        x1, x2 = list(engine.generate(prompt, GenerationParams(**{**params.__dict__, "seed": seed})))[-1].token_ids[:2]
        samples.append(x1 * VOCAB + x2)
    assert DraftSource.CASCADE not in spy.sources and DraftSource.LOOKUP_MODEL in spy.sources
    assert chi_square_pvalue(samples, joint / joint.sum()) > 1e-3
