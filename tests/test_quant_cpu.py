"""The CPU int8 path is batch-invariant, so verifying k tokens equals decoding them one by one."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import hf_greedy

from specdec_core.drafters import ModelDrafter, NgramDrafter
from specdec_core.engine import GenerationParams, SpeculativeEngine
from specdec_core.quant_cpu import PerTokenInt8Linear, int8_available, quantize_linears_int8

pytestmark = pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm int8 kernels")


def test_rows_are_bitwise_equal_batched_or_alone():
    torch.manual_seed(0)
    layer = PerTokenInt8Linear(torch.nn.Linear(96, 200))
    x = torch.randn(9, 96) * torch.logspace(-2, 2, 9)[:, None]  # rows of very different scales
    batched = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(9)])
    assert torch.equal(batched, alone)


def test_int8_stays_close_to_fp32():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 128)
    x = torch.randn(4, 256)
    ref = linear(x)
    err = (PerTokenInt8Linear(linear)(x) - ref).abs().max() / ref.abs().max()
    assert err < 0.03


@pytest.fixture(scope="module")
def int8_target(target):
    model = copy.deepcopy(target)
    assert quantize_linears_int8(model) > 0
    return model


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_int8_speculative_output_equals_int8_greedy(tokenizer, int8_target, drafter):
    draft = ModelDrafter(copy.deepcopy(int8_target), "same") if drafter == "model" else NgramDrafter()
    engine = SpeculativeEngine(int8_target, tokenizer, draft)
    prompt = tokenizer("def add(a, b):\n    return a + b\n")["input_ids"]
    done = list(engine.generate(prompt, GenerationParams(max_new_tokens=40, draft_length=5)))[-1]
    assert list(done.token_ids) == hf_greedy(int8_target, prompt, 40)
