"""With int8 linears and row-wise attention a token's logits do not depend on batching."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from tiny import hf_greedy, perturbed, tiny_model
from transformers import DynamicCache

from specdec_core.batch_invariant import make_batch_invariant
from specdec_core.drafters import ModelDrafter
from specdec_core.engine import GenerationParams, SpeculativeEngine
from specdec_core.quant_cpu import int8_available, quantize_linears_int8

pytestmark = pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm int8 kernels")


def exact_int8(model):
    model = copy.deepcopy(model)
    quantize_linears_int8(model)
    assert make_batch_invariant(model)
    return model


@torch.inference_mode()
def logits_in_groups(model, ids: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    cache = DynamicCache(config=model.config)
    parts = [model(ids[:, s:e], cache=cache).logits[0] for s, e in itertools.pairwise(bounds)]
    return torch.cat(parts)


def test_logits_are_bitwise_equal_however_tokens_are_grouped(tokenizer):
    model = exact_int8(tiny_model(len(tokenizer), seed=0, layers=3, hidden=128))
    ids = torch.randint(0, len(tokenizer), (1, 48), generator=torch.Generator().manual_seed(0))
    whole = logits_in_groups(model, ids, [0, 48])
    assert torch.equal(whole, logits_in_groups(model, ids, [0, 20, 21, 26, 27, 48]))  # prefill + verifies
    assert torch.equal(whole, logits_in_groups(model, ids, list(range(49))))  # one token at a time


def test_sliding_window_models_keep_their_attention(tokenizer):
    model = tiny_model(len(tokenizer))
    model.config.use_sliding_window = True
    model.config.sliding_window = 16
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    assert not make_batch_invariant(model)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int8_speculation_reproduces_int8_greedy_on_wider_models(tokenizer, seed):
    target = exact_int8(tiny_model(len(tokenizer), seed=seed, layers=3, hidden=128))
    draft = ModelDrafter(
        exact_int8(perturbed(tiny_model(len(tokenizer), seed=seed, layers=3, hidden=128), 0.1)), "p"
    )
    engine = SpeculativeEngine(target, tokenizer, draft)
    prompt = tokenizer("for i in range(10):\n    print(i * i)\n")["input_ids"]
    done = list(engine.generate(prompt, GenerationParams(max_new_tokens=48, draft_length=4)))[-1]
    assert done.stats.accepted > 0
    assert list(done.token_ids) == hf_greedy(target, prompt, 48)
