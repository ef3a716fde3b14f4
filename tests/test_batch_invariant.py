"""A token's logits do not depend on how tokens are grouped, at every CPU precision."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from archs import ARCHS, WINDOW, arch_model
from tiny import hf_greedy, perturbed, tiny_model

from specdec_core.engine.drafters import ModelDrafter
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
from specdec_core.kernels.batch_invariant import NAME, make_batch_invariant, rowwise_refusal
from specdec_core.kernels.cpu.quant_cpu import int8_available, quantize_linears_int8
from specdec_core.kernels.cpu.runner import new_cache

PRECISIONS = ["fp32", "bf16", *(["int8"] if int8_available() else [])]


def invariant(model, precision: str):
    """A batch-invariant copy of an fp32 model at `precision`, as the loader makes it on CPU."""
    model = copy.deepcopy(model)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    if precision == "int8":
        quantize_linears_int8(model)
    assert make_batch_invariant(model) is None
    return model


@torch.inference_mode()
def logits_in_groups(model, ids: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    cache = new_cache(model.config)
    parts = [model(ids[:, s:e], cache=cache).logits[0] for s, e in itertools.pairwise(bounds)]
    return torch.cat(parts)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_are_bitwise_equal_however_tokens_are_grouped(tokenizer, arch, precision):
    model = invariant(arch_model(arch, len(tokenizer)), precision)
    n = 3 * WINDOW  # past the window of the sliding families
    ids = torch.randint(0, len(tokenizer), (1, n), generator=torch.Generator().manual_seed(0))
    whole = logits_in_groups(model, ids, [0, n])
    assert torch.equal(whole, logits_in_groups(model, ids, [0, 20, 21, 26, 27, n]))  # prefill + verifies
    assert torch.equal(whole, logits_in_groups(model, ids, [0, *range(n - 6, n + 1)]))  # plain steps


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3", "qwen2-swa"])
def test_rowwise_attention_computes_the_models_own_attention(tokenizer, arch):
    """Window (per layer type, or `sliding_window` alone), softcapping, scaling, grouped heads."""
    native = arch_model(arch, len(tokenizer))
    ids = torch.randint(0, len(tokenizer), (1, 3 * WINDOW), generator=torch.Generator().manual_seed(1))
    expected = logits_in_groups(native, ids, [0, 3 * WINDOW])
    model = invariant(native, "fp32")
    assert model.config._attn_implementation == NAME
    torch.testing.assert_close(logits_in_groups(model, ids, [0, 3 * WINDOW]), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"layer_types": ["full_attention", "linear_attention"]}, "linear_attention layers"),
        ({"attention_chunk_size": 8}, "chunked attention"),
    ],
)
def test_attention_it_cannot_reproduce_is_refused_and_left_alone(tokenizer, extra, reason):
    model = tiny_model(len(tokenizer))
    for key, value in extra.items():
        setattr(model.config, key, value)
    assert reason in rowwise_refusal(model.config)
    assert make_batch_invariant(model) == rowwise_refusal(model.config)
    assert model.config._attn_implementation != NAME


@pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm int8 kernels")
@pytest.mark.parametrize("seed", [0, 1])
def test_int8_speculation_reproduces_int8_greedy_on_wider_models(tokenizer, seed):
    target = invariant(tiny_model(len(tokenizer), seed=seed, layers=3, hidden=128), "int8")
    draft = ModelDrafter(
        invariant(perturbed(tiny_model(len(tokenizer), seed=seed, layers=3, hidden=128), 0.1), "int8"), "p"
    )
    engine = SpeculativeEngine(target, tokenizer, draft)
    prompt = tokenizer("for i in range(10):\n    print(i * i)\n")["input_ids"]
    done = list(engine.generate(prompt, GenerationParams(max_new_tokens=48, draft_length=4)))[-1]
    assert done.stats.accepted > 0
    assert list(done.token_ids) == hf_greedy(target, prompt, 48)


@pytest.mark.parametrize("precision", ["nf4", "int8"])
def test_bitsandbytes_layers_compute_their_dequantized_weights_at_one_row_count(
    tmp_path, tokenizer, precision
):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from specdec_core.kernels.batch_invariant import dequantize_bnb

    native = arch_model("qwen2", len(tokenizer))
    native.save_pretrained(tmp_path)
    config = (
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
        if precision == "nf4"
        else BitsAndBytesConfig(load_in_8bit=True)
    )
    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=config, device_map={"": "cpu"}
    )
    assert make_batch_invariant(quantized) is None
    ids = torch.randint(0, len(tokenizer), (1, 24), generator=torch.Generator().manual_seed(2))
    whole = logits_in_groups(quantized, ids, [0, 24])
    assert torch.equal(whole, logits_in_groups(quantized, ids, [0, *range(18, 25)]))
    # What it computes: the fp32 model with the dequantized weights.
    layers = dict(quantized.named_modules())
    with torch.no_grad():
        for name, module in native.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(dequantize_bnb(layers[name]))
    torch.testing.assert_close(whole, logits_in_groups(native, ids, [0, 24]), rtol=0, atol=1e-3)
