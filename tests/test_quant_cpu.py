"""The CPU int8 path is batch-invariant, so verifying k tokens equals decoding them one by one."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import hf_greedy

from specdec_core.engine.drafters import ModelDrafter, NgramDrafter
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
from specdec_core.kernels.cpu import features
from specdec_core.kernels.cpu.quant_cpu import (
    KERNEL_ENV,
    ONEDNN_ISA_ENV,
    OnednnInt8,
    PerTokenInt8Linear,
    int8_available,
    kernel_name,
    quantize_linears_int8,
    quantize_weight,
)

pytestmark = pytest.mark.skipif(not int8_available(), reason="this torch build has no int8 kernels")


def _kernels() -> list[str]:
    names = ["fbgemm"] if "fbgemm" in torch.backends.quantized.supported_engines else []
    return names + (["onednn"] if kernel_name() == "onednn" else [])


@pytest.mark.parametrize("kernel", _kernels())
def test_rows_are_bitwise_equal_batched_or_alone(kernel):
    torch.manual_seed(0)
    layer = PerTokenInt8Linear(torch.nn.Linear(96, 200), kernel=kernel)
    x = torch.randn(33, 96) * torch.logspace(-2, 2, 33)[:, None]  # rows of very different scales
    batched = layer(x)
    for rows in (1, 2, 5, 16):
        pieces = torch.cat([layer(x[i : i + rows]) for i in range(0, 33, rows)])
        assert torch.equal(batched, pieces), rows


@pytest.mark.parametrize("kernel", _kernels())
def test_int8_stays_close_to_fp32(kernel):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 128)
    x = torch.randn(4, 256)
    ref = linear(x)
    err = (PerTokenInt8Linear(linear, kernel=kernel)(x) - ref).abs().max() / ref.abs().max()
    assert err < 0.03


@pytest.mark.parametrize("kernel", _kernels())
def test_the_kernel_gives_back_the_weights_it_was_given(kernel):
    torch.manual_seed(0)
    linear = torch.nn.Linear(700, 37)  # more inputs than one read-back chunk
    values, scales = quantize_weight(linear.weight)
    layer = PerTokenInt8Linear(linear, kernel=kernel)
    got_values, got_scales = layer.int8_weight()
    assert torch.equal(got_values, values)
    assert torch.equal(got_scales, scales)


def test_onednn_returns_the_exact_integer_products():
    if kernel_name() != "onednn":
        pytest.skip("oneDNN does not sum int8 exactly on this CPU; fbgemm is used")
    torch.manual_seed(0)
    values = torch.randint(-127, 128, (50, 300), dtype=torch.int8)
    kernel = OnednnInt8(values, torch.ones(50))
    q = torch.randint(-127, 128, (7, 300), dtype=torch.int8)
    sums = kernel.sums((q.short() + 128).to(torch.uint8))
    assert torch.equal(sums, (q.long() @ values.long().t()).float())


def test_onednn_layers_survive_a_deep_copy():
    if kernel_name() != "onednn":
        pytest.skip("oneDNN does not sum int8 exactly on this CPU; fbgemm is used")
    layer = PerTokenInt8Linear(torch.nn.Linear(32, 16), kernel="onednn")
    x = torch.randn(3, 32)
    assert torch.equal(copy.deepcopy(layer)(x), layer(x))


def test_int8_kernel_can_be_chosen_by_environment(monkeypatch):
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("no fbgemm in this torch build")
    monkeypatch.setenv(KERNEL_ENV, "fbgemm")
    kernel_name.cache_clear()
    try:
        assert PerTokenInt8Linear(torch.nn.Linear(8, 4)).kernel.name == "fbgemm"
    finally:
        monkeypatch.delenv(KERNEL_ENV)
        kernel_name.cache_clear()


def test_a_cpu_without_vnni_or_amx_keeps_fbgemm(monkeypatch):
    monkeypatch.setattr(features, "cpuinfo", lambda: "flags\t\t: avx2 fma f16c avx512f avx512_vnni amx_int8\n")
    monkeypatch.setenv(features.ISA_ENV, "avx2")  # as on a Zen 3
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.delenv(ONEDNN_ISA_ENV, raising=False)
    assert kernel_name.__wrapped__() == "fbgemm"


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


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_a_quantized_model_keeps_nothing_of_the_checkpoint_file_mapped(tiny_folder, precision):
    from specdec_core.kernels.cpu import native
    from specdec_core.models import cpu_backend, loading

    if precision == "int4" and native.unavailable() is not None:
        pytest.skip(native.unavailable())
    if precision == "int8" and not int8_available():
        pytest.skip("no int8 kernel on this CPU")
    model = loading.load_model(str(tiny_folder), device="cpu", precision=precision).model
    files = cpu_backend._file_mappings()
    assert files  # the test reads Linux's map of the process (shared libraries at least)
    in_file = [
        name
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if any(start <= tensor.data_ptr() < end for start, end in files)
    ]
    assert in_file == []  # e.g. the norms' weights, which kept the whole file mapped and resident
