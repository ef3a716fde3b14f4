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

from specdec_core import native
from specdec_core.batch_invariant import make_batch_invariant
from specdec_core.drafters import LookupThenModelDrafter, ModelDrafter, NgramDrafter, NoDrafter
from specdec_core.engine import GenerationParams, SpeculativeEngine
from specdec_core.fused_int8 import fuse_int8_projections
from specdec_core.int4_cpu import quantize_linears_int4
from specdec_core.layers_cpu import speed_up_layers
from specdec_core.quant_cpu import int8_available, quantize_linears_int8

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
    if precision == "int8":
        quantize_linears_int8(model)
    if precision == "int4":
        assert quantize_linears_int4(model) > 0
    if precision in ("int8", "int4"):
        fuse_int8_projections(model)
    make_batch_invariant(model)
    if precision in ("int8", "int4"):
        speed_up_layers(model)  # the plain Llama-shaped families: norms and rotary in C
    return model


def drafters(draft_model) -> dict[str, object]:
    return {
        "model": ModelDrafter(draft_model, "draft"),
        "ngram": NgramDrafter(),
        "lookup+model": LookupThenModelDrafter(ModelDrafter(draft_model, "draft")),
    }


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
    accepted = 0
    for name, drafter in drafters(draft).items():
        engine.set_drafter(drafter)
        done = list(engine.generate(prompt, params))[-1]
        assert list(done.token_ids) == alone, f"{name} departs from the target alone"
        accepted += done.stats.accepted
    assert accepted > 0  # speculation really ran
