"""A 4-bit draft's reads of many tokens in int8 (draft_bulk): only from MIN_ROWS rows, only
where they are faster and the memory is there, and the answer stays the target's."""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import pytest
import torch
from tiny import hf_greedy, tiny_model

from specdec_core.engine import draft_bulk
from specdec_core.engine.draft_bulk import MIN_ROWS, PROBE_ROWS, BulkReads, has_bulk_reads, speed_up_reads
from specdec_core.engine.drafters import ModelDrafter
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
from specdec_core.errors import Cancelled
from specdec_core.kernels.batch_invariant import make_batch_invariant
from specdec_core.kernels.cpu import features, native
from specdec_core.kernels.cpu.fused_int8 import fuse_int8_projections
from specdec_core.kernels.cpu.int4_cpu import Int4Linear, quantize_linears_int4
from specdec_core.kernels.cpu.layers_cpu import speed_up_layers
from specdec_core.kernels.cpu.quant_cpu import onednn_available, onednn_sums_exactly
from specdec_core.kernels.cpu.runner import CachedModel

pytestmark = pytest.mark.skipif(
    native.unavailable() is not None or not onednn_available(), reason="no C kernels or no oneDNN here"
)


def _skip_unless_int8_reads_here() -> None:
    """speed_up_reads' own checks of the CPU: where they fail, int8 reads are rightly off."""
    if not onednn_sums_exactly((MIN_ROWS, PROBE_ROWS)):
        pytest.skip("oneDNN's int8 sums are not exact on this CPU (no VNNI or AMX, or SPECDEC_ISA hides them)")


def _fast_int4_draft(vocab_size: int):
    """A draft as the loader makes a CPU int4 one: 4-bit linears, q/k/v fused, one-call layers."""
    model = copy.deepcopy(tiny_model(vocab_size, seed=3))
    quantize_linears_int4(model)
    fuse_int8_projections(model)
    assert make_batch_invariant(model) is None
    assert speed_up_layers(model) == model.config.num_hidden_layers
    return model


def _timed(monkeypatch, with_int8: float, with_int4: float) -> None:
    """Reads that take `with_int8` seconds with the int8 paths attached, `with_int4` without."""
    monkeypatch.setattr(draft_bulk, "_read_seconds", lambda m: with_int8 if has_bulk_reads(m) else with_int4)


def _count_bulk_calls(monkeypatch) -> list[int]:
    rows: list[int] = []
    matmul = BulkReads.matmul

    def spy(self, x, bias):
        rows.append(x.shape[0])
        return matmul(self, x, bias)

    monkeypatch.setattr(BulkReads, "matmul", spy)
    return rows


def test_reads_of_many_rows_take_int8_and_shorter_forwards_stay_in_one_call(tokenizer, monkeypatch) -> None:
    _skip_unless_int8_reads_here()
    model = _fast_int4_draft(len(tokenizer))
    plain = _fast_int4_draft(len(tokenizer))  # the same weights, no int8 reads
    _timed(monkeypatch, 1.0, 2.0)
    assert speed_up_reads(model)
    rows = _count_bulk_calls(monkeypatch)
    runner, reference = CachedModel(model), CachedModel(plain)
    ids = [(7 * i) % len(tokenizer) for i in range(MIN_ROWS + 8)]
    read = runner.forward(ids, logits_to_keep=1)
    assert rows and set(rows) == {MIN_ROWS + 8}  # every linear of every layer, all rows at once
    rows.clear()
    step = runner.forward([5, 6, 7], logits_to_keep=3)
    assert rows == []  # a draft step keeps the 4-bit one-call layers
    # Other weights, nearly the same numbers: the int8 copy re-quantizes the 4-bit values.
    expected_read = reference.forward(ids, logits_to_keep=1)
    expected_step = reference.forward([5, 6, 7], logits_to_keep=3)
    assert not torch.equal(read, expected_read)
    scale = float(expected_read.abs().max())
    assert float((read - expected_read).abs().max()) < 0.1 * scale
    # The step itself is 4-bit, over keys and values the int8 read wrote: close, not equal.
    assert float((step - expected_step).abs().max()) < 0.1 * scale


