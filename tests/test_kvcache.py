"""The KV cache rolls back exactly: past a sliding window, and after a failed forward."""

from __future__ import annotations

import copy

import pytest
import torch
from archs import WINDOW, arch_model
from tiny import hf_greedy

from specdec_core.engine.drafters import NgramDrafter
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
from specdec_core.errors import NumericalError
from specdec_core.kernels.cpu import runner as kvcache
from specdec_core.kernels.cpu.runner import CachedModel


def test_tests_run_with_the_cache_length_check_on():
    assert kvcache.CHECK_INVARIANT  # tests/conftest.py turns it on


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "qwen2-swa"])
def test_cropping_past_the_window_gives_the_logits_of_never_having_gone_there(tokenizer, arch):
    runner = CachedModel(arch_model(arch, len(tokenizer)))
    ids = torch.randint(0, len(tokenizer), (3 * WINDOW,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.forward(ids[: WINDOW + 3], logits_to_keep=1)
    straight = runner.forward(ids[WINDOW + 3 :], logits_to_keep=8)  # well past the window
    runner.crop(WINDOW + 3)  # roll all of it back
    replay = runner.forward(ids[WINDOW + 3 :], logits_to_keep=8)
    assert torch.equal(straight, replay)


def test_a_forward_that_fails_half_way_leaves_a_usable_cache(tokenizer, target, monkeypatch):
    engine = SpeculativeEngine(target, tokenizer, NgramDrafter())
    prompt = tokenizer("def add(a, b):\n    return a + b\n")["input_ids"]
    params = GenerationParams(max_new_tokens=24, draft_length=3)
    expected = hf_greedy(target, prompt, 24)

    mlp = target.model.layers[-1].mlp  # runs after every earlier layer has written its cache
    real_forward, calls = mlp.forward, []

    def fail_on_third_call(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("simulated")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(mlp, "forward", fail_on_third_call)
    with pytest.raises(torch.OutOfMemoryError):
        list(engine.generate(prompt, params))
    monkeypatch.undo()
    # The retry (what the app does after an out-of-memory) gives the right answer.
    assert list(list(engine.generate(prompt, params))[-1].token_ids) == expected


def test_inf_or_nan_logits_stop_generation_with_one_line_and_a_clean_cache(tokenizer, target):
    broken = copy.deepcopy(target)
    with torch.no_grad():
        broken.lm_head.weight[5] = float("inf")  # as an fp16 overflow would
    engine = SpeculativeEngine(broken, tokenizer, NgramDrafter())
    with pytest.raises(NumericalError, match=r"inf/NaN logits at float32.*bf16 or fp32") as raised:
        list(engine.generate(tokenizer("def add(a, b):")["input_ids"], GenerationParams(max_new_tokens=4)))
    assert "\n" not in str(raised.value)
    assert engine.target.ids == []
