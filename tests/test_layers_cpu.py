"""Decoder layers in fewer calls (layers_cpu): the same function as transformers' layers,
the same numbers for a row however tokens are grouped, and only where the shape fits."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from archs import WINDOW, arch_model
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specdec_core.kernels.batch_invariant import make_batch_invariant
from specdec_core.kernels.cpu import layers_cpu, native
from specdec_core.kernels.cpu.fused_int8 import fuse_int8_projections
from specdec_core.kernels.cpu.int4_cpu import quantize_linears_int4
from specdec_core.kernels.cpu.layers_cpu import (
    FastLayer,
    OneCallStack,
    rms_norm,
    rotary,
    silu_mul,
    speed_up_layers,
    writes_cache_in_place,
)
from specdec_core.kernels.cpu.quant_cpu import int8_available, quantize_linears_int8
from specdec_core.kernels.cpu.runner import CachedModel, new_cache

pytestmark = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))
PLAIN = ["llama", "qwen2", "qwen2-swa", "mistral"]
PRECISIONS = ["int4", *(["int8"] if int8_available() else [])]


def loaded(model, precision: str):
    """As the loader makes a CPU int8/int4 model, before the layers are sped up."""
    model = copy.deepcopy(model)
    (quantize_linears_int4 if precision == "int4" else quantize_linears_int8)(model)
    fuse_int8_projections(model)
    assert make_batch_invariant(model) is None
    return model


@torch.inference_mode()
def logits_in_groups(model, ids: torch.Tensor, bounds: list[int], cache=None) -> torch.Tensor:
    cache = cache if cache is not None else DynamicCache(config=model.config)
    return torch.cat([model(ids[:, s:e], cache=cache).logits[0] for s, e in itertools.pairwise(bounds)])


def _ids(tokenizer, n: int) -> torch.Tensor:
    return torch.randint(0, len(tokenizer), (1, n), generator=torch.Generator().manual_seed(0))


def with_our_norms_and_silu(model):
    """transformers' layers, their RMSNorms computed by layers_cpu.rms_norm and their MLP's
    silu(gate) * up by layers_cpu.silu_mul."""
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.forward = lambda x, norm=norm: rms_norm(x, norm)
        mlp = layer.mlp
        mlp.forward = lambda x, mlp=mlp: mlp.down_proj(silu_mul(mlp.gate_up(x), mlp.intermediate))
    return model


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", PLAIN)
def test_fast_layers_compute_bitwise_what_transformers_layers_compute_with_the_same_norm_and_silu(
    tokenizer, arch, precision
):
    """Attention, window, cache, rotary embedding, MLP and residuals wired as transformers wires them.

    Only the norm's order of summation and silu's exponential differ from transformers' own
    layer, and int8 activations can turn such a last-bit difference into a whole
    quantization step, so the comparison is with transformers' layer computing the same
    norm and silu (each checked against torch's own below)."""
    reference = with_our_norms_and_silu(loaded(arch_model(arch, len(tokenizer)), precision))
    fast = loaded(arch_model(arch, len(tokenizer)), precision)
    assert speed_up_layers(fast) == fast.config.num_hidden_layers
    n = 3 * WINDOW  # past the window of the sliding families
    ids = _ids(tokenizer, n)
    for bounds in ([0, n], [0, 20, 21, 26, 27, n]):
        assert torch.equal(logits_in_groups(fast, ids, bounds), logits_in_groups(reference, ids, bounds))


@pytest.mark.parametrize("arch", PLAIN)
def test_one_call_layers_compute_bitwise_what_the_fast_forward_computes(tokenizer, arch):
    """4-bit layers over a cache written in place (one C call each) against the same layers
    over transformers' cache (the Python forward), past the buffer's first growth and
    across a rollback, as speculative decoding crops and refills."""
    model = loaded(arch_model(arch, len(tokenizer)), "int4")
    speed_up_layers(model)
    assert writes_cache_in_place(model)
    n = 300  # past the buffer's first 256 positions
    ids = _ids(tokenizer, n)
    buffered = new_cache(model.config, buffered=True)
    expected = logits_in_groups(model, ids, [0, 250, 251, 259, n])
    assert torch.equal(logits_in_groups(model, ids, [0, 250, 251, 259, n], buffered), expected)
    buffered.crop(-40)  # roll back 40 positions, then feed others over them
    other = _ids(tokenizer, 40).roll(1)
    reference = DynamicCache(config=model.config)
    logits_in_groups(model, ids[:, : n - 40], [0, n - 40], reference)
    assert torch.equal(
        logits_in_groups(model, other, [0, 9, 10, 40], buffered),
        logits_in_groups(model, other, [0, 9, 10, 40], reference),
    )


@pytest.mark.parametrize("arch", PLAIN)
def test_a_model_in_one_call_computes_bitwise_what_its_own_forward_computes(tokenizer, arch):
    """The whole stack of one-call layers as one call (OneCallStack, what CachedModel runs)
    against the model's own forward over the same kind of cache: prefill, verifies, a
    rollback refilled with other tokens. A model with sliding-window layers keeps its own forward."""
    model = loaded(arch_model(arch, len(tokenizer)), "int4")
    speed_up_layers(model)
    ids, other = _ids(tokenizer, 300)[0].tolist(), _ids(tokenizer, 40)[0].roll(1).tolist()
    stacked, own = CachedModel(model), CachedModel(model)
    own.stack = None
    assert stacked.stack is not None and OneCallStack.fits(model)
    used = []
    forward = stacked.stack.forward
    stacked.stack.forward = lambda *a: used.append(forward(*a)) or used[-1]

    def run(runner, bounds, tokens):
        return torch.cat([runner.forward(tokens[s:e], logits_to_keep=e - s) for s, e in itertools.pairwise(bounds)])

    assert torch.equal(run(stacked, [0, 250, 251, 259, 300], ids), run(own, [0, 250, 251, 259, 300], ids))
    stacked.crop(260), own.crop(260)
    assert torch.equal(run(stacked, [0, 9, 10, 40], other), run(own, [0, 9, 10, 40], other))
    windowed = arch in ("qwen2-swa", "mistral")  # their sliding layers keep a rollback cache
    assert all(out is None for out in used) if windowed else all(out is not None for out in used)


def test_a_model_in_one_call_at_one_thread_is_bitwise_the_same_with_the_helper(tokenizer):
    """Beside a busy process the governor runs one thread and shares its linears with a
    helper thread (threads.py): prefill, verifies and a step give the same logits either way."""
    model = loaded(arch_model("qwen2", len(tokenizer)), "int4")
    speed_up_layers(model)
    ids = _ids(tokenizer, 120)[0].tolist()
    bounds = [0, 100, 105, 106, 114, 120]
    threads = torch.get_num_threads()
    runs = []
    try:
        torch.set_num_threads(1)
        for sharing in (False, True, False, True):
            native.share_spare_core(sharing)
            runner = CachedModel(model)
            assert runner.stack is not None
            runs.append(torch.cat([runner.forward(ids[s:e], logits_to_keep=e - s) for s, e in itertools.pairwise(bounds)]))
    finally:
        native.share_spare_core(False)
        torch.set_num_threads(threads)
    assert all(torch.equal(run, runs[0]) for run in runs[1:])


def test_only_4_bit_layers_write_the_cache_in_place(tokenizer):
    four_bit = loaded(arch_model("qwen2", len(tokenizer)), "int4")
    speed_up_layers(four_bit)
    assert writes_cache_in_place(four_bit)
    if int8_available():
        eight_bit = loaded(arch_model("qwen2", len(tokenizer)), "int8")
        speed_up_layers(eight_bit)
        assert not writes_cache_in_place(eight_bit)


def test_silu_mul_is_torchs_silu_times_up_up_to_rounding():
    generator = torch.Generator().manual_seed(4)
    for width in (16, 37):  # whole vectors and a tail
        gate_up = torch.randn(3, 2 * width, generator=generator) * 30  # far into both tails
        gate_up[0, :4] = torch.tensor([0.0, -0.0, 1e-30, -200.0])
        expected = torch.nn.functional.silu(gate_up[:, :width]) * gate_up[:, width:]
        torch.testing.assert_close(silu_mul(gate_up, width), expected, rtol=2e-6, atol=1e-30)


def test_the_norm_is_transformers_rmsnorm_up_to_rounding(tokenizer):
    layer = arch_model("qwen2", len(tokenizer)).model.layers[0]
    norm = layer.input_layernorm
    norm.weight.data = torch.randn(norm.weight.shape, generator=torch.Generator().manual_seed(2))
    x = torch.randn(5, 3, norm.weight.shape[0], generator=torch.Generator().manual_seed(3)) * 4
    torch.testing.assert_close(rms_norm(x, norm), norm(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", PLAIN)
def test_fast_layers_give_a_token_the_same_logits_however_tokens_are_grouped(tokenizer, arch, precision):
    model = loaded(arch_model(arch, len(tokenizer)), precision)
    speed_up_layers(model)
    n = 3 * WINDOW
    ids = _ids(tokenizer, n)
    whole = logits_in_groups(model, ids, [0, n])
    assert torch.equal(whole, logits_in_groups(model, ids, [0, 20, 21, 26, 27, n]))  # prefill + verifies
    assert torch.equal(whole, logits_in_groups(model, ids, [0, *range(n - 6, n + 1)]))  # plain steps


def test_the_rotary_embedding_is_bitwise_transformers_own():
    generator = torch.Generator().manual_seed(0)
    rows, heads, dim = 7, 3, 32
    fused = torch.randn(1, rows, 2 * heads * dim, generator=generator)
    cos, sin = (torch.randn(1, rows, dim, generator=generator) for _ in range(2))
    part = fused[..., : heads * dim]  # a column slice of a fused projection, as the layer gets it
    heads_first = part.view(1, rows, heads, dim).transpose(1, 2)
    expected, _ = apply_rotary_pos_emb(heads_first, heads_first, cos, sin)
    assert torch.equal(rotary(part, cos, sin, dim), expected)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3", "qwen3"])
def test_layers_of_other_shapes_keep_transformers_forward(tokenizer, arch):
    model = arch_model(arch, len(tokenizer))
    quantize_linears_int4(model)
    fuse_int8_projections(model)
    make_batch_invariant(model)
    assert speed_up_layers(model) == 0
    assert not any(isinstance(module, FastLayer) for module in model.modules())


def test_unfused_or_full_precision_layers_keep_transformers_forward(tokenizer):
    model = arch_model("qwen2", len(tokenizer))
    make_batch_invariant(model)  # fp32: transformers' own linears, not fused
    assert speed_up_layers(model) == 0


@pytest.mark.parametrize("whole_model", [True, False])
def test_a_one_call_layer_out_of_memory_raises_and_the_cache_starts_over(tokenizer, monkeypatch, whole_model):
    """A layer that fails half-way has written keys past the held positions; the runner drops
    the cache, so the next forward re-feeds the sequence and gives the same logits (the
    model's layers in one call, or each layer in one)."""
    model = loaded(arch_model("qwen2", len(tokenizer)), "int4")
    speed_up_layers(model)
    runner = CachedModel(model)
    if not whole_model:
        runner.stack = None
    ids = _ids(tokenizer, 12)[0].tolist()
    expected = runner.forward(ids, 1)
    runner.crop(8)

    real = native.library()

    class Failing:
        def __getattr__(self, name):
            return (lambda *args: -1) if name in ("decoder_layer", "decoder_stack") else getattr(real, name)

    with monkeypatch.context() as patch:
        patch.setattr(layers_cpu.native, "library", Failing)
        with pytest.raises(MemoryError, match=r"out of memory in (a|the) decoder layer"):
            runner.forward(ids[8:], 1)
    assert runner.ids == []  # started over
    assert torch.equal(runner.forward(ids, 1), expected)