def test_a_draft_reading_in_int8_leaves_greedy_output_the_targets(tokenizer, target, monkeypatch) -> None:
    _skip_unless_int8_reads_here()
    model = _fast_int4_draft(len(tokenizer))
    _timed(monkeypatch, 1.0, 2.0)
    assert speed_up_reads(model)
    rows = _count_bulk_calls(monkeypatch)
    engine = SpeculativeEngine(target, tokenizer, ModelDrafter(model, "bulk", vocab_size=len(tokenizer)))
    prompt = [(11 * i + 3) % len(tokenizer) for i in range(MIN_ROWS + 20)]
    done = list(engine.generate(prompt, GenerationParams(max_new_tokens=30, draft_length=4)))[-1]
    assert list(done.token_ids) == hf_greedy(target, prompt, 30)
    assert MIN_ROWS + 20 in rows  # the draft read the prompt through the int8 path


@pytest.mark.parametrize(
    "why", ["not faster", "memory short", "turned off", "sums saturate", "no VNNI or AMX"],
)
def test_no_int8_reads_where_they_do_not_pay_or_fit(tokenizer, monkeypatch, why) -> None:
    model = _fast_int4_draft(len(tokenizer))
    _timed(monkeypatch, 1.9 if why == "not faster" else 1.0, 2.0)
    if why == "memory short":
        monkeypatch.setattr(draft_bulk.psutil, "virtual_memory", lambda: SimpleNamespace(available=1 << 30))
    if why == "turned off":
        monkeypatch.setenv(draft_bulk.ENV_VAR, "0")
    if why == "sums saturate":  # oneDNN without VNNI or AMX adds u8 x s8 pairs in int16
        monkeypatch.setattr(draft_bulk, "onednn_sums_exactly", lambda row_counts: False)
    if why == "no VNNI or AMX":  # a Zen 3, as SPECDEC_ISA=avx2 makes any x86 CPU look
        monkeypatch.setattr(features, "cpuinfo", lambda: "flags\t\t: avx2 fma f16c avx512f avx512_vnni amx_int8\n")
        monkeypatch.setenv(features.ISA_ENV, "avx2")
    assert not speed_up_reads(model)
    assert not has_bulk_reads(model)
    assert all(m.many_rows is None for m in model.modules() if isinstance(m, Int4Linear))


def test_layers_that_are_not_one_call_layers_are_left_alone(tokenizer) -> None:
    model = copy.deepcopy(tiny_model(len(tokenizer)))
    quantize_linears_int4(model)  # 4-bit, but transformers' own layers
    assert not speed_up_reads(model)
    assert not has_bulk_reads(model)


def test_rows_are_quantized_as_torch_would_and_scaled_back_per_row_and_column() -> None:
    lib = native.library()
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(37, 100, generator=generator) * 4
    x[3] = 0.0  # a row of zeros keeps a tiny scale, never a division by zero
    x[4, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 127.0, -127.0])  # ties round to even
    q, scale = torch.empty(37, 100, dtype=torch.uint8), torch.empty(37)
    lib.int8_quantize_rows(x.data_ptr(), 37, 100, q.data_ptr(), scale.data_ptr(), 2)
    expected_scale = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    assert torch.equal(scale, expected_scale.squeeze(1))
    assert torch.equal(q, (torch.round(x / expected_scale) + 128).to(torch.uint8))
    sums, columns, bias = torch.randn(37, 24, generator=generator), torch.rand(24), torch.randn(24)
    for with_bias in (bias, None):
        y = sums.clone()
        lib.int8_scale_rows(
            y.data_ptr(), 37, 24, scale.data_ptr(), columns.data_ptr(), None if with_bias is None else bias.data_ptr(), 2
        )
        expected = sums * scale[:, None] * columns
        assert torch.equal(y, expected if with_bias is None else expected + bias)


def test_a_cancelled_load_stops_making_the_int8_copy(tokenizer, monkeypatch) -> None:
    _skip_unless_int8_reads_here()
    model = _fast_int4_draft(len(tokenizer))
    cancel = threading.Event()
    made: list[BulkReads] = []
    init = BulkReads.__init__

    def counted(self, linear):
        init(self, linear)
        made.append(self)
        cancel.set()  # the user cancels while the first linear is converted

    monkeypatch.setattr(BulkReads, "__init__", counted)
    with pytest.raises(Cancelled):
        speed_up_reads(model, cancel=cancel)
    assert len(made) == 1
    assert not has_bulk_reads(model)
