"""A ranked draft head: cheaper draft tokens where a conversation needs few ids, the same output."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import hf_greedy, tiny_model

from specdec_core.engine.draft_vocab import MAX_MISS, RankedHead, VocabTiers, rank_head, rank_order
from specdec_core.engine.drafters import LookupThenModelDrafter, ModelDrafter
from specdec_core.engine.sampling import SamplingParams
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
from specdec_core.kernels.cpu import native
from specdec_core.kernels.cpu.int4_cpu import head_to_int4, quantize_linears_int4
from specdec_core.models.chat import Message, encode_chat, encode_text, template_token_ids

needs_kernel = pytest.mark.skipif(native.unavailable() is not None, reason="no C kernels here")


def test_stop_tokens_rank_first_then_every_other_id_by_id() -> None:
    assert rank_order(8, first=[6, 2, 6, 99]).tolist() == [6, 2, 0, 1, 3, 4, 5, 7]


def test_a_conversations_wrapping_is_its_special_tokens_and_its_templates_own_text(tokenizer) -> None:
    # Ranked first, these never count against a tier: a chat's turn markers and role names
    # alone kept short conversations from every tier.
    wrapping = template_token_ids(tokenizer)
    assert set(tokenizer.all_special_ids) <= wrapping
    assert set(encode_text(tokenizer, "assistant", add_special_tokens=False)) <= wrapping
    text = "def add(a, b):\n    return a + b"
    chat = encode_chat(tokenizer, [Message("user", text)])
    assert set(chat) - wrapping <= set(encode_text(tokenizer, text, add_special_tokens=False))


def test_a_template_that_refuses_empty_turns_leaves_the_special_tokens(tokenizer) -> None:
    picky = copy.deepcopy(tokenizer)
    picky.chat_template = "{{ raise_exception('say something') }}"
    assert template_token_ids(picky) == set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)


def _int4_draft(v: int, seed: int = 0):
    model = copy.deepcopy(tiny_model(v, seed=seed))
    quantize_linears_int4(model)
    head_to_int4(model)
    return model


def _ranked(model, stops: list[int], tiers: tuple[int, ...]) -> RankedHead:
    head = RankedHead(model.lm_head, rank_order(model.lm_head.out_features, stops), tiers=tiers)
    model.set_output_embeddings(head)
    return head


@needs_kernel
def test_a_ranked_head_gives_bitwise_the_original_logits_and_minus_inf_past_its_limit(tokenizer) -> None:
    model = _int4_draft(len(tokenizer))
    original = model.lm_head
    head = _ranked(model, [len(tokenizer) - 1], tiers=(48,))
    x = torch.randn(3, original.in_features)
    expected = original(x)
    assert torch.equal(head(x), expected)
    with head.scoring(48):
        limited = head(x)
    scored = head.order[:48]
    assert torch.equal(limited[:, scored], expected[:, scored])
    assert torch.isneginf(limited).sum() == 3 * (len(tokenizer) - 48)
    assert bool(torch.isfinite(limited[:, len(tokenizer) - 1]).all())  # the stop token ranks first
    assert head.limit == len(tokenizer)  # every row again outside the block


def test_heads_too_small_for_any_tier_stay_as_they_are(tokenizer) -> None:
    model = tiny_model(len(tokenizer))
    assert rank_head(model, []) is None  # not a 4-bit head
    if native.unavailable() is None:
        small = _int4_draft(len(tokenizer))
        assert rank_head(small, []) is None  # fewer rows than the smallest tier


@needs_kernel
def test_the_tier_follows_the_ids_the_conversation_uses(tokenizer) -> None:
    v = len(tokenizer)
    head = _ranked(_int4_draft(v), [], tiers=(32, 64))
    tiers = VocabTiers(head)
    inside = [i % 32 for i in range(400)]
    assert tiers.limit(inside) == 32
    # One id in 200 past the first tier still fits it; more than that moves up a tier.
    assert tiers.limit([*inside, 40, 41]) == 32
    assert tiers.limit([*inside, 40, 41, 42]) == 64
    assert tiers.limit([*inside, 40, 41, 42, v - 1, v - 2, v - 3]) == v  # past every tier: all rows
    assert tiers.limit(inside[:10]) == 32  # a new conversation is counted afresh
    assert MAX_MISS == 1 / 200


@needs_kernel
@pytest.mark.parametrize("auto", [False, True])
def test_a_draft_scoring_few_rows_keeps_greedy_output_and_proposes_only_those(tokenizer, target, auto) -> None:
    v = len(tokenizer)
    model = _int4_draft(v)
    head = _ranked(model, [v - 1], tiers=(96,))
    model_drafter = ModelDrafter(model, "ranked", vocab_size=v)
    assert model_drafter.tiers is not None
    proposed: list[tuple[int, list[int]]] = []  # (rows scored, tokens proposed) per draft
    original = model_drafter.propose

    def spy(tokens, *args, **kwargs):
        limit = model_drafter.tiers.limit(tokens)
        draft = original(tokens, *args, **kwargs)
        proposed.append((limit, list(draft.tokens)))
        return draft

    model_drafter.propose = spy  # type: ignore[method-assign]
    drafter = LookupThenModelDrafter(model_drafter) if auto else model_drafter
    engine = SpeculativeEngine(target, tokenizer, drafter)
    prompt = [i % 90 for i in range(7, 47)]  # ids inside the tier: the draft scores 96 rows
    done = list(engine.generate(prompt, GenerationParams(max_new_tokens=30, draft_length=4)))[-1]
    assert list(done.token_ids) == hf_greedy(target, prompt, 30)
    # The answer's own ids may leave the tier (then every row is scored); it starts inside.
    assert proposed[0][0] == 96
    for limit, tokens in proposed:
        assert set(tokens) <= set(head.order[:limit].tolist())
    assert head.limit == v


@needs_kernel
def test_rows_left_out_get_zero_draft_probability(tokenizer) -> None:
    v = len(tokenizer)
    model = _int4_draft(v, seed=2)
    head = _ranked(model, [], tiers=(64,))
    drafter = ModelDrafter(model, "d", vocab_size=v)
    gen = torch.Generator().manual_seed(0)
    draft = drafter.propose([1, 2, 3], 3, SamplingParams(temperature=1.0), gen)
    assert draft.probs is not None and draft.probs.shape == (3, v)
    left_out = head.order[64:]
    assert float(draft.probs[:, left_out].sum()) == 0.0
    assert torch.allclose(draft.probs.sum(dim=-1), torch.ones(3))
