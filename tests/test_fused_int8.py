"""Fused q/k/v and gate/up int8 linears compute bitwise the logits of the separate ones."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from tiny import tiny_model
from transformers import DynamicCache

from specdec_core.engine.events import DoneEvent
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
from specdec_core.kernels.batch_invariant import make_batch_invariant
from specdec_core.kernels.cpu.fused_int8 import (
    FusedGateUpMLP,
    FusedProjection,
    apply_fusion,
    fuse_int8_projections,
)
from specdec_core.kernels.cpu.quant_cpu import int8_available, quantize_linears_int8
from specdec_core.tools.bench import measure_fusion_gain, step_bytes

pytestmark = pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm int8 kernels")


@pytest.fixture(scope="module")
def int8_pair(tokenizer):
    """The tiny target at our int8, separate and fused (same quantised weights)."""
    separate = copy.deepcopy(tiny_model(len(tokenizer), seed=0, layers=2, hidden=128))
    quantize_linears_int8(separate)
    make_batch_invariant(separate)
    fused = copy.deepcopy(separate)
    assert fuse_int8_projections(fused) == 4  # q/k/v and gate/up in each of 2 layers
    return separate, fused


@torch.inference_mode()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """A 20-token prefill, a 5-token verify, then 3 one-token steps."""
    cache = DynamicCache(config=model.config)
    bounds = [0, 20, 25, 26, 27, 28]
    return torch.cat([model(ids[:, s:e], cache=cache).logits[0] for s, e in itertools.pairwise(bounds)])


def test_fused_projections_give_bitwise_the_same_logits(int8_pair, tokenizer) -> None:
    separate, fused = int8_pair
    ids = torch.randint(0, len(tokenizer), (1, 28), generator=torch.Generator().manual_seed(3))
    assert torch.equal(_logits(separate, ids), _logits(fused, ids))


def test_fusion_replaces_the_projections(int8_pair) -> None:
    _, fused = int8_pair
    layer = fused.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, FusedProjection)
    assert layer.self_attn.k_proj.shared is layer.self_attn.v_proj.shared
    assert isinstance(layer.mlp, FusedGateUpMLP)


def test_greedy_generation_is_unchanged_by_fusion(int8_pair, tokenizer) -> None:
    texts = []
    for model in int8_pair:
        engine = SpeculativeEngine(model, tokenizer)
        events = engine.generate([5, 6, 7, 8], GenerationParams(max_new_tokens=12))
        texts.append(next(e for e in events if isinstance(e, DoneEvent)).token_ids)
    assert texts[0] == texts[1]


def test_float_models_are_left_alone(tokenizer) -> None:
    model = tiny_model(len(tokenizer), seed=0)
    assert fuse_int8_projections(model) == 0


def test_loading_fuses_unless_told_not_to(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model(len(tokenizer), seed=0)
    quantize_linears_int8(model)
    monkeypatch.setenv("SPECDEC_FUSE", "0")
    assert apply_fusion(model) == 0
    monkeypatch.delenv("SPECDEC_FUSE")
    assert apply_fusion(model) == 4


def test_fusion_gain_times_both_variants(int8_pair) -> None:
    separate, _ = int8_pair
    gain = measure_fusion_gain(separate, sizes=(1, 3), repeats=1, context_tokens=8)
    assert gain is not None and set(gain.fused_min) == {1, 3}
    assert all(t > 0 for t in [*gain.separate_min.values(), *gain.fused_min.values()])


def test_step_bytes_count_each_weight_once_whether_fused_or_not(int8_pair, tokenizer) -> None:
    separate, fused = int8_pair
    # The same weights (fused linears keep fewer 8-byte normalisation constants).
    assert abs(step_bytes(separate).weights - step_bytes(fused).weights) < 100
    plain = tiny_model(len(tokenizer), seed=0, layers=2, hidden=128)
    embedding = plain.get_input_embeddings().weight.numel() * 4
    all_fp32 = sum(t.numel() * t.element_size() for t in [*plain.parameters(), *plain.buffers()])
    assert step_bytes(plain).weights == all_fp32 - embedding  # one embedding row per token, not the table
    assert step_bytes(separate).weights < all_fp32 / 2  # int8 linears: a quarter of their fp32 bytes
