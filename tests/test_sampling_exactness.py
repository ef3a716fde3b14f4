"""Sampling exactness: speculative sampling draws from the target's processed distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tiny import perturbed, tiny_model
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec_core.engine.acceptance import accept_sampled
from specdec_core.engine.drafters import ModelDrafter, NgramDrafter
from specdec_core.engine.sampling import SamplingParams, sample
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
from specdec_core.engine.suffix_drafter import SuffixDrafter

VOCAB = 12
SAMPLES = 1500  # engine runs per statistical test: ~20 s on 2 cores


def chi_square_pvalue(samples: list[int], probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    expected = probs / probs.sum() * len(samples)
    keep = expected >= 5  # merge rare cells so the test's approximation holds
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_rejection_rule_reproduces_the_target_distribution(deterministic_draft):
    gen = torch.Generator().manual_seed(0)
    k = 3
    p = torch.softmax(torch.randn(k + 1, VOCAB, generator=gen) * 2, dim=-1)
    q = torch.softmax(torch.randn(k, VOCAB, generator=gen) * 2, dim=-1)
    firsts = []
    for _ in range(20000):
        draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        if deterministic_draft:
            draft = [3, 5, 7]
        verdict = accept_sampled(draft, None if deterministic_draft else q, p, gen)
        firsts.append(draft[0] if verdict.accepted > 0 else verdict.next_token)
    assert chi_square_pvalue(firsts, p[0].numpy()) > 1e-3


def test_sampling_params_match_transformers_warpers():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 3
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.8)
    ids = torch.zeros(3, 1, dtype=torch.long)
    ref = logits.clone()
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(10), TopPLogitsWarper(0.8)):
        ref = warper(ids, ref)
    torch.testing.assert_close(params.probs(logits), torch.softmax(ref, dim=-1))


@pytest.mark.parametrize("top_p", [0.5, 0.95, 0.999])
def test_a_nucleus_wider_than_the_first_candidates_still_matches_transformers(top_p):
    # Nearly flat logits over 5,000 tokens: the nucleus holds hundreds to thousands of tokens,
    # far more than the partial selection looks at first.
    logits = torch.randn(2, 5000, generator=torch.Generator().manual_seed(2)) * 0.3
    ref = TopPLogitsWarper(top_p)(torch.zeros(2, 1, dtype=torch.long), logits.clone())
    ours = SamplingParams(temperature=1.0, top_p=top_p).probs(logits)
    assert torch.equal(ours > 0, torch.softmax(ref, dim=-1) > 0)
    assert int((ours[0] > 0).sum()) > 64
    torch.testing.assert_close(ours, torch.softmax(ref, dim=-1))


def test_a_draw_follows_the_probabilities_and_never_picks_a_zero():
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.5, dim=-1)
    probs[[0, 4, VOCAB - 1]] = 0.0  # the first, a middle and the last entry cut off
    probs /= probs.sum()
    draws = [sample(probs, gen) for _ in range(20000)]
    assert not {0, 4, VOCAB - 1} & set(draws)
    assert chi_square_pvalue(draws, probs.numpy()) > 1e-3


def tiny_vocab_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=6, top_p=0.9)]
)
def test_engine_first_two_tokens_follow_plain_target_sampling(params):
    """Three new tokens, so the first verify checks k = 2 drafts; (x1, x2) must follow the target."""
    target = tiny_model(VOCAB, seed=3, layers=1, hidden=32)
    draft = ModelDrafter(perturbed(target, 0.5, seed=4), "perturbed")
    engine = SpeculativeEngine(target, tiny_vocab_tokenizer(), draft)
    prompt = [1, 2, 3]
    with torch.no_grad():
        p1 = params.probs(target(torch.tensor([prompt])).logits[0, -1])
        p2 = torch.stack(
            [params.probs(target(torch.tensor([[*prompt, t]])).logits[0, -1]) for t in range(VOCAB)]
        )
        q1 = params.probs(draft.runner.model(torch.tensor([prompt])).logits[0, -1])
    if params.top_k:  # the draft may propose tokens the target's truncation excludes, and vice versa
        assert not torch.equal(p1 > 0, q1 > 0)
    joint = (p1[:, None] * p2).flatten().numpy()  # P(x1, x2) under plain target sampling
    samples = []
    accepted = two_drafts = 0
    gp = GenerationParams(
        max_new_tokens=3,  # the verify always adds a token: k = min(draft_length, 3 - 1) = 2
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        draft_length=3,
    )
    for seed in range(SAMPLES):
        done = list(engine.generate(prompt, GenerationParams(**{**gp.__dict__, "seed": seed})))[-1]
        x1, x2, _ = done.token_ids
        samples.append(x1 * VOCAB + x2)
        accepted += done.stats.accepted
        two_drafts += done.stats.k_histogram.get(2, 0)
    assert accepted > SAMPLES // 5  # the draft was really used, not bypassed
    assert two_drafts >= SAMPLES  # every run's first verify checked two drafts
    assert chi_square_pvalue(samples, joint / joint.sum()) > 1e-3


def test_ngram_drafter_keeps_the_target_distribution():
    target = tiny_model(VOCAB, seed=3, layers=1, hidden=32)
    engine = SpeculativeEngine(target, tiny_vocab_tokenizer(), NgramDrafter(max_ngram=2))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # the n-gram drafter will propose "3 1 2"
    params = SamplingParams(temperature=1.0)
    with torch.no_grad():
        p1 = params.probs(target(torch.tensor([prompt])).logits[0, -1]).numpy()
    firsts = []
    for seed in range(SAMPLES):
        gp = GenerationParams(max_new_tokens=1, temperature=1.0, seed=seed, draft_length=3)
        firsts.append(list(engine.generate(prompt, gp))[-1].token_ids[0])
    assert chi_square_pvalue(firsts, p1) > 1e-3


def test_suffix_drafter_keeps_the_target_distribution():
    """A deterministic draft (q one-hot on each copied token), as for prompt lookup."""
    target = tiny_model(VOCAB, seed=3, layers=1, hidden=32)
    engine = SpeculativeEngine(target, tiny_vocab_tokenizer(), SuffixDrafter())
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # the suffix drafter will propose "3"
    params = SamplingParams(temperature=1.0)
    with torch.no_grad():
        p1 = params.probs(target(torch.tensor([prompt])).logits[0, -1]).numpy()
    firsts, drafted = [], 0
    for seed in range(SAMPLES):
        # Two new tokens: the first verify checks one copied token.
        gp = GenerationParams(max_new_tokens=2, temperature=1.0, seed=seed, draft_length=1)
        done = list(engine.generate(prompt, gp))[-1]
        firsts.append(done.token_ids[0])
        drafted += done.stats.proposed
    assert drafted > 0  # the copies were really verified
    assert chi_square_pvalue(firsts, p1) > 1e-3


def test_a_seed_makes_a_sampled_run_reproducible(tokenizer, target):
    engine = SpeculativeEngine(target, tokenizer, ModelDrafter(perturbed(target, 0.05), "p"))
    prompt = tokenizer("def add(a, b):")["input_ids"]
    # With a pinned k: adaptive k follows measured timings, which change how many random
    # numbers a run draws (the distribution is exact either way, the exact text is not).
    params = GenerationParams(max_new_tokens=30, temperature=0.9, top_p=0.95, seed=42, draft_length=3)
    first = list(engine.generate(prompt, params))[-1].token_ids
    second = list(engine.generate(prompt, params))[-1].token_ids
    other = list(engine.generate(prompt, GenerationParams(**{**params.__dict__, "seed": 43})))[-1].token_ids
    assert first == second
    assert first != other
