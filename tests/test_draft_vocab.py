"""A truncated draft vocabulary: cheaper draft tokens, the same output."""

from __future__ import annotations

import copy

import torch
from tiny import hf_greedy, tiny_model

from specdec_core.draft_vocab import truncate_draft, useful_rows
from specdec_core.drafters import ModelDrafter
from specdec_core.engine import GenerationParams, SpeculativeEngine
from specdec_core.quant_cpu import int8_available, quantize_linears_int8
from specdec_core.sampling import SamplingParams


def test_rows_are_the_lowest_ids_plus_the_stop_tokens():
    assert useful_rows(10, 4, always=[9, 2, 42]).tolist() == [0, 1, 2, 3, 9]


def test_truncated_draft_keeps_greedy_output_and_proposes_only_kept_ids(tokenizer, target):
    v = len(tokenizer)
    full = ModelDrafter(tiny_model(v, seed=0), "same", vocab_size=v)
    small = truncate_draft(full, 96, always=[v - 1])
    assert full.runner.model.get_output_embeddings().out_features == v  # the original is untouched
    kept = set(small.rows.tolist())
    proposed: list[int] = []
    original = small.propose

    def spy(*args, **kwargs):
        draft = original(*args, **kwargs)
        proposed.extend(draft.tokens)
        return draft

    small.propose = spy  # type: ignore[method-assign]
    engine = SpeculativeEngine(target, tokenizer, small)
    prompt = tokenizer("def add(a, b):\n    return a + b\n\nfor i in range(10):")["input_ids"]
    done = list(engine.generate(prompt, GenerationParams(max_new_tokens=30, draft_length=4)))[-1]
    assert list(done.token_ids) == hf_greedy(target, prompt, 30)
    assert proposed and set(proposed) <= kept
    assert done.stats.accepted > 0


def test_truncated_draft_gives_zero_probability_outside_its_rows(tokenizer):
    v = len(tokenizer)
    small = truncate_draft(ModelDrafter(tiny_model(v, seed=2), "d", vocab_size=v), 64)
    gen = torch.Generator().manual_seed(0)
    draft = small.propose([1, 2, 3], 3, SamplingParams(temperature=1.0), gen)
    assert draft.probs is not None and draft.probs.shape == (3, v)
    assert float(draft.probs[:, 64:].sum()) == 0.0
    assert torch.allclose(draft.probs.sum(dim=-1), torch.ones(3))


def test_int8_head_is_truncated_too(tokenizer):
    if not int8_available():
        return
    v = len(tokenizer)
    model = copy.deepcopy(tiny_model(v, seed=0))
    quantize_linears_int8(model)
    full = ModelDrafter(model, "q", vocab_size=v)
    small = truncate_draft(full, v)  # every row kept: the same greedy draft as the full head
    sampling = SamplingParams()
    assert (
        small.propose([5, 6, 7], 4, sampling, None).tokens
        == full.propose([5, 6, 7], 4, sampling, None).tokens
    )
