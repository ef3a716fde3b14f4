"""Conformance: greedy speculation equals the target alone, on every family, precision and drafter.

Contexts run well past the 16-token sliding window of the families that have one.
The reference is the engine's own plain decoding (k = 0), which itself equals
transformers' `generate(do_sample=False)`: on the unmodified model in fp32, on the
model as loaded (batch-invariant) at other precisions.
"""

from __future__ import annotations

import copy

import pytest
import torch
from archs import ARCHS, arch_model
from tiny import hf_greedy, perturbed

from specdec_core.engine.drafters import LookupThenModelDrafter, ModelDrafter, NgramDrafter, NoDrafter
from specdec_core.engine.events import ReadingEvent
from specdec_core.engine.selfcheck import check_exactness
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
from specdec_core.engine.suffix_drafter import SuffixDrafter
from specdec_core.kernels.cpu import native
from specdec_core.kernels.cpu.int4_cpu import Int4Linear
from specdec_core.kernels.cpu.quant_cpu import int8_available
from specdec_core.models.cpu_backend import prepare_for_cpu

PRECISIONS = [
    "fp32",
    "bf16",
    *(["int8"] if int8_available() else []),
    *(["int4"] if native.unavailable() is None else []),
]
NEW_TOKENS = 40
PROMPT = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n"


def at_precision(model, precision: str):
    """What the loader makes of an fp32 checkpoint on CPU."""
    model = copy.deepcopy(model)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    prepare_for_cpu(model, precision)  # at int4/int8: the plain Llama-shaped families' layers in C
    if precision == "int4":
        assert any(isinstance(m, Int4Linear) for m in model.modules())
    return model


def drafters(draft_model) -> dict[str, object]:
    return {
        "model": ModelDrafter(draft_model, "draft"),
        "ngram": NgramDrafter(),
        "lookup+model": LookupThenModelDrafter(ModelDrafter(draft_model, "draft")),
        "cascade": LookupThenModelDrafter(ModelDrafter(draft_model, "draft"), cascade=True),
        "suffix": SuffixDrafter(),
        "suffix+model": LookupThenModelDrafter(ModelDrafter(draft_model, "draft"), SuffixDrafter(min_match=2)),
    }


def accepted_by_every_drafter(engine, draft_model, prompt, params, alone, what: str = "", make=None) -> int:
    """Asserts that every drafter (`make(draft_model)`, default `drafters`) gives `alone`, the
    target alone's tokens; returns the drafts accepted."""
    accepted = 0
    for name, drafter in (make or drafters)(draft_model).items():
        engine.set_drafter(drafter)
        done = list(engine.generate(prompt, params))[-1]
        assert list(done.token_ids) == alone, f"{what}{name} departs from the target alone"
        accepted += done.stats.accepted
    return accepted


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_drafter_reproduces_the_target_alone(tokenizer, arch, precision):
    native = arch_model(arch, len(tokenizer))
    target = at_precision(native, precision)
    draft = at_precision(perturbed(native, 0.05), precision)
    prompt = tokenizer(PROMPT)["input_ids"]
    engine = SpeculativeEngine(target, tokenizer, NoDrafter())
    params = GenerationParams(max_new_tokens=NEW_TOKENS, draft_length=3)

    def run() -> list[int]:
        return list(list(engine.generate(prompt, params))[-1].token_ids)

    alone = run()
    # fp32: transformers' own decoding of the unmodified model; elsewhere of the model as
    # loaded (transformers' kernels then group tokens differently than plain steps).
    assert alone == hf_greedy(native if precision == "fp32" else target, prompt, NEW_TOKENS)
    assert accepted_by_every_drafter(engine, draft, prompt, params, alone) > 0  # speculation really ran


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_prompt_read_in_chunks_gives_the_numbers_of_one_forward(tokenizer, arch, precision):
    """Where the self-check measures bitwise, the engine reads long prompts in chunks
    (engine._prefill_chunk): every family's cache must then hold the same bits, past its
    sliding window too."""
    engine = SpeculativeEngine(at_precision(arch_model(arch, len(tokenizer)), precision), tokenizer)
    engine.exactness = check_exactness(engine)
    assert engine.exactness.bitwise
    prompt = tokenizer(PROMPT * 2)["input_ids"]
    runner = engine.target

    def next_logits(chunk: int) -> torch.Tensor:
        runner.reset()
        for first in range(0, len(prompt) - 1, chunk):
            runner.forward(prompt[first : min(first + chunk, len(prompt) - 1)], logits_to_keep=1)
        return runner.forward(prompt[-1:], logits_to_keep=1)

    whole = next_logits(len(prompt))
    for chunk in (5, 16):
        assert torch.equal(next_logits(chunk), whole), f"chunks of {chunk} change the numbers"
    engine.prefill_chunk = 5
    runner.reset()
    chunked = list(engine.generate(prompt, GenerationParams(max_new_tokens=8)))
    assert any(isinstance(e, ReadingEvent) for e in chunked)
    engine.exactness = None  # now one forward
    runner.reset()
    assert chunked[-1].token_ids == list(engine.generate(prompt, GenerationParams(max_new_tokens=8)))[-1].token_ids
